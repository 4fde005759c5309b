"""The automatic mixed precision settings of a config: a ladder of rungs that each target layer may
take (ordered by their bits per element when the search starts, cheapest first, whatever order they
are written in), the metric and the target the final model must reach, and how the search measures
candidates. The search itself is `finetune.automp`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from finetune.formats import bits_per_element

from .formats import DEFAULT_OP_TYPES, FormatChoice, Override
from .schema import ConfigError, Section

METRICS = ("l2", "cosine", "top1_agreement", "top1_accuracy", "perplexity", "next_token_agreement")  # or "module:function" (see finetune.automp.metrics)
Rung = str | Override  # a preset name or path, or the {activation, weight, bias} formats of a layer at that rung
TensorRung = str | FormatChoice  # a preset name or path (its activation or weight format), or one format
GOALS = ("target", "max_drop", "keep_top", "lower")  # exactly one of these says what the search aims at


def choice_bits(choice: FormatChoice | None) -> float:
    """Bits one element costs in a format (None: float32): what orders a ladder's rungs."""
    return bits_per_element(None if choice is None else choice.spec())


@dataclass(frozen=True)
class SplitLadder(Section):
    """Separate ladders for activations and weights (granularity tensor, or both of one length for
    granularity layer, where rung i of one goes with rung i of the other)."""

    activation: tuple[TensorRung, ...]
    weight: tuple[TensorRung, ...]

    def _check(self) -> None:
        for role in ("activation", "weight"):
            if not getattr(self, role):
                raise ConfigError(role, "needs at least one rung")


@dataclass(frozen=True)
class AutoMixedPrecision(Section):
    """Per-layer precision search against an accuracy target. The rungs are ordered by bits per
    element (the costliest is the top); target layers start at the top rung; the least sensitive
    ones per bit saved are lowered while the metric on the evaluation data still meets `target` (or
    stays within `max_drop` of the float model's; or, with `keep_top`, exactly that many of the most
    sensitive layers stay at the top rung and the rest take the bottom one; with `lower`, exactly
    that many of the least sensitive take the bottom rung and the rest stay at the top). Layers in `keep_high` stay at the top rung, those in `exclude` keep the config's
    own formats (each entry a node name, a tensor the node reads, or the node's index among the
    target-op-type nodes in graph order). `costs` scales the bits of a node or op type (default 1). Defaults: the default op
    types, granularity layer, metric top1_agreement, output 0, no fine-tuning in the loop (when true:
    `loop_iterations` per unit of the config's fast_finetune), the calibration data as evaluation data."""

    ladder: tuple[Rung, ...] | SplitLadder
    target: float | None = None
    max_drop: float | None = field(default=None, metadata={"min": 0})
    keep_top: int | None = field(default=None, metadata={"min": 0})
    lower: int | None = field(default=None, metadata={"min": 0})
    metric: str = "top1_agreement"
    target_op_types: tuple[str, ...] = DEFAULT_OP_TYPES
    granularity: Literal["layer", "tensor"] = "layer"
    output_index: int = field(default=0, metadata={"min": 0})
    finetune_in_loop: bool = False
    loop_iterations: int = field(default=50, metadata={"min": 1})
    evaluation_data: str | None = None
    keep_high: tuple[str | int, ...] = ()  # node names, tensors a node reads, or indices among the target nodes
    exclude: tuple[str | int, ...] = ()
    costs: dict[str, float] = field(default_factory=dict)

    def _check(self) -> None:
        goals = [key for key in GOALS if getattr(self, key) is not None]
        if len(goals) != 1:
            raise ConfigError("target", f"give exactly one of {', '.join(GOALS)} (got {goals or 'none'})")
        if self.metric not in METRICS and ":" not in self.metric:
            raise ConfigError("metric", f"must be one of {', '.join(METRICS)} or 'module:function'; got {self.metric!r}")
        if self.metric in ("cosine", "top1_agreement", "top1_accuracy", "next_token_agreement") and self.target is not None and not 0 <= self.target <= 1:
            raise ConfigError("target", f"{self.metric} lies in [0, 1]; got {self.target}")
        if isinstance(self.ladder, tuple) and not self.ladder:
            raise ConfigError("ladder", "needs at least one rung")
        if isinstance(self.ladder, SplitLadder) and self.granularity == "layer" and (
                len(self.ladder.activation) != len(self.ladder.weight)):
            raise ConfigError("ladder", "granularity layer moves a layer's activation and weight together: give ladders "
                              "of one length, or granularity tensor")
        for name, cost in self.costs.items():
            if cost <= 0:
                raise ConfigError(f"costs[{name!r}]", f"must be > 0, got {cost}")
