"""The contracts of a tuning run, each on literal values: early stopping's rule (training losses
windowed, held-out evaluations counted), the keep-or-revert rule, the callback contract checked when a
callback is registered, and the method protocol (a method added to the registry is asked at every
moment of every unit, in order)."""

from __future__ import annotations

import contextlib
import math
import typing
from typing import Any, Self

import pytest
import torch

from finetune.config import FastFinetune
from finetune.recon import finetune_model
from finetune.recon import methods as registry
from finetune.recon.callbacks import EarlyStopping
from finetune.recon.data.losses import Loss, kept_or_reverted
from finetune.recon.hooks import Callback, check_callbacks
from finetune.recon.methods import Method, Part, UnitWork

from .recon_helpers import one_thread, quantized  # noqa: F401  (fixtures)


class Run:
    """What early stopping reads of a run, and where it told a unit to stop."""

    def __init__(self, evaluation_every: int = 0) -> None:
        self.evaluation_every = evaluation_every
        self.stops: list[tuple[int, int]] = []  # (step, tail)
        self.step = 0

    def finish_schedule(self, tail: int) -> None:
        self.stops.append((self.step, tail))


def stops_on_training_losses(losses: list[float], **rule: Any) -> list[tuple[int, int]]:
    """Where EarlyStopping tells a unit without held-out batches to stop, fed these step losses."""
    run, stopping = Run(), EarlyStopping(**rule)
    for step, loss in enumerate(losses):
        run.step = step
        stopping.on_step_end(run, 0, step, loss)
    return run.stops


@pytest.mark.parametrize(("losses", "rule", "stops"), [
    # windowed means 4, 3, 2.33, 2, 2, 2: two without improvement after the best at step 5, so step 7
    ([5, 4, 3, 2, 2, 2, 2, 2], {"patience": 2, "min_delta": 0.0, "warmup": 0, "window": 3}, [(7, 2)]),
    # an improvement smaller than min_delta counts as none: means 4, 3.9, 3.8 stop at step 4 with min_delta 0.5
    ([4, 4, 4, 3.7, 3.7, 3.7], {"patience": 2, "min_delta": 0.5, "warmup": 0, "window": 3}, [(4, 2)]),
    # nothing is judged before the warm-up: flat losses stop patience steps after it
    ([1.0] * 12, {"patience": 3, "min_delta": 0.0, "warmup": 6, "window": 1}, [(9, 3)]),
    # falling losses never stop, and the count starts afresh at each improvement
    ([9, 8, 8, 7, 7, 6, 6, 5], {"patience": 2, "min_delta": 0.0, "warmup": 0, "window": 1}, []),
])
def test_early_stopping_on_training_losses_stops_where_its_rule_says(losses: list[float], rule: dict,
                                                                    stops: list[tuple[int, int]]) -> None:
    assert stops_on_training_losses(losses, **rule) == stops


def test_early_stopping_on_held_out_evaluations_counts_evaluations_not_steps() -> None:
    """Evaluations every 10 steps and patience 25: three evaluations without improvement (25 steps'
    worth, rounded up) stop the unit; training losses are ignored while batches are held out."""
    run, stopping = Run(evaluation_every=10), EarlyStopping(patience=25, min_delta=0.0, warmup=0)
    stopping.on_step_end(run, 0, 0, 100.0)  # ignored: the held-out loss decides
    for step, loss in [(10, 3.0), (20, 2.0), (30, 2.5), (40, 2.0), (50, 2.1), (60, 1.9)]:
        run.step = step
        stopping.on_held_out(run, step, loss)
    assert run.stops == [(50, 25)]


@pytest.mark.parametrize(("before", "after", "status", "kept"), [
    (Loss(1.0, 0.5, 2.0), Loss(0.8, 0.4, 2.0), "kept", "after"),
    (Loss(1.0, 0.5, 2.0), Loss(0.8, 0.5, 2.0), "kept", "after"),  # an equal held-out loss keeps the tuned weights
    (Loss(1.0, 0.5, 2.0), Loss(0.1, 0.6, 2.0), "reverted", "before"),  # judged on the held-out loss, not the training one
    (Loss(1.0, None, 2.0), Loss(1.1, None, 2.0), "reverted", "before"),  # none held out: the training loss judges
    (Loss(1.0, 0.5, 2.0), Loss(math.nan, 0.1, 2.0), "reverted: the tuned loss is nan", "before"),
    (Loss(1.0, 0.5, 2.0), Loss(0.5, math.inf, 2.0), "reverted: the tuned loss is 0.5", "before"),
])
def test_a_unit_is_kept_or_reverted_on_its_judged_loss(before: Loss, after: Loss, status: str, kept: str) -> None:
    assert kept_or_reverted(before, after) == (status, before if kept == "before" else after)


class Misspelt:
    def on_unit_ends(self, index: int) -> None:
        """Would never be called: the moment is on_unit_end."""


