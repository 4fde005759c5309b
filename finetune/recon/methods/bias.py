"""Empirical bias correction (fast_finetune.bias_correction): each layer's bias gets the mean, per
output channel over the calibration rows a unit trains on, of its float output minus its quantized
output, so the quantized layer's output is right on average. Quantization shifts a layer's mean
output (rounding that does not cancel, clipped activations, a block's shared exponent); a bias
absorbs that shift exactly, at no cost at inference.

The output is the layer's own (Conv, ConvTranspose, Gemm, or the bias Add after a MatMul), before
its activation: a bias acts there. Its float value is the unit's float input through the unit with
every quantizer off and the weights it starts from (float weights, also for a weight stored as
codes, and the float bias behind int32 codes where the float model is given); the quantized value is
the unit's quantized input through the unit as it stands. A block's
layers are corrected one after another in graph order, each measured after those before it were
corrected (their error would otherwise be counted twice). The float means are taken once, before
any weight moves, so the correction after tuning aims at the same float model.

A correction is kept only where the unit's judged loss (held-out, where batches are held out: see
heldout) does not rise; otherwise the biases it changed are put back. Sums are float64 and summed
over the processes of a data-parallel run before anything is decided, so every process corrects
alike. An int32 bias (codes with scale s_input * s_weight) is corrected on its own grid: the value
is quantized again, saturating at the type's limits, so what the export writes is what was judged."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import fx, nn

from finetune.config import FastFinetune
from finetune.lift import LiftedModule
from finetune.lift.fake_quant import quantizers_disabled
from finetune.onnx.layers import LAYER_OPS, RECURRENT_OPS

from ..data.cache import CachedValue
from ..data.losses import Loss
from ..data.rows import UnitInputs
from ..data.shards import sum_across
from ..units import Layer, Unit
from .base import Algorithm, Method, UnitWork



class BiasCorrection(Method):
    """bias_correction as a method: the float means taken before any weight of a unit moves, the
    correction made before the optimisation (after GPTQ's start, when there is one) and again after it."""

    @classmethod
    def applies(cls, config: FastFinetune, algorithm: Algorithm) -> bool:
        """Whether the run corrects biases. `auto`: on for the correction alone (iterations 0) and with
        the algorithms that say so (Algorithm.corrects_bias: AdaRound and GPTQ, not AdaQuant). Measured on
        both digits models over eight presets (docs/fine-tuning.md, Bias correction): alone, it lowered
        the held-out logit error against float in all sixteen cases; with AdaRound (INT) too; after
        AdaQuant, which moves the weights freely, it was worse on BFP16, MX4 and MX6 and MX4 lost accuracy
        on both models. GPTQ rounds in one pass, as the correction alone starts."""
        if config.bias_correction == "auto":
            return algorithm.corrects_bias or config.iterations == 0
        return bool(config.bias_correction)

    def begin(self, work: UnitWork) -> None:
        """The unit's corrector, with its float means taken now (the float biases behind int32 codes from
        the float model's values). The layers it leaves out are in the unit's report; asked for
        explicitly (true), each is a warning too (`auto` corrects where a bias is)."""
        unit, data = work.unit, work.data
        floats = {layer.bias: work.starts[layer.bias] for layer in unit.layers if layer.bias in work.starts}
        self.corrector = BiasCorrector(unit, work.module, data.train, data.inputs, data.float_inputs, work.fabric, work.held,
                                       floats)
        for layer in self.corrector.skipped if self.config.bias_correction is True else ():
            work.warnings.add(layer["layer"], f"bias not corrected: {layer['reason']}")

    def start(self, work: UnitWork) -> bool:
        """Correct before the optimisation (measuring afresh where the weights moved since `before`)."""
        self.corrector.correct("start", work.measure, None if work.moved else work.before)
        return self.corrector.record.get("start", {}).get("status") == "kept"

    def end(self, work: UnitWork, loss: Loss) -> Loss:
        """Correct again after an optimisation (none ran: the loss stays)."""
        return self.corrector.correct("final", work.measure, loss) if work.optimising else loss

    def record(self) -> dict[str, Any]:
        return {"bias_correction": self.corrector.record}


@dataclass(frozen=True)
class _Target:
    """A layer whose bias is corrected: the module whose output carries the bias, the bias parameter,
    and the output axis along which it runs."""

    layer: Layer
    output: str
    axis: int


class BiasCorrector:
    """The bias correction of one unit: the layers it corrects (and why the others are not), the float
    means of their outputs on the training rows, and the record of each correction for the report."""

    def __init__(self, unit: Unit, module: LiftedModule, train: nn.Module, inputs: UnitInputs, float_inputs: CachedValue,
                 fabric: Fabric, held: frozenset[int], float_biases: dict[str, torch.Tensor] | None = None) -> None:
        self.module, self.train, self.inputs, self.fabric = module, train, inputs, fabric
        self.chunks = [c for c in range(len(inputs.main.chunks)) if c not in held]  # this process's training chunks
        self.targets, self.skipped = _targets(module, unit)
        self.record: dict[str, Any] = {"layers": [t.layer.name for t in self.targets], "not_corrected": self.skipped}
        self.float_means: list[torch.Tensor] = []
        if self.targets:
            with quantizers_disabled(train), _swapped(module, float_biases or {}):
                means = self._means(self.targets, lambda c: (float_inputs.tensor(c, fabric.device),
                                                             *inputs.chunk(c, fabric.device)[1:]))
            self._keep_per_channel(means)

    def _keep_per_channel(self, means: list[torch.Tensor | None]) -> None:
        """Keep the targets whose bias holds one value per channel of their output (with those channels'
        float means; None: it does not); the others are listed as not corrected."""
        self.skipped.extend({"layer": t.layer.name, "reason": "its bias is not one value per output channel"}
                            for t, m in zip(self.targets, means) if m is None)
        self.float_means = [m for m in means if m is not None]
        self.targets = [t for t, m in zip(self.targets, means) if m is not None]
        self.record["layers"] = [t.layer.name for t in self.targets]

    def correct(self, stage: str, measure: Callable[[], Loss], current: Loss | None = None) -> Loss:
        """Correct every target's bias (in graph order), keep the result if the judged loss did not rise
        (`current`: the loss as it stands, measured here when not given), else put the biases back;
        returns the loss the unit now has. The stage's numbers go into `record[stage]`."""
        current = current if current is not None else measure()
        if not self.targets or not current.finite:  # a unit whose tuned loss is NaN is reverted whole: nothing to correct
            return current
        saved = [self.module.get_parameter(t.layer.bias).detach().clone() for t in self.targets]
        shifts = [self._correct(target) for target in self.targets]
        after = measure()
        kept = after.finite and after.judged <= current.judged
        if not kept:
            for target, value in zip(self.targets, saved):
                self.module.get_parameter(target.layer.bias).data.copy_(value)
        self.record[stage] = {"status": "kept" if kept else "reverted", "loss_before": current.training,
                              "loss_after": after.training, "held_out_before": current.held_out,
                              "held_out_after": after.held_out, "largest_shift": max(shifts)}
        return after if kept else current

    def _correct(self, target: _Target) -> float:
        """Add the target's mean float-minus-quantized output to its bias; the largest change, in absolute value."""
        quantized = self._means([target], lambda c: self.inputs.chunk(c, self.fabric.device))[0]
        if quantized is None:
            raise ValueError(f"{target.layer.name}: its quantized output has other channels than its float output")
        bias = self.module.get_parameter(target.layer.bias)
        shift = (self.float_means[self.targets.index(target)] - quantized).reshape(bias.shape)
        with torch.no_grad():
            value = bias.double() + shift.to(bias.device)
            transform = self.module.finetune_params[target.layer.bias].transform
            if transform is not None:  # codes: quantized again on their grid, saturating
                value = transform.apply(transform.encode(value.float()))
            bias.data.copy_(value.to(bias.device, bias.dtype))
        return float(shift.abs().max())

    def _means(self, targets: list[_Target], chunk_inputs: Callable[[int], tuple[torch.Tensor, ...]]) -> list[torch.Tensor | None]:
        """Each target's output mean per channel over the run's training rows (float64 sums over every
        process, each of one size: the bias's), or None where an output does not have a channel per bias value."""
        sums = [torch.zeros(self.module.get_parameter(t.layer.bias).numel(), dtype=torch.float64, device=self.fabric.device)
                for t in targets]
        counts, misfits = [0] * len(targets), [0] * len(targets)
        with _recording(self.module, targets, sums, counts, misfits), torch.no_grad():
            for chunk in self.chunks:
                self.train(*chunk_inputs(chunk))
        totals = sum_across(self.fabric, [*torch.cat(sums).tolist(), *counts, *misfits])
        means, offset = [], 0
        for k, total in enumerate(sums):
            count, misfit = totals[-2 * len(targets) + k], totals[-len(targets) + k]
            value = torch.tensor(totals[offset: offset + total.numel()], dtype=torch.float64) / max(count, 1.0)
            means.append(None if misfit else value)
            offset += total.numel()
        return means


@contextmanager
def _swapped(module: LiftedModule, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """The parameters named in `values` hold those values inside the block (the float biases behind int32
    codes, for the float pass), their own after."""
    saved = {name: module.get_parameter(name).detach().clone() for name in values}
    try:
        for name, value in values.items():
            module.get_parameter(name).data.copy_(value)
        yield
    finally:
        for name, value in saved.items():
            module.get_parameter(name).data.copy_(value)


@contextmanager
def _recording(module: LiftedModule, targets: list[_Target], sums: list[torch.Tensor], counts: list[int],
               misfits: list[int]) -> Iterator[None]:
    """Hooks adding each target's output, summed per channel in float64, to `sums` (rows counted in
    `counts`; an output whose channels do not match the bias is counted in `misfits` instead)."""
    def hook(k: int) -> Callable[..., None]:
        def record(_module: nn.Module, _args: Any, out: torch.Tensor) -> None:
            axis = targets[k].axis % out.dim()
            if out.shape[axis] != sums[k].numel():
                misfits[k] += 1
                return
            per_channel = out.detach().double().movedim(axis, 0).reshape(out.shape[axis], -1)
            sums[k] += per_channel.sum(dim=1)
            counts[k] += per_channel.shape[1]
        return record

    handles = [module.get_submodule(t.output).register_forward_hook(hook(k)) for k, t in enumerate(targets)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _targets(module: LiftedModule, unit: Unit) -> tuple[list[_Target], list[dict[str, str]]]:
    """The layers of the unit whose bias can be corrected, and each other layer with the reason it is not."""
    nodes = {n.target: n for n in module.graph.nodes if n.op == "call_module"}
    targets, skipped = [], []
    for layer in unit.layers:
        reason = _why_not(module, layer, nodes.get(layer.name))
        if reason is None:
            node = nodes[layer.name]
            output = next(iter(node.users)).target if layer.op_type == "MatMul" else layer.name
            targets.append(_Target(layer, str(output), LAYER_OPS[layer.op_type].channel_axis))
        elif layer.op_type not in RECURRENT_OPS or layer.weight_index == 1:  # an LSTM/GRU's R shares W's reason
            skipped.append({"layer": layer.name, "reason": reason})
    return targets, skipped


def _why_not(module: LiftedModule, layer: Layer, node: fx.Node | None) -> str | None:
    """Why a layer's bias is not corrected, or None when it is."""
    if layer.op_type in RECURRENT_OPS:
        return "a recurrent layer's bias acts inside the recurrence, not on one output"
    if node is None:
        return "it lives inside a control-flow body, whose calls per batch vary"
    if layer.bias is None:
        return ("it has no bias (export writes weights into the graph as it is; a bias input is not added), "
                "or a MatMul's Add is not a constant vector it alone reads")
    return None
