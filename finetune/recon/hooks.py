"""The callback contract: the moments a tuning run passes through, what a callback is told at each,
and what it may read of the run. Lightning Fabric holds the callbacks (Fabric(callbacks=...)); the
built-in ones (recon.callbacks) and a user's own, passed to finetune_model, hear the same moments.

Every hook is optional; the tuner calls them by name, in this order:

    on_run_start(tuner, units)                       before the first unit
    on_unit_start(tuner, index, unit)                before a unit's loss is first measured
    on_step_end(tuner, index, step, loss)            after each optimizer step of a unit (loss: its batch's MSE)
    on_held_out(tuner, index, step, loss)            where batches are held out, after every tuner.evaluation_every-th
                                                     step: the unit's MSE on them (see data.losses)
    on_unit_end(tuner, index, unit, result, module)  once the unit is kept, reverted or skipped: `result` is its
                                                     report row, `module` the lifted model holding the weights it kept
    on_run_end(tuner, results)                       after the last unit, also when the run fails

Fabric's `call` passes a hook only the keyword arguments it names. on_step_end runs on every step
and is called directly with all four keywords instead, as Fabric calls its own per-step
on_after_optimizer_step: `call` inspects the hook's signature each time (20-60 us, 1-3 % of a step
on small units). A callback ends a unit's optimisation at once by setting `tuner.should_stop`, as
Lightning's EarlyStopping sets `trainer.should_stop`, or after a tail that finishes the unit's
schedule with `tuner.finish_schedule(steps)`. Units a resumed run restores from its checkpoint are
not told again: the run's callbacks heard them in the run that tuned them.

A callback is checked when it is registered (check_callbacks): a method named on_... that is no
moment (a misspelt hook would never fire) or a hook taking a parameter its moment does not pass is
refused with a one-line error."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from typing import Any, Protocol

from lightning.fabric import Fabric

from finetune.config import FastFinetune
from finetune.lift import LiftedModule
from finetune.notices import Warnings

from .rates import RateSearch
from .results import UnitResult
from .units import Unit


class TuningRun(Protocol):
    """What a callback may read of the run it hears (the tuner) and the two ways it may end a unit."""

    config: FastFinetune
    units: list[Unit]
    results: list[UnitResult]  # the finished units' rows, in order
    warnings: Warnings
    resumed_units: int  # the first units, restored from a checkpoint rather than tuned
    fabric: Fabric  # holds the callbacks; over several processes, their process group
    evaluation_every: int  # steps between the unit's held-out evaluations (0: none held out)
    rate_search: RateSearch | None  # what lr: auto tried, once it has
    should_stop: bool  # set to end the unit's optimisation after the current step

    def finish_schedule(self, tail: int) -> None:
        """End the unit's optimisation after `tail` more steps that finish its schedule."""


class Callback:
    """The moments of a tuning run, as a base class to inherit from (or not: any object with some of
    these methods is a callback). Each hook may take any subset of its keywords, but on_step_end all four."""

    def on_run_start(self, tuner: TuningRun, units: list[Unit]) -> None:
        """Before the first unit."""

    def on_unit_start(self, tuner: TuningRun, index: int, unit: Unit) -> None:
        """Before unit `index`'s loss is first measured."""

    def on_step_end(self, tuner: TuningRun, index: int, step: int, loss: float) -> None:
        """After optimizer step `step` of unit `index` (`loss`: its batch's MSE)."""

    def on_held_out(self, tuner: TuningRun, index: int, step: int, loss: float) -> None:
        """After a held-out evaluation of unit `index` at `step` (`loss`: its MSE on the held-out batches)."""

    def on_unit_end(self, tuner: TuningRun, index: int, unit: Unit, result: UnitResult, module: LiftedModule) -> None:
        """Once unit `index` is kept, reverted or skipped (`module` holds the weights it kept)."""

    def on_run_end(self, tuner: TuningRun, results: list[UnitResult]) -> None:
        """After the last unit, also when the run fails."""


# Each moment and the keywords it passes; Fabric itself calls on_after_setup when a module is set up.
MOMENTS: dict[str, tuple[str, ...]] = {
    name: tuple(inspect.signature(getattr(Callback, name)).parameters)[1:]
    for name in vars(Callback) if name.startswith("on_")
}
FABRIC_MOMENTS: dict[str, tuple[str, ...]] = {"on_after_setup": ("fabric", "module")}
EVERY_KEYWORD = ("on_step_end",)  # called with all its keywords (not through Fabric.call)


def check_callbacks(callbacks: Sequence[Any]) -> Sequence[Any]:
    """The callbacks, each checked against the moments (see the module docstring); a one-line error
    for the first hook that would never fire or could not take what its moment passes."""
    for callback in callbacks:
        for name in dir(callback):
            hook = getattr(callback, name, None)
            if name.startswith("on_") and callable(hook):
                _check_hook(type(callback).__name__, name, hook)
    return callbacks


def _check_hook(owner: str, name: str, hook: Any) -> None:
    """Refuse a hook that is no moment, or whose parameters its moment cannot fill."""
    moments = {**MOMENTS, **FABRIC_MOMENTS}
    if name not in moments:
        close = difflib.get_close_matches(name, list(moments), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"callback {owner}: {name} is not a moment of a tuning run{hint}, so it would never be called; "
                         f"the moments are {', '.join(MOMENTS)}")
    parameters = inspect.signature(hook).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    named = [p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = [p for p in named if p not in moments[name]]
    missing = [k for k in moments[name] if k not in named] if name in EVERY_KEYWORD else []
    if unknown or missing:
        problem = f"takes {', '.join(unknown)}, which it is not passed" if unknown else f"must take {', '.join(missing)} too"
        raise ValueError(f"callback {owner}: {name} {problem}; {name} is passed {', '.join(moments[name])}")
