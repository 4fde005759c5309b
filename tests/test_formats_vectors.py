"""The torch formats reproduce every reference vector exactly."""

from __future__ import annotations

import contextlib

import pytest
import torch

from finetune.formats import BFPSpec, MXSpec, quantize_dequantize
from finetune.formats.bits import branch_free

from .vectors import VectorSet, assert_same_values, load_vector_sets

VECTOR_SETS = load_vector_sets()


def spec_for(vectors: VectorSet) -> BFPSpec | MXSpec:
    """The torch spec for a vector configuration, built from its ONNX attributes."""
    attrs = {k: v for k, v in vectors.attributes.items() if k != "use_compiler_version_cpu_kernel"}
    return BFPSpec(**attrs) if vectors.op_type == "BFPQuantizeDequantize" else MXSpec(**attrs)


def test_every_configuration_is_present() -> None:
    assert len(VECTOR_SETS) == 41
    assert {v.op_type for v in VECTOR_SETS} == {"BFPQuantizeDequantize", "MXQuantizeDequantize"}


@pytest.mark.parametrize("forced", [False, True], ids=["checked", "branch_free"])
@pytest.mark.parametrize("vectors", VECTOR_SETS, ids=lambda v: v.name)
def test_torch_matches_reference(vectors: VectorSet, forced: bool) -> None:
    """Both paths reproduce the vectors: CPU's checked one, and the branch-free one accelerators run."""
    spec = spec_for(vectors)
    for i, (x, y) in enumerate(vectors.pairs):
        with branch_free() if forced else contextlib.nullcontext():
            got = quantize_dequantize(torch.from_numpy(x), spec).numpy()
        assert_same_values(got, y, f"{vectors.name} input {i}")
