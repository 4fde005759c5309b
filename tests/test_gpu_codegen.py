"""The compiled kernels' GPU code, generated and compiled on the CPU (tests/gpu_code.py): for every
format's kernels (whose values tests/test_formats_compiled.py checks bit for bit on the CPU),
inductor's Triton code for an H100 (sm_90) and an MI300X (gfx942) compiles with Triton for that
target and keeps what eager's bits and determinism need; a kernel with the settings that keep them
removed, or a cast pair or an atomic edited into its code, is caught. One family of each code path
runs on every test run; the other formats are marked slow."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache

import pytest
import torch

from finetune.formats import kernels
from finetune.recon.device import deterministic

from .gpu_code import GFX942, SM_90, TARGETS, GraphCode, Target, code_problems, compiled_binaries, generated_code
from .test_formats_compiled import CASES, SHAPE

pytest.importorskip("triton", reason="Triton (brought by torch's PyPI wheel) generates the GPU code")

# Run on every test run (the block formats' kernels take 10-40 s each to trace on 2 shared cores):
# INT (blocked scales), float (a narrow round trip), FP8, microexponents (blocks, sub-blocks, a packed mask).
EVERY_RUN = ("INT4 block 8", "BF16", "FP8_E4M3FN", "MX4")
CUDA = torch.device("cuda")


@cache
def code_for_each_target(name: str) -> dict[Target, list[GraphCode]]:
    """The generated code of CASES[name]'s kernels on every target, traced under a run's deterministic
    settings; made once per test run (tracing is most of this file's cost) for the tests that check it."""
    spec, scale, zero_point = CASES[name]
    with deterministic(0, True, False, CUDA):
        return generated_code(spec, SHAPE, scale, zero_point, TARGETS)


def code_for(name: str, target: Target) -> list[GraphCode]:
    """The generated code of CASES[name]'s kernels on `target`."""
    return code_for_each_target(name)[target]


@pytest.fixture
def bf16_code() -> list[GraphCode]:
    return code_for("BF16", SM_90)


def params() -> Iterator[object]:
    for name in CASES:
        for target in TARGETS:
            marks = () if name in EVERY_RUN else (pytest.mark.slow,)
            yield pytest.param(name, target, marks=marks, id=f"{name}-{target.name}")


@pytest.mark.parametrize("name, target", params())
def test_kernels_compile_for_the_gpu_keeping_eager_bits(name: str, target: Target) -> None:
    graphs = code_for(name, target)
    assert [graph.function for graph in graphs if graph.kernels][-1] == "gradient"
    assert all(graph.kernels for graph in graphs)
    assert [problem for graph in graphs for problem in code_problems(graph, target)] == []


@pytest.mark.parametrize("name, narrow", [("BF16", torch.bfloat16), ("FP8_E4M3FN", torch.float8_e4m3fn),
                                          pytest.param("BFP16 bfloat16 first", torch.bfloat16, marks=pytest.mark.slow)])
def test_the_check_sees_the_rounding_each_format_needs(name: str, narrow: torch.dtype) -> None:
    """The narrow casts checked come from the traced graph: each format that rounds through a narrow
    type has it there, so the check of its kernel is not empty."""
    graphs = code_for(name, SM_90)
    assert narrow in graphs[0].narrow_types
    assert graphs[-1].narrow_types == set()  # the gradient only masks


def test_inductor_defaults_drop_the_cast_pair_and_round_division_inexactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: BF16's kernels without INDUCTOR_OPTIONS, outside deterministic mode."""
    monkeypatch.setattr(kernels, "INDUCTOR_OPTIONS", {})
    spec, scale, zero_point = CASES["BF16"]
    graphs = generated_code(spec, SHAPE, scale, zero_point, (SM_90,))[SM_90]
    problems = "\n".join(code_problems(graphs[0], SM_90))
    assert "the graph rounds through torch.bfloat16, the Triton code does not" in problems
    assert "enable_fp_fusion is not False" in problems
    assert "inexact instruction 'div.full' in the PTX" in problems
    assert "not generated under deterministic algorithms" in problems


def test_one_trace_for_all_targets_gives_each_target_its_own_code() -> None:
    """Dynamo and AOTAutograd trace once as for sm_90; inductor then writes gfx942's code as a trace
    made for gfx942 alone (ROCm's torch.version.hip set throughout) writes it."""
    spec, scale, zero_point = CASES["BF16"]
    with deterministic(0, True, False, CUDA):
        alone = generated_code(spec, SHAPE, scale, zero_point, (GFX942,))[GFX942]
    shared = code_for("BF16", GFX942)
    assert [(graph.function, graph.kernels) for graph in shared] == [(graph.function, graph.kernels) for graph in alone]
    assert shared[0].kernels != code_for("BF16", SM_90)[0].kernels  # the targets' code differs


def test_a_cast_pair_removed_from_the_code_is_caught(bf16_code: list[GraphCode]) -> None:
    values = bf16_code[0]
    assert code_problems(values, SM_90) == []
    edited = {name: re.sub(r"\.to\(tl\.(?:bfloat16|float32)\)", "", source) for name, source in values.kernels.items()}
    assert edited != values.kernels
    problems = code_problems(GraphCode(values.function, values.narrow_types, edited), SM_90)
    assert problems == ["values: the graph rounds through torch.bfloat16, the Triton code does not",
                        "values: no cvt.rn.bf16 rounding in the PTX"]


def test_an_atomic_store_is_caught_in_the_source_and_the_ptx(bf16_code: list[GraphCode]) -> None:
    (name, source), = bf16_code[0].kernels.items()
    store = next(line.strip() for line in source.splitlines() if line.strip().startswith("tl.store("))
    atomic = store.replace("tl.store(", "tl.atomic_add(").replace(", None)", ", sem='relaxed')")
    problems = code_problems(GraphCode("values", {torch.bfloat16}, {name: source.replace(store, atomic)}), SM_90)
    assert any("uses atomics" in problem for problem in problems)
    assert any("atomics in the device code" in problem for problem in problems)


def test_each_launch_configuration_compiles_to_a_cubin(bf16_code: list[GraphCode]) -> None:
    (name, source), = bf16_code[0].kernels.items()
    binaries = compiled_binaries(name, source, SM_90)
    assert binaries and all(binary.asm["cubin"][:4] == b"\x7fELF" for binary in binaries)
    assert {binary.metadata.target.arch for binary in binaries} == {90}
    assert "cvt.rn.bf16.f32" in binaries[0].asm["ptx"]
