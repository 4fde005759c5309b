"""Compiled quantize-dequantize kernels give the eager functions' bits, in value and gradient, for
every format and rounding mode; what stays eager is recorded; the compiler's availability decides
fast_finetune.compile. Kernels are cached per format and shape, so the tests share their compiles
(the sweep over every rounding mode and shape is marked slow)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from finetune.formats import (
    BF16,
    BFP16,
    FP8_E4M3FN,
    FP8_E5M2,
    FP16,
    MX4,
    MX6,
    MX9,
    MXFP4,
    MXFP6_E2M3,
    MXFP6_E3M2,
    MXFP8_E4M3,
    MXFP8_E5M2,
    MXINT8,
    BFPSpec,
    FloatSpec,
    FormatSpec,
    IntSpec,
    MXSpec,
    int_quantize_dequantize,
    quantize_dequantize,
)
from finetune.formats import compiled, kernels
from finetune.formats.compiled import (
    EAGER_FORMATS,
    compiled_kernels,
    quantize_dequantize_compiled,
    resolve_compile,
)
from finetune.formats.kernels import WARM_INDEX
from finetune.formats.packed import pack_mask, unpack_mask
from finetune.lift import FakeQuantize

F32_MAX = 3.4028234663852886e38
# Zeros of both signs, subnormals, the largest floats, ties of every rounding, NaN and infinities,
# and the narrow floats' largest values and the first values past them.
SPECIALS = [0.0, -0.0, 1e-40, -3e-42, 1e38, -F32_MAX, 0.5, 1.5, 2.5, -2.5, -0.5, math.inf, -math.inf, math.nan,
            448.0, 465.0, 57344.0, 61440.0, 65504.0, 65520.0, 3.3895314e38, -3.3961775e38, 1.0000001, 1.00390625]

SCALE = torch.tensor(0.05)
Case = tuple[FormatSpec, torch.Tensor | None, torch.Tensor | None]
# Every format family with its parameters; ties of x / scale lie in SPECIALS for the INT ones.
CASES: dict[str, Case] = {
    "BFP16": (BFP16, None, None), "MX4": (MX4, None, None), "MX6": (MX6, None, None), "MX9": (MX9, None, None),
    "BFP16 bfloat16 first": (BFPSpec(convert_to_bfloat_before_bfp=1), None, None),
    "MXINT8": (MXINT8, None, None), "MXFP8_E4M3": (MXFP8_E4M3, None, None), "MXFP8_E5M2": (MXFP8_E5M2, None, None),
    "MXFP6_E3M2": (MXFP6_E3M2, None, None), "MXFP6_E2M3": (MXFP6_E2M3, None, None), "MXFP4": (MXFP4, None, None),
    "BF16": (BF16, None, None), "FP16": (FP16, None, None), "FP16 overflowing": (FloatSpec("float16", saturate=False), None, None),
    "FP8_E4M3FN": (FP8_E4M3FN, torch.tensor(0.01), None), "FP8_E5M2": (FP8_E5M2, None, None),
    "INT8": (IntSpec("int8"), SCALE, torch.tensor(0.0)),
    "UINT8 asymmetric": (IntSpec("uint8", symmetric=False), SCALE, torch.tensor(128.0)),
    "INT4 per channel": (IntSpec("int4", axis=1), torch.linspace(0.1, 1.0, 37), torch.zeros(37)),
    "INT4 block 8": (IntSpec("int4", axis=1, block_size=8), torch.linspace(0.1, 1.0, 60).reshape(4, 5, 3), torch.zeros(4, 5, 3)),
    "INT16": (IntSpec("int16"), torch.tensor(1e-3), torch.tensor(0.0)),
    "INT32": (IntSpec("int32"), torch.tensor(1e-6), torch.tensor(0.0)),
}
SHAPE = (4, 37, 3)  # 37 channels: no block size divides them, so every block format pads


def data(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Normal values times 3 with SPECIALS first (as many as fit)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    flat = x.view(-1)
    count = min(len(SPECIALS), flat.numel())
    flat[:count] = torch.tensor(SPECIALS[:count])
    return x


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns (the sign of zero included), NaN where NaN: which NaN a float operation
    returns is the machine's (eager's own vector and scalar paths differ there)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[expected.dtype]
    assert torch.equal(actual.masked_fill(nan, 0).view(bits), expected.masked_fill(nan, 0).view(bits))


def check_compiled_equals_eager(spec: FormatSpec, scale: torch.Tensor | None, zero_point: torch.Tensor | None,
                                x: torch.Tensor) -> None:
    """Values without autograd, values with it and the gradient of a random incoming gradient."""
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    assert_same_bits(quantize_dequantize_compiled(x, spec, scale, zero_point), quantize_dequantize(x, spec, scale, zero_point))
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager = quantize_dequantize(eager_x, spec, scale, zero_point)
    result = quantize_dequantize_compiled(compiled_x, spec, scale, zero_point)
    eager.backward(grad)
    result.backward(grad)
    assert_same_bits(result.detach(), eager.detach())
    assert_same_bits(compiled_x.grad, eager_x.grad)


@pytest.mark.parametrize("name", CASES)
def test_compiled_equals_eager_bit_for_bit(name: str) -> None:
    spec, scale, zero_point = CASES[name]
    check_compiled_equals_eager(spec, scale, zero_point, data(SHAPE))


@pytest.mark.parametrize("spec", [MX4, MXFP4, BFP16], ids=["MX4", "MXFP4", "BFP16"])
@pytest.mark.parametrize("shape", [(), (1,), (21,), (3, 40)], ids=["rank0", "one", "rank1", "rows"])
def test_odd_shapes_compile_to_the_same_bits(spec: FormatSpec, shape: tuple[int, ...]) -> None:
    """Rank 0 and one element pass through; rank 1 and rows of 40 pad their last block (the rows:
    the shape inductor miscompiles when padding is sliced off the merged block axes)."""
    check_compiled_equals_eager(spec, None, None, data(shape))


ROUNDING_SPECS = {"BFP16": BFP16, "MX4": MX4, "MX6": MX6, "MX9": MX9, "MXINT8": MXINT8, "MXFP4": MXFP4,
                  "MXFP8_E5M2": MXFP8_E5M2, "MXFP6_E2M3": MXFP6_E2M3}
ROUNDING_SHAPES = {"rows": (2, 33), "odd": (5, 19, 2), "whole": (3, 48, 7)}


def covering_cases() -> list[object]:
    """Every format with every rounding mode, each pair on one of the shapes so that every format and
    every rounding mode also meets every shape (a covering of all pairs: 24 compiles, not 72)."""
    shapes = list(ROUNDING_SHAPES)
    return [pytest.param(spec, mode, ROUNDING_SHAPES[shapes[(i + mode) % 3]], id=f"{shapes[(i + mode) % 3]}-{name}-{mode}")
            for i, (name, spec) in enumerate(ROUNDING_SPECS.items()) for mode in (0, 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "rounding_mode", "shape"), covering_cases())
def test_every_rounding_mode_and_shape_compiles_to_the_same_bits(
    spec: BFPSpec | MXSpec, rounding_mode: int, shape: tuple[int, ...]
) -> None:
    check_compiled_equals_eager(spec.__class__(**{**spec.__dict__, "rounding_mode": rounding_mode}), None, None,
                                data(shape, seed=rounding_mode))


def ordinary_data(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Eighths in [-8, 8) (ties of every rounding at every block scale) with a zero first block: data
    on which the compiled block kernels take their kernel without rare-case fixes."""
    x = torch.randint(-64, 64, shape, generator=torch.Generator().manual_seed(seed)).float() / 8
    x.view(-1)[:32] = 0.0
    return x


