"""Activations for reconstruction: the float inputs and targets of every unit from one pass of
the float reference (forward hooks), and the quantized stream pushed through each segment once."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from finetune.lift import FakeQuantize, LiftedModule

from .cache import ActivationCache, CachedValue
from .partition import Plan, Segment
from .units import Unit


@contextlib.contextmanager
def quantizers_disabled(module: nn.Module) -> Iterator[None]:
    """Every fake quantizer of `module` off (the identity) inside the block, as it was after."""
    quantizers = [m for m in module.modules() if isinstance(m, FakeQuantize)]
    states = [q.enabled for q in quantizers]
    for quantizer in quantizers:
        quantizer.enabled = False
    try:
        yield
    finally:
        for quantizer, state in zip(quantizers, states):
            quantizer.enabled = state


def float_input_key(unit: Unit) -> str:
    """The cache name of a unit's float inputs."""
    return f"float_input:{unit.name}"


def float_target_key(unit: Unit) -> str:
    """The cache name of a unit's float targets."""
    return f"float_target:{unit.name}"


def capture_float(reference: LiftedModule, units: list[Unit], inputs: list[CachedValue], cache: ActivationCache,
                  device: torch.device) -> None:
    """One pass of `reference` over the cached model inputs, storing each unit's float input (a
    layer's activation argument, a block's entry value) and float target (its last float op's output)."""
    hooks = []
    for unit in units:
        source, target = _submodule(reference, unit.source), _submodule(reference, unit.target_module)
        inputs_of, targets_of = cache.value(float_input_key(unit)), cache.value(float_target_key(unit))
        hooks.append(record_unit_input(source, unit, inputs_of.append))
        hooks.append(target.register_forward_hook(lambda _m, _args, out, v=targets_of: v.append(out)))
    try:
        with torch.no_grad():
            for chunk in range(len(inputs[0].chunks)):
                reference(*(value.tensor(chunk, device) for value in inputs))
    finally:
        for hook in hooks:
            hook.remove()


def record_unit_input(source: nn.Module, unit: Unit, record: Callable[[Any], None]) -> RemovableHandle:
    """Hook `source` (the module `unit.source` names) so each call hands `record` the unit's input:
    the module's argument `unit.source_argument`, or its output when that is None."""
    if unit.source_argument is None:
        return source.register_forward_hook(lambda _m, _args, out: record(out))
    return source.register_forward_pre_hook(lambda _m, args, i=unit.source_argument: record(args[i]))


def _submodule(module: nn.Module, name: str) -> nn.Module:
    """A module of the float reference by the QDQ model's layer name; a clear error if missing."""
    try:
        return module.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"the float model has no node {name!r} (a layer of the quantized model): give the float model the "
            "quantized one was made from, or none (then the quantized model with its quantizers off is the reference)"
        ) from None


class QuantizedStream:
    """The quantized model's values over the calibration set, advanced one segment at a time:
    `before(k)` runs gap k and returns unit k's input; `after(k)` runs the tuned unit k."""

    def __init__(self, plan: Plan, placeholders: list[str], inputs: list[CachedValue], cache: ActivationCache,
                 device: torch.device) -> None:
        self.plan, self.cache, self.device = plan, cache, device
        self.env: dict[str, CachedValue] = dict(zip(placeholders, inputs))
        self.chunks = len(inputs[0].chunks)
        self.seconds = 0.0  # spent running segments

    def before(self, k: int, unit: Unit) -> CachedValue:
        """Unit k's quantized input, after running gap segment k."""
        self._run(self.plan.gaps[k], 2 * k)
        return self.env[unit.input]

    def after(self, k: int) -> None:
        """Push the (tuned) unit k through, freeing values nothing later reads."""
        self._run(self.plan.units[k], 2 * k + 1)

    def _run(self, segment: Segment, step: int) -> None:
        """Run a segment chunk by chunk, storing its outputs and releasing dead values."""
        start = time.perf_counter()
        outputs = [self.cache.value(f"stream:{name}") for name in segment.outputs]
        with torch.no_grad():
            for chunk in range(self.chunks):
                results = segment.module(*(self.env[name].tensor(chunk, self.device) for name in segment.inputs))
                for value, result in zip(outputs, results):
                    value.append(result)
        self.env.update(zip(segment.outputs, outputs))
        for name in [n for n in self.env if self.plan.last_use.get(n, -1) <= step]:
            value = self.env.pop(name)
            self.cache.release(value.name)
        self.seconds += time.perf_counter() - start


def cache_inputs(feeds: Any, names: list[str], cache: ActivationCache) -> list[CachedValue]:
    """The model inputs of every calibration batch, in graph order, as cached values."""
    values = [cache.value(f"input:{name}") for name in names]
    for feed in feeds:
        for value, name in zip(values, names):
            value.append(torch.from_numpy(np.asarray(feed[name])))
    if not values or not values[0].chunks:
        raise ValueError("fast finetune needs calibration data: the data source gave no samples")
    return values
