"""Activations for reconstruction: the float inputs and targets of each unit from one pass of the
float reference and the quantized values from one pass of the quantized model, each pushed
through the graph a segment at a time, so only what is still needed stays cached."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import fx, nn
from torch.utils.hooks import RemovableHandle

from finetune.lift import LiftedModule
from finetune.lift.fake_quant import quantizers_disabled
from finetune.lift.graph import Segment, cut_before

from ..units import Plan, Unit
from .cache import ActivationCache, CachedValue


def float_input_key(unit: Unit) -> str:
    """The cache name of a unit's float inputs."""
    return f"float_input:{unit.name}"


def float_target_keys(unit: Unit) -> list[str]:
    """The cache names of a unit's float targets, one per output."""
    return [f"float_target:{unit.name}", *(f"float_target:{unit.name}#{item}" for item in unit.target_outputs[1:])]


def record_unit_input(source: nn.Module, argument: int | None, record: Callable[[Any], None]) -> RemovableHandle:
    """Hook `source` so each call hands `record` the unit's input: the module's positional argument
    `argument`, or its output when that is None."""
    if argument is None:
        return source.register_forward_hook(lambda _m, _args, out: record(out))
    return source.register_forward_pre_hook(lambda _m, args, i=argument: record(args[i]))


def float_source(reference: nn.Module, unit: Unit) -> tuple[str, int | None] | None:
    """Where the float reference hands over a unit's input: (module, argument) of `unit.source`, or of
    its `source_reader` where the reference has no module of the source's name; None for a model input."""
    if not unit.source:
        return None
    if unit.source_reader is not None and not _has_module(reference, unit.source) and _has_module(reference, unit.source_reader[0]):
        return unit.source_reader
    return unit.source, unit.source_argument


def _has_module(module: nn.Module, name: str) -> bool:
    """Whether `module` has a submodule of that name."""
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _submodule(module: nn.Module, name: str) -> nn.Module:
    """A module of the float reference by the QDQ model's layer name; a clear error if missing."""
    try:
        return module.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"the float model has no node {name!r} (a layer of the quantized model): give the float model the "
            "quantized one was made from, or none (then the quantized model with its quantizers off is the reference)"
        ) from None


class _Stream:
    """Values of a lifted graph over the calibration set, computed segment by segment, chunk by
    chunk; a value stays cached until the last segment reading it has run."""

    def __init__(self, placeholders: list[str], inputs: list[CachedValue], cache: ActivationCache, device: torch.device,
                 last_use: dict[str, int], prefix: str) -> None:
        self.cache, self.device, self.last_use, self.prefix = cache, device, last_use, prefix
        self.env: dict[str, CachedValue] = dict(zip(placeholders, inputs))
        for value in inputs:
            value.holders += 1
        self.chunks = len(inputs[0].chunks)
        self.seconds = 0.0  # spent running segments

    def _run(self, segment: Segment, step: int) -> None:
        """Run a segment chunk by chunk, storing its outputs and releasing dead values."""
        start = time.perf_counter()
        outputs = [self.cache.value(f"{self.prefix}:{name}") for name in segment.outputs]
        with torch.no_grad():
            for chunk in range(self.chunks):
                results = segment.module(*(self.env[name].tensor(chunk, self.device) for name in segment.inputs))
                for value, result in zip(outputs, results):
                    value.append(result)
        self.env.update(zip(segment.outputs, outputs))
        for name in [n for n in self.env if self.last_use.get(n, -1) <= step]:
            value = self.env.pop(name)
            self.cache.release(value.name)
        self.seconds += time.perf_counter() - start


class QuantizedStream(_Stream):
    """The quantized model's values over the calibration set, advanced one segment at a time:
    `before(k)` runs gap k and returns unit k's input; `after(k)` runs the tuned unit k."""

    def __init__(self, plan: Plan, placeholders: list[str], inputs: list[CachedValue], cache: ActivationCache,
                 device: torch.device) -> None:
        super().__init__(placeholders, inputs, cache, device, plan.last_use, "stream")
        self.plan = plan

    def before(self, k: int, unit: Unit) -> CachedValue:
        """Unit k's quantized input, after running gap segment k."""
        self._run(self.plan.gaps[k], 2 * k)
        return self.env[unit.input]

    def side_inputs(self, unit: Unit) -> list[CachedValue]:
        """The quantized values of the unit's side inputs (after `before`), in the unit's order."""
        return [self.env[side.name] for side in unit.side_inputs]

    def after(self, k: int) -> None:
        """Push the (tuned) unit k through, freeing values nothing later reads."""
        self._run(self.plan.units[k], 2 * k + 1)