class UnknownKeyword:
    def on_held_out(self, tuner: Any, losses: float) -> None:
        """on_held_out passes `loss`, not `losses`."""


class PartialStep:
    def on_step_end(self, tuner: Any, loss: float) -> None:
        """on_step_end is called with all four keywords."""


class Fine(Callback):
    def on_held_out(self, step: int, loss: float) -> None:
        """Any subset of a moment's keywords (but on_step_end's)."""

    def on_after_setup(self, **everything: Any) -> None:
        """A moment Fabric itself passes through."""


def test_a_callback_is_checked_against_the_moments_when_registered() -> None:
    with pytest.raises(ValueError, match=r"^callback Misspelt: on_unit_ends is not a moment of a tuning run \(did you mean "
                                         r"on_unit_end\?\), so it would never be called"):
        check_callbacks([Misspelt()])
    with pytest.raises(ValueError, match=r"^callback UnknownKeyword: on_held_out takes losses, which it is not passed; "
                                         r"on_held_out is passed tuner, index, step, loss$"):
        check_callbacks([UnknownKeyword()])
    with pytest.raises(ValueError, match=r"^callback PartialStep: on_step_end must take index, step too"):
        check_callbacks([PartialStep()])
    assert check_callbacks([Fine(), Callback()])


def test_a_misspelt_callback_stops_finetune_model_before_any_work(quantized: tuple) -> None:
    model, feeds = quantized
    with pytest.raises(ValueError, match="on_unit_ends is not a moment"):
        finetune_model(model, feeds, FastFinetune(iterations=1), callbacks=[Misspelt()])


class Moments(Method):
    """A method that changes nothing and notes every moment it is asked at (class-level, as the
    registry builds it)."""

    heard: list[tuple[Any, ...]] = []

    def prepare(self, module: Any, units: list[Any], warnings: Any) -> list[Any]:
        self.heard.append(("prepare", len(units)))
        return units

    def skip_reason(self, unit: Any, module: Any) -> str | None:
        self.heard.append(("skip_reason", unit.name))
        return None

    def begin(self, work: UnitWork) -> None:
        self.heard.append(("begin", work.index))

    def start(self, work: UnitWork) -> bool:
        self.heard.append(("start", work.index, work.moved))
        return False

    def part(self, work: UnitWork, batches: Any, iterations: int) -> Part:
        return NotingPart(self.heard, work.index, iterations)

    def end(self, work: UnitWork, loss: Loss) -> Loss:
        self.heard.append(("end", work.index))
        return loss

    def record(self) -> dict[str, Any]:
        self.heard.append(("record",))
        return {}

    def report(self, module: Any, units: list[Any]) -> dict[str, Any]:
        return {"moments": len(self.heard)}


class NotingPart(Part):
    """A part that trains nothing and notes when it is installed, asked for its loss term, and hardened."""

    def __init__(self, heard: list[tuple[Any, ...]], index: int, iterations: int) -> None:
        super().__init__()
        self.heard, self.index, self.iterations, self.penalties = heard, index, iterations, 0

    def __enter__(self) -> Self:
        self.heard.append(("enter", self.index, self.iterations))
        return self

    def __exit__(self, *_: object) -> None:
        self.heard.append(("exit", self.index, self.penalties))

    def penalty(self, step: int) -> torch.Tensor | None:
        self.penalties += 1
        return None

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def harden(self) -> None:
        self.heard.append(("harden", self.index))


def test_a_method_in_the_registry_is_asked_at_every_moment_and_changes_nothing_it_does_not_touch(
        quantized: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """One more entry in EXTENSIONS is all a new method needs: it is asked at each moment of each unit
    in the protocol's order, its part is installed around the unit's steps and asked for its term at
    each, its report entry joins the run's, and (changing nothing) the tuned bytes stay those of the run
    without it."""
    model, feeds = quantized
    config = FastFinetune(algorithm="adaround", iterations=6, batch_size=4, validation_share=0, bias_correction=False)
    plain, _ = finetune_model(model, feeds, config)
    monkeypatch.setattr(registry, "EXTENSIONS", (*registry.EXTENSIONS, Moments))
    Moments.heard.clear()
    tuned, report = finetune_model(model, feeds, config)
    units = len(report["units"])
    expected = [("prepare", units)]
    for k in range(units):
        expected += [("skip_reason", report["units"][k]["name"]), ("begin", k), ("start", k, False), ("enter", k, 6),
                     ("exit", k, 6), ("harden", k), ("end", k), ("record",)]
    assert Moments.heard == expected
    assert report["moments"] == len(expected)
    assert tuned.SerializeToString() == plain.SerializeToString()


def test_every_algorithm_the_config_names_is_in_the_registry() -> None:
    """fast_finetune.algorithm's choices and the registry's algorithms are the same names."""
    choices = typing.get_args(typing.get_type_hints(FastFinetune)["algorithm"])
    assert sorted(registry.ALGORITHMS) == sorted(choices)
    assert all(registry.ALGORITHMS[name].name == name for name in choices)
