"""The weights a run holds once: the tuned module and its float reference read one storage for every
tensor both hold with the same value, a tuned tensor gets a storage of its own only where the float
stream still reads the reference's after its unit, and the reference's tensors are let go once the
float stream has read them for the last time and no later unit starts from them. Over weights
stored as float this halves what tuning holds from the start; over codes the float copy shrinks as
units are tuned (issue 44: 2.3 GiB of weights were held twice)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch

from finetune.lift import LiftedModule
from finetune.lift.graph import Segment

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
        self.shared: set[str] = set()  # tensors of the module reading the reference's tensor of their name
        with torch.no_grad():
            for name, ours in _tensors(module):
                other = theirs.get(name)
                if other is not None and _fits(other, ours) and torch.equal(ours, other):
                    ours.data = other.data
                    self.shared.add(name)
        self.bytes_held_once = sum(theirs[name].untyped_storage().nbytes() for name in self.shared)
        if self.shared:
            logger.info("%d tensor(s) of the float reference and the tuned model share their storage (%.1f MiB held "
                        "once)", len(self.shared), self.bytes_held_once / 2**20)

    def before_unit(self, k: int, unit: Unit) -> None:
        """Before unit k's tensors change (tuned or restored): each sharing a storage the reference
        reads after segment k gets a copy of its own."""
        with torch.no_grad():
            for name in parameters_of(unit):
                if name in self.shared and self.last_read.get(name, UNKNOWN) > k:
                    tensor = tuned_tensor(self.module, name)
                    tensor.data = tensor.data.clone()
                    self.shared.discard(name)

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


def float_weights(reference: LiftedModule | None) -> dict[str, torch.Tensor]:
    """The float reference's trainable tensors by initializer name: the QDQ model is lifted into them
    (lift_model's reuse), so a weight both hold equal is never made twice, not even before SharedWeights."""
    if reference is None:
        return {}
    return {source.initializer: reference.get_parameter(name) for name, source in reference.finetune_params.items()
            if source.transform is None}


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