class FloatStream(_Stream):
    """The float reference's values over the calibration set, advanced one unit at a time:
    `advance(k)` runs every op that unit k's float input and target need and no earlier unit did,
    and hooks cache those two values. Only what later units read stays cached, so the float side
    holds about one unit's activations at a time rather than every unit's (layer units over
    EfficientNet-Lite0 with 1024 crops had spilled 47 GB when all were captured up front).

    With the quantized module itself as the reference, `quantizers_off` runs its segments with
    the quantizers disabled; each runs before its unit is tuned, so it sees the original weights."""

    def __init__(self, reference: LiftedModule, units: list[Unit], inputs: list[CachedValue], cache: ActivationCache,
                 device: torch.device, quantizers_off: bool) -> None:
        placeholders = [n.name for n in reference.graph.nodes if n.op == "placeholder"]
        self.segments, last_use = cut_before(reference, [_float_nodes(reference, unit) for unit in units])
        super().__init__(placeholders, inputs, cache, device, last_use, "float")
        self.reference, self.units, self.inputs, self.quantizers_off = reference, units, inputs, quantizers_off
        self.sources = {unit.name: (float_source(reference, unit) or ("", None))[0] for unit in units}  # where each input is taken

    def advance(self, k: int) -> tuple[CachedValue, list[CachedValue]]:
        """Unit k's float inputs and targets (one per output), computing what they need. Hooks record the values of
        units k and later whose modules this segment calls; they are removed after it, since the
        quantized module (when it is the reference) runs the same submodules."""
        unit = self.units[k]
        float_inputs = self.cache.value(float_input_key(unit))
        if not unit.source:
            for chunk in range(self.chunks):
                float_inputs.append(self.inputs[unit.source_argument or 0].tensor(chunk, self.device))
        called = {n.target for n in self.segments[k].module.graph.nodes if n.op == "call_module"}
        hooks = [hook for later in self.units[k:] if {self.sources[later.name], later.target_module} & called
                 for hook in self._hooks(later)]
        try:
            with quantizers_disabled(self.reference) if self.quantizers_off else contextlib.nullcontext():
                self._run(self.segments[k], k)
        finally:
            for hook in hooks:
                hook.remove()
        targets = [self.cache.value(key) for key in float_target_keys(unit)]
        for value in (float_inputs, *targets):
            if len(value.chunks) != self.chunks:
                raise ValueError(f"the float model computed {value.name} {len(value.chunks)} times over {self.chunks} "
                                 "calibration batches: a module it names runs more or less than once per batch")
        return float_inputs, targets

    def _hooks(self, unit: Unit) -> list[RemovableHandle]:
        """Hooks caching the float input (unless it is a model input) and the float target of a unit."""
        targets = [self.cache.value(key) for key in float_target_keys(unit)]
        items = unit.target_outputs

        def record_target(_module: nn.Module, _args: Any, out: Any) -> None:
            if not items:
                targets[0].append(out)
            for value, item in zip(targets, items):
                value.append(out[item])

        hooks = [_submodule(self.reference, unit.target_module).register_forward_hook(record_target)]
        source = float_source(self.reference, unit)
        if source is not None:
            hooks.append(record_unit_input(_submodule(self.reference, source[0]), source[1],
                                           self.cache.value(float_input_key(unit)).append))
        return hooks


def _float_nodes(reference: LiftedModule, unit: Unit) -> list[fx.Node]:
    """The reference's nodes calling the modules that unit's float input and target come from."""
    source = float_source(reference, unit)
    names = [name for name in (source[0] if source else "", unit.target_module) if name]
    for name in names:
        _submodule(reference, name)
    return [n for n in reference.graph.nodes if n.op == "call_module" and n.target in names]


def cache_inputs(feeds: Any, names: list[str], cache: ActivationCache, rank: int = 0, world: int = 1) -> list[CachedValue]:
    """The model inputs of the calibration batches process `rank` of `world` holds (batches b with
    b % world == rank: every batch in a run on one device), in graph order, as cached values."""
    values = [cache.value(f"input:{name}") for name in names]
    batches = 0
    for index, feed in enumerate(feeds):
        batches = index + 1
        if index % world == rank:
            for value, name in zip(values, names):
                value.append(torch.from_numpy(np.asarray(feed[name])))
    if not values or not batches:
        raise ValueError("fast finetune needs calibration data: the data source gave no samples")
    if batches < world:
        raise ValueError(f"the calibration data holds {batches} batch(es), fewer than the {world} processes of "
                         "fast_finetune.devices: each process needs one (give more data or smaller batches, or fewer devices)")
    return values
