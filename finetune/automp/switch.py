"""The lifted model whose target layers can each be switched to any rung without re-quantizing:
every quantized input of a target layer reads through its own slot module (so a layer sharing an
input with another switches alone), and a slot holds the fake-quant module that the model
quantized uniformly at the chosen rung has there. Block formats need no calibration and INT rungs
bring the scales calibrated for them, so a switch costs nothing and a candidate one forward."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from torch import fx, nn

from finetune.formats import IntSpec, bits_per_element
from finetune.lift import FakeQuantize, LiftedModule, lift_model
from finetune.onnx.layers import BIAS_INPUT

IDENTITY = nn.Identity()


class SlotModule(nn.Module):
    """The module a slot's graph node calls: it runs whichever quantizer it holds now (the identity
    when none), so a switch reaches every graph cut from the model too (they share this module)."""

    def __init__(self) -> None:
        super().__init__()
        self.current: nn.Module = IDENTITY

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return self.current(value)


@dataclass
class Slot:
    """One quantized input of a target layer: its role, element count (per sample for activations)
    and, per model key, the fake-quant module that model has there (None: it leaves it float)."""

    name: str
    role: str  # activation | weight | bias
    elements: int
    holder: SlotModule
    modules: dict[str, FakeQuantize | None] = field(default_factory=dict)

    def bits(self, key: str) -> float:
        module = self.modules.get(key)
        return bits_per_element(None if module is None else module.spec)


def layer_module_name(node: str) -> str:
    """The lifted module of an ONNX node (the lifter names modules after nodes, `.` as `/`)."""
    return node.replace(".", "/")


class SwitchableModel:
    """A copy of the base lifted model with a slot before each quantized input of each layer in
    `nodes`; `models` are the lifted models to take slot contents from, by key."""

    def __init__(self, base: LiftedModule, models: dict[str, LiftedModule], nodes: Sequence[tuple[str, str]]) -> None:
        self.module = copy.deepcopy(base)
        self.slots: dict[str, list[Slot]] = {}
        graph = self.module.graph
        calls = {n.target: n for n in graph.nodes if n.op == "call_module"}
        for node, op_type in nodes:
            call = calls.get(layer_module_name(node))
            if call is None:
                raise ValueError(f"node {node!r} has no module in the lifted model")
            inputs = {key: _quantizers(model, layer_module_name(node)) for key, model in models.items()}
            self.slots[node] = self._add_slots(call, op_type, {"base": _quantizers(base, call.target), **inputs})
        graph.lint()
        self.module.recompile()
        self.module.eval()

    def _add_slots(self, call: fx.Node, op_type: str, quantizers: dict[str, dict[int, FakeQuantize]]) -> list[Slot]:
        """Route each input that some model quantizes through a new slot module, reading the value
        before the base model's own quantizer of that input."""
        slots = []
        args = list(call.args)
        quantized = sorted({index for found in quantizers.values() for index in found})
        for index in quantized:
            value = args[index]
            source = value.args[0] if _is_quantizer(self.module, value) else value
            name = f"{call.target}/automp_input{index}"
            holder = SlotModule()
            self.module.add_submodule(name, holder)
            with self.module.graph.inserting_before(call):
                args[index] = self.module.graph.call_module(name, (source,))
            role = _role(op_type, index, source)
            elements = _constant(self.module, source).numel() if role != "activation" else 0
            modules = {key: found.get(index) for key, found in quantizers.items()}
            slots.append(Slot(name, role, elements, holder, modules))
        call.args = tuple(args)
        return slots

    def set(self, node: str, keys: dict[str, str]) -> None:
        """Give each slot of `node` the module of the model keyed by its role in `keys` (bias
        follows weight); an int32 bias between an activation and a weight from different models
        gets the scale s_input * s_weight they make together."""
        chosen = {}
        for slot in self.slots[node]:
            key = keys[slot.role if slot.role != "bias" else "weight"]
            chosen[slot.role] = slot.modules[key]
            if slot.role != "bias":
                slot.holder.current = chosen[slot.role] or IDENTITY
        for slot in self.slots[node]:
            if slot.role == "bias":
                module = _bias_between(slot.modules[keys["weight"]], chosen.get("activation"), chosen.get("weight"))
                slot.holder.current = module or IDENTITY

    @torch.inference_mode()
    def outputs(self, batches: Sequence[tuple[torch.Tensor, ...]], output_index: int) -> np.ndarray:
        """Output `output_index` of the model over all batches, concatenated along samples."""
        results = []
        for batch in batches:
            out = self.module(*batch)
            out = out[output_index] if isinstance(out, (tuple, list)) else out
            results.append(out.float().numpy())
        return np.concatenate(results)

    def to(self, device: torch.device) -> SwitchableModel:
        """Move the model and every slot's modules (those of all keys, not only the ones set now) to `device`."""
        self.module.to(device)
        for slot in (slot for slots in self.slots.values() for slot in slots):
            for module in slot.modules.values():
                if module is not None:
                    module.to(device)
        return self

    def measure_activations(self, batch: tuple[torch.Tensor, ...]) -> None:
        """Record each activation slot's elements per sample from one batch."""
        samples = len(batch[0]) if batch and batch[0].ndim else 1
        slots = [s for slots in self.slots.values() for s in slots if s.role == "activation"]
        hooks = [slot.holder.register_forward_hook(
            lambda _m, args, _out, slot=slot: setattr(slot, "elements", args[0].numel() // max(samples, 1))) for slot in slots]
        try:
            with torch.inference_mode():
                self.module(*batch)
        finally:
            for hook in hooks:
                hook.remove()


@dataclass(frozen=True)
class SwitchSource:
    """The QDQ models a switchable model is lifted from: the base model, one model per key and the
    searched (node, op type) pairs. Lifting is deterministic, so another process given these builds
    the model this one built (protos pickle as they are; a pickled GraphModule is traced again)."""

    base: onnx.ModelProto
    models: dict[str, onnx.ModelProto]
    nodes: tuple[tuple[str, str], ...]

    def build(self) -> SwitchableModel:
        """The switchable model, lifted from these models."""
        return SwitchableModel(lift_model(self.base), {key: lift_model(model) for key, model in self.models.items()},
                               self.nodes)


def _quantizers(model: LiftedModule, target: str) -> dict[int, FakeQuantize]:
    """The fake-quant modules feeding the inputs of the module `target`, by input index."""
    call = next((n for n in model.graph.nodes if n.op == "call_module" and n.target == target), None)
    if call is None:
        return {}
    return {index: model.get_submodule(arg.target) for index, arg in enumerate(call.args) if _is_quantizer(model, arg)}


def _is_quantizer(model: nn.Module, value: object) -> bool:
    return isinstance(value, fx.Node) and value.op == "call_module" and isinstance(model.get_submodule(value.target), FakeQuantize)


def _role(op_type: str, index: int, source: fx.Node) -> str:
    if source.op != "get_attr":
        return "activation"
    return "bias" if BIAS_INPUT.get(op_type) == index else "weight"


def _constant(model: nn.Module, node: fx.Node) -> torch.Tensor:
    owner, _, name = node.target.rpartition(".")
    return getattr(model.get_submodule(owner), name)


def _bias_between(bias: FakeQuantize | None, activation: FakeQuantize | None, weight: FakeQuantize | None) -> FakeQuantize | None:
    """The bias quantizer for this activation and weight: an int32 bias takes s_input * s_weight."""
    if bias is None or not isinstance(bias.spec, IntSpec) or bias.spec.dtype != "int32":
        return bias
    if activation is None or weight is None or not isinstance(activation.spec, IntSpec) or not isinstance(weight.spec, IntSpec):
        return None
    scale = (activation.scale * weight.scale).reshape(bias.scale.shape)
    if torch.equal(scale, bias.scale):
        return bias
    return FakeQuantize(bias.spec, scale, torch.zeros_like(scale), bias.source, on_parameter=True)
