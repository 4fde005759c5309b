"""The search over rung assignments, knowing nothing of models: each item starts at the top rung;
its sensitivity is the output noise one item alone at a lower rung adds, per bit that saves; the
moves (item to rung) in that order are applied as a growing prefix, and bisection finds the longest
prefix whose measured metric still meets the target (after the move that broke it is skipped, the
bisection goes on over the rest), so the full evaluations grow with log(items), not items."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from .metrics import Metric

logger = logging.getLogger(__name__)

SKIP_ROUNDS = 2  # moves that broke the target and are skipped before the search stops


@dataclass(frozen=True)
class Point:
    """One measured assignment."""

    phase: str  # top | bottom | sensitivity | search | keep_top | repair | curve
    assignment: tuple[int, ...]
    metric: float
    l2: float
    bits: float


@dataclass(frozen=True)
class Move:
    """Lowering one item to one rung: the noise it adds alone and the bits it saves."""

    item: int
    rung: int
    noise: float
    saved: float

    @property
    def score(self) -> float:
        return self.noise / self.saved


Evaluate = Callable[[tuple[int, ...]], tuple[float, float]]  # assignment -> (metric, relative L2)


@dataclass
class Search:
    """A search over `rungs[i]` rungs per item (cheapest first); items in `fixed` stay at the top.
    `evaluate` measures an assignment, `bits` prices it (average bits per element) and `describe`
    says in words what it puts in the model (for the log)."""

    rungs: list[int]
    evaluate: Evaluate
    bits: Callable[[tuple[int, ...]], float]
    metric: Metric
    fixed: frozenset[int] = frozenset()
    describe: Callable[[tuple[int, ...]], str] = lambda assignment: f"rungs {assignment}"
    trace: list[Point] = field(default_factory=list)
    sensitivity: dict[tuple[int, int], Point] = field(default_factory=dict)
    moves: list[Move] = field(default_factory=list)

    @property
    def top(self) -> tuple[int, ...]:
        return tuple(count - 1 for count in self.rungs)

    @property
    def bottom(self) -> tuple[int, ...]:
        return tuple(count - 1 if i in self.fixed else 0 for i, count in enumerate(self.rungs))

    def copy(self) -> Search:
        """A search going on from what this one measured (trace, sensitivity, moves) without adding
        to it: each target's choice starts from the same shared measurements."""
        return dataclasses.replace(self, trace=list(self.trace), sensitivity=dict(self.sensitivity), moves=list(self.moves))

    def measure(self, assignment: tuple[int, ...], phase: str) -> Point:
        """Evaluate an assignment and record it in the trace."""
        metric, l2 = self.evaluate(assignment)
        return self.record(assignment, metric, l2, phase)

    def record(self, assignment: tuple[int, ...], metric: float, l2: float, phase: str) -> Point:
        """Add a measured assignment to the trace."""
        point = Point(phase, assignment, metric, l2, self.bits(assignment))
        self.trace.append(point)
        logger.info("%-11s metric %.6g  relative L2 %.4g  average bits %.3f", phase, metric, l2, point.bits)
        return point

    def measure_sensitivity(self, evaluate_all: Callable[[list[tuple[int, ...]]], list[tuple[float, float]]] | None = None) -> None:
        """Each item alone at each lower rung, the others at the top (all measured by `evaluate_all`
        when given, else one by one); then the moves in order of noise added per bit saved (ties:
        item, then rung; moves that save nothing are dropped)."""
        top = self.top
        base = self.measure(top, "top")
        candidates = [(i, r) for i, count in enumerate(self.rungs) if i not in self.fixed for r in range(count - 1)]
        assignments = [top[:i] + (r,) + top[i + 1:] for i, r in candidates]
        measured = evaluate_all(assignments) if evaluate_all is not None else [self.evaluate(a) for a in assignments]
        for candidate, assignment, (metric, l2) in zip(candidates, assignments, measured, strict=True):
            self.sensitivity[candidate] = self.record(assignment, metric, l2, "sensitivity")
        self.moves = []
        for (i, r), point in self.sensitivity.items():
            saved = base.bits - point.bits
            if saved > 0:
                self.moves.append(Move(i, r, max(point.l2**2 - base.l2**2, 0.0), saved))
        self.moves.sort(key=lambda m: (m.score, m.item, m.rung))

    def apply(self, moves: list[Move], start: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The assignment after `moves` from `start` (default the top): each item at the lowest
        rung any of its moves names."""
        assignment = list(self.top if start is None else start)
        for move in moves:
            assignment[move.item] = min(assignment[move.item], move.rung)
        return tuple(assignment)

    def run(self, target: float) -> tuple[int, ...]:
        """The cheapest assignment found whose metric meets `target`: bisection over the ordered
        moves, then over the moves after each one that broke the target (SKIP_ROUNDS times)."""
        top = self.trace[0] if self.trace and self.trace[0].phase == "top" else self.measure(self.top, "top")
        if not self.metric.meets(top.metric, target):
            raise ValueError(f"target {self.metric.name} {target:g} is missed even with every searched layer at the top "
                             f"rung ({self.metric.name} {top.metric:.6g} there): lower the target or raise the ladder")
        bottom = self.measure(self.bottom, "bottom")
        if self.metric.meets(bottom.metric, target):
            logger.info("the target is met with every searched item at its cheapest rung, which all take: %s",
                        self.describe(self.bottom))
            return self.bottom
        accepted, remaining = self.top, list(self.moves)
        for _ in range(SKIP_ROUNDS + 1):
            if not remaining:
                break
            length = self._longest_prefix(accepted, remaining, target)
            accepted = self.apply(remaining[:length], accepted)
            remaining = remaining[length + 1:]  # the move at `length` broke the target
        return accepted

    def _longest_prefix(self, start: tuple[int, ...], moves: list[Move], target: float) -> int:
        """The largest n such that `start` with the first n moves meets the target (bisection,
        taking the metric as monotone in n; n = 0 is known to meet it)."""
        good, bad = 0, len(moves) + 1
        while bad - good > 1:
            middle = (good + bad) // 2
            point = self.measure(self.apply(moves[:middle], start), "search")
            if self.metric.meets(point.metric, target):
                good = middle
            else:
                bad = middle
        return good

    def keep_top(self, count: int) -> tuple[int, ...]:
        """The `count` items whose bottom rung adds the most noise per bit saved stay at the top;
        the others take the bottom rung."""
        self.measure(self.bottom, "bottom")
        ranked = sorted((m for m in self.moves if m.rung == 0), key=lambda m: (-m.score, m.item))
        high = {m.item for m in ranked[:count]}
        assignment = tuple(self.top[i] if i in high else r for i, r in enumerate(self.bottom))
        self.measure(assignment, "keep_top")
        logger.info("the %d most sensitive searched items stay at the top rung: %s", count, self.describe(assignment))
        return assignment

    def lower(self, count: int) -> tuple[int, ...]:
        """The `count` items whose bottom rung adds the least noise per bit saved take it; the
        others stay at the top (Quark's NumTarget with the cheaper target types)."""
        free = sum(1 for m in self.moves if m.rung == 0)
        return self.keep_top(max(free - count, 0))

    def curve(self, points: int) -> None:
        """Measure `points` prefixes spread evenly over the ordered moves (for the metric-versus-bits picture)."""
        for k in range(1, points + 1):
            length = math.ceil(k * len(self.moves) / (points + 1))
            self.measure(self.apply(self.moves[:length]), "curve")

    def raise_one(self, assignment: tuple[int, ...]) -> tuple[int, ...]:
        """The assignment with the lowered item whose current rung adds the most noise per bit raised one rung."""
        lowered = [i for i, r in enumerate(assignment) if r < self.top[i]]
        if not lowered:
            raise ValueError("every searched layer is already at the top rung")
        by_noise = {(m.item, m.rung): m.score for m in self.moves}
        worst = max(lowered, key=lambda i: (by_noise.get((i, assignment[i]), math.inf), -i))
        return assignment[:worst] + (assignment[worst] + 1,) + assignment[worst + 1:]
