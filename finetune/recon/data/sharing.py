"""The weights a run holds once: the tuned module and its float reference read one storage for every
tensor both hold with the same value, and for every weight stored as codes that the float weight
quantizes to exactly (its quantizer gives the codes' values from it); a tuned tensor gets a storage
of its own only where the float stream still reads the reference's after its unit, and the
reference's tensors are let go once the float stream has read them for the last time and no later
unit starts from them. So tuning holds one copy of the weights from the start, stored as float or as
codes (issue 44: 2.3 GiB of weights were held twice)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

import onnx
import torch

from finetune.lift import LiftedModule
from finetune.lift.graph import Segment
from finetune.lift.qdq import QUANTIZE_TO_DEQUANTIZE, is_quantizer
from finetune.onnx.domains import DEFAULT_DOMAINS
from finetune.onnx.layers import LAYER_OPS

from ..units import Unit, parameters_of, tuned_tensor

logger = logging.getLogger(__name__)
UNKNOWN = 1 << 62  # the last read of a tensor no segment names: taken as after every unit


class SharedWeights:
    """Module tensors that read the float reference's storage, and for each reference tensor the
    last float-stream segment that reads it; `before_unit(k)` keeps the reference's values intact
    for the segments after k before unit k's tensors change."""

    def __init__(self, module: LiftedModule, reference: LiftedModule, units: Sequence[Unit], segments: Sequence[Segment]) -> None:
        self.module, self.reference, self.units = module, reference, list(units)
        self.last_read = _last_reads(reference, segments)
        self.released: set[str] = set()
        theirs = dict(_tensors(reference))
        owners = {tensor.untyped_storage().data_ptr(): name for name, tensor in theirs.items() if tensor.numel()}
        self.shared: dict[str, str] = {}  # tensors of the module reading a reference tensor's storage: its name there
        with torch.no_grad():
            for name, ours in _tensors(module):
                other = theirs.get(name)
                if other is not None and _fits(other, ours) and torch.equal(ours, other):
                    ours.data = other.data
                owner = owners.get(ours.untyped_storage().data_ptr()) if ours.numel() else None
                if owner is not None:  # equal by name, or lifted into it (a weight of codes: lift_model's reuse)
                    self.shared[name] = owner
        storages = {theirs[owner].untyped_storage().data_ptr(): theirs[owner].untyped_storage().nbytes()
                    for owner in self.shared.values()}
        self.bytes_held_once = sum(storages.values())
        if self.shared:
            logger.info("%d tensor(s) of the float reference and the tuned model share their storage (%.1f MiB held "
                        "once)", len(self.shared), self.bytes_held_once / 2**20)

    def before_unit(self, k: int, unit: Unit) -> None:
        """Before unit k's tensors change (tuned or restored): each sharing a storage the reference
        reads after segment k gets a copy of its own."""
        with torch.no_grad():
            for name in parameters_of(unit):
                if name in self.shared and self.last_read.get(self.shared[name], UNKNOWN) > k:
                    tensor = tuned_tensor(self.module, name)
                    tensor.data = tensor.data.clone()
                    del self.shared[name]

    def after_unit(self, k: int, starts: dict[str, torch.Tensor]) -> None:
        """Once unit k is done, the reference tensors no later segment reads, and no later unit starts
        from, are let go (the tuned model keeps those it shares), with the starts of units 0..k that view them."""
        tensors = dict(_tensors(self.reference))
        later = {starts[name].untyped_storage().data_ptr() for unit in self.units[k + 1:] for name in parameters_of(unit)
                 if name in starts}
        done = {name for name, last in self.last_read.items() if last <= k and name in tensors} - self.released
        done = {name for name in done if tensors[name].untyped_storage().data_ptr() not in later}
        pointers = {tensors[name].untyped_storage().data_ptr() for name in done}
        for name in [name for unit in self.units[: k + 1] for name in parameters_of(unit)]:
            if name in starts and starts[name].untyped_storage().data_ptr() in pointers:
                del starts[name]
        for name in done:
            tensors[name].data = torch.empty(0, dtype=tensors[name].dtype, device=tensors[name].device)
        self.released |= done

    def summary(self) -> dict[str, int]:
        """The report's entry: bytes the tuned model and the reference held once from the start, tensors
        of the tuned model still reading the reference's storage at the end, reference tensors let go."""
        return {"bytes_held_once": self.bytes_held_once, "tensors": len(self.shared), "released": len(self.released)}


def float_weights(reference: LiftedModule | None, coded: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The float reference's tensors by initializer name, and by the name of each initializer of codes
    `coded` maps to one of them: the QDQ model is lifted into them (lift_model's reuse), so a weight
    or constant (an embedding table) both hold equal, or a weight stored as codes it quantizes to, is
    never made twice."""
    if reference is None:
        return {}
    tensors = reference.initializer_values
    return {**tensors, **{codes: tensors[name] for codes, name in coded.items() if name in tensors}}


def coded_float_names(quantized: onnx.ModelProto, float_model: onnx.ModelProto) -> dict[str, str]:
    """For each initializer of codes that a lone dequantize node of the quantized model feeds into a
    layer's weight input (LAYER_OPS; biases keep their codes' values), the float model's initializer
    at the same input of the node of the same name."""
    float_initializers = {tensor.name for tensor in float_model.graph.initializer}
    float_inputs = {(node.name, index): value for node in float_model.graph.node for index, value in enumerate(node.input)
                    if value in float_initializers}
    graph = quantized.graph
    initializers = {tensor.name for tensor in graph.initializer}
    readers: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        layer = LAYER_OPS.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        for index, value in enumerate(node.input):
            readers.setdefault(value, []).append((node.name, index) if layer and index in layer.weights else ("", -1))
    found = {}
    for node in graph.node:
        if node.op_type in QUANTIZE_TO_DEQUANTIZE.values() and is_quantizer(node.domain, node.op_type) \
                and node.input[0] in initializers and len(readers.get(node.output[0], [])) == 1:
            name = float_inputs.get(readers[node.output[0]][0])
            if name is not None:
                found[node.input[0]] = name
    return found


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by qualified name (quantizers' included: only equal ones share)."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _fits(other: torch.Tensor, ours: torch.Tensor) -> bool:
    """Whether `ours` may read `other`'s storage in its place: same shape, dtype and device."""
    return other.shape == ours.shape and other.dtype == ours.dtype and other.device == ours.device


def _last_reads(reference: LiftedModule, segments: Sequence[Segment]) -> dict[str, int]:
    """For each reference tensor (qualified name), the last segment whose graph reads it or another
    name of its storage (UNKNOWN for a storage some name of which no segment reads)."""
    read = _segment_reads(reference, segments)
    names: dict[int, list[str]] = {}
    for name, tensor in _tensors(reference):
        names.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    return {name: max(read.get(other, UNKNOWN) for other in group) for group in names.values() for name in group}


def _segment_reads(reference: LiftedModule, segments: Sequence[Segment]) -> dict[str, int]:
    """For each reference tensor name a segment's graph reads, the last such segment."""
    last: dict[str, int] = {}
    for k, part in enumerate(segments):
        for node in part.module.graph.nodes:
            if node.op == "get_attr":
                last[node.target] = k
            elif node.op == "call_module":
                for name, _ in _tensors(reference.get_submodule(node.target)):
                    last[f"{node.target}.{name}"] = k
    return last