@pytest.mark.parametrize(("spec", "shape"), [
    (MX4, (3, 40, 5)), (MXSpec("fp8_e4m3", rounding_mode=1), (3, 40, 5)), (MXSpec("int8", rounding_mode=0), (2, 70, 3)),
    (BFPSpec(block_size=40, rounding_mode=1, convert_to_bfloat_before_bfp=1), (2, 90, 3)), (MX9, (3, 40))],
    ids=["MX4", "MXFP8_E4M3 half up", "MXINT8 half away", "BFP block 40 bfloat16 first", "MX9 rows"])
def test_ordinary_inputs_compile_to_the_same_bits(spec: BFPSpec | MXSpec, shape: tuple[int, ...]) -> None:
    """The kernels without rare-case fixes (every input here passes their check), with blocks padded
    at the edge, a mask word of 32 bits (block 32) and blocks longer than a word (40)."""
    check_compiled_equals_eager(spec, None, None, ordinary_data(shape))


def test_packed_masks_unpack_to_themselves() -> None:
    """Any mask comes back from its packed form, along any axis, whole words or not."""
    for shape, axis, group in [((3, 37, 4), 1, 16), ((5, 70), -1, 32), ((33,), 0, 8), ((2, 3, 5, 7), 0, 2)]:
        mask = torch.rand(shape, generator=torch.Generator().manual_seed(len(shape))) > 0.3
        a = axis % len(shape)
        packed = pack_mask(mask, a, group)
        assert packed.dtype == torch.int32 and packed.shape[1] == -(-shape[a] // group)
        assert torch.equal(unpack_mask(packed, mask.shape, a, group), mask)


def test_float16_inputs_and_channels_last_layout_match_eager() -> None:
    """float16 is computed in float32 and cast back; a channels-last input keeps its layout, as the
    eager blocks keep it (the float sums downstream follow the layout)."""
    x = data((2, 37, 3, 3))
    assert_same_bits(quantize_dequantize_compiled(x.half(), MX4), quantize_dequantize(x.half(), MX4))
    last = x.contiguous(memory_format=torch.channels_last)
    result = quantize_dequantize_compiled(last, MX4)
    assert_same_bits(result, quantize_dequantize(last, MX4))
    assert result.stride() == quantize_dequantize(last, MX4).stride()


def test_batches_of_any_size_share_one_kernel() -> None:
    """Units of one shape share a compile: the batch axis is dynamic (a batch of one, which dynamo
    specialises, still goes through the same kernel, in a second graph)."""
    for batch in (4, 6, 9):
        check_compiled_equals_eager(MX6, None, None, data((batch, 37, 3), seed=batch))
    keys = [key for key in compiled._kernels if key.spec == MX6 and key.shape[1:] == (37, 3)]
    assert [key.shape[0] for key in keys] == [None]


def test_rounding_hooks_and_learned_scales_stay_eager_and_are_recorded() -> None:
    """AdaRound's rounding hook and a scale with a gradient run the eager functions (their gradients
    reach the hook's variables and the scale) and the run's record names them."""
    x = data(SHAPE).nan_to_num().clamp(-10, 10)
    v = torch.full(SHAPE, 0.3, requires_grad=True)
    hook = lambda ratio: torch.floor(ratio) + v  # noqa: E731  (a soft rounding like AdaRound's)
    scale = SCALE.clone().requires_grad_()
    with compiled_kernels(True) as use:
        hooked = quantize_dequantize_compiled(x, IntSpec("int8"), SCALE, None, hook)
        learned = quantize_dequantize_compiled(x, IntSpec("int8"), scale, None)
    assert_same_bits(hooked, int_quantize_dequantize(x, SCALE, 0.0, IntSpec("int8"), hook))
    hooked.sum().backward()
    learned.sum().backward()
    assert v.grad is not None and scale.grad is not None
    assert use.eager_formats == {name: EAGER_FORMATS[name] for name in ("INT with a rounding hook", "a learned scale")}
    assert use.summary()["compiled"] is True


def test_fake_quantize_runs_compiled_kernels_only_when_asked_and_on_large_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    quantizer = FakeQuantize(MXFP4)
    x = data(SHAPE)
    with compiled_kernels(True) as use:
        assert_same_bits(quantizer(x), quantize_dequantize(x, MXFP4))  # smaller than MIN_COMPILED_ELEMENTS: eager
        assert use.summary()["kernels"] == 0
        monkeypatch.setattr(compiled, "MIN_COMPILED_ELEMENTS", x.numel())
        assert_same_bits(quantizer(x), quantize_dequantize(x, MXFP4))
    before = len(compiled._kernels)
    with compiled_kernels(False):
        assert_same_bits(quantizer(data((4, 38, 3))), quantize_dequantize(data((4, 38, 3)), MXFP4))
    assert len(compiled._kernels) == before and use.summary()["kernels"] == 1


def test_compile_setting_follows_the_compiler_at_hand(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """auto: on with a compiler, off with one warning naming what is missing; true: an error
    without one; false: off."""
    resolve_compile.cache_clear()
    monkeypatch.setattr(compiled, "compiler_missing", lambda device: None)
    assert resolve_compile("auto", "cpu") is True and resolve_compile(True, "cpu") is True
    assert resolve_compile(False, "cpu") is False
    resolve_compile.cache_clear()
    monkeypatch.setattr(compiled, "compiler_missing", lambda device: "a C++ compiler ('g++' does not run; install one or set CXX)")
    with caplog.at_level(logging.WARNING):
        assert resolve_compile("auto", "cpu") is False
        assert resolve_compile("auto", "cpu") is False
    assert [r.getMessage() for r in caplog.records] == [
        "fast_finetune.compile auto: kernels stay eager on cpu, a C++ compiler ('g++' does not run; install one or set CXX) is missing"]
    with pytest.raises(RuntimeError, match="compile is true but cpu kernels cannot be compiled: a C\\+\\+ compiler"):
        resolve_compile(True, "cpu")
    resolve_compile.cache_clear()


def test_a_missing_cpp_compiler_is_named() -> None:
    from torch._inductor import config

    with config.patch({"cpp.cxx": (None, "no-such-compiler-here")}):
        assert compiled.compiler_missing(torch.device("cpu")) == (
            "a C++ compiler ('no-such-compiler-here' does not run; install one or set CXX)")
    assert compiled.compiler_missing(torch.device("cpu")) is None


@pytest.fixture
def fresh_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """No kernel compiled earlier in the process, and an empty record of warm kernels (its path returned)."""
    index = tmp_path / WARM_INDEX
    monkeypatch.setattr(compiled, "_kernels", {})
    monkeypatch.setattr(kernels, "warm_index", lambda: index)
    kernels.warm_kernels.cache_clear()
    yield index
    kernels.warm_kernels.cache_clear()


def test_a_run_compiles_on_training_calls_that_pay_and_records_the_cost(fresh_kernels: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass without gradients (the streams', the held-out loss) never starts a compile, however large;
    a training call whose elements x calls ahead reach the payback does, and the record says what it
    cost and lists the kernel as warm for later runs."""
    x = data((4, 96))
    monkeypatch.setattr(compiled, "PAYBACK_ELEMENT_CALLS", x.numel() * 10)
    with compiled_kernels(True, calls_ahead=10) as use:
        with torch.no_grad():
            assert_same_bits(quantize_dequantize_compiled(x, MXFP4), quantize_dequantize(x, MXFP4))
        assert (use.summary()["kernels"], use.summary()["shapes_left_eager_as_too_few_calls"]) == (0, 1)
        trained = x.clone().requires_grad_()
        assert_same_bits(quantize_dequantize_compiled(trained, MXFP4), quantize_dequantize(x, MXFP4))
    summary = use.summary()
    assert summary["kernels"] == 1 and summary["shapes_left_eager_as_too_few_calls"] == 0
    assert summary["compiles"] >= 1 and summary["warm_compiles"] == 0 and summary["compile_seconds"] > 0
    assert fresh_kernels.read_text().split() == [kernels.digest(next(iter(compiled._kernels)))]


def test_a_kernel_the_cache_holds_pays_from_a_smaller_run(fresh_kernels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Too few calls for a cold compile, enough for a warm one: eager until the record lists the kernel."""
    x = data((4, 80)).requires_grad_()
    monkeypatch.setattr(compiled, "PAYBACK_ELEMENT_CALLS", x.numel() * 10 * 2)
    with compiled_kernels(True, calls_ahead=10) as cold:
        quantize_dequantize_compiled(x, MXFP4)
    assert cold.summary()["kernels"] == 0 and cold.summary()["shapes_left_eager_as_too_few_calls"] == 1
    key = next(iter(cold.not_worth))
    fresh_kernels.write_text(kernels.digest(key) + "\n")
    kernels.warm_kernels.cache_clear()
    with compiled_kernels(True, calls_ahead=10) as warm:
        assert_same_bits(quantize_dequantize_compiled(x, MXFP4), quantize_dequantize(x.detach(), MXFP4))
    assert warm.summary()["kernels"] == 1 and warm.summary()["warm_compiles"] == warm.summary()["compiles"] >= 1
