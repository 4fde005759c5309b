"""Exact float32 building blocks shared by every format: exponent fields, power-of-two scaling,
rounding modes and straight-through gradients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

RoundFn = Callable[[torch.Tensor], torch.Tensor]

EXPONENT_BIAS = 127
EXPONENT_FIELD_INF_NAN = 255
MANTISSA_BITS = 23
MIN_NORMAL_EXPONENT = -126
MAX_EXPONENT = 127
F32_MIN_NORMAL = 2.0**MIN_NORMAL_EXPONENT
EXPONENT_MASK = 0x7F800000
SIGN_MASK = -0x80000000  # bit 31 of an int32

ROUND_HALF_AWAY_FROM_ZERO = 0
ROUND_HALF_UP = 1
ROUND_HALF_TO_EVEN = 2
ROUNDING_MODES = (ROUND_HALF_AWAY_FROM_ZERO, ROUND_HALF_UP, ROUND_HALF_TO_EVEN)


def exponent_field(x: torch.Tensor) -> torch.Tensor:
    """The biased exponent field (bits 23..30) of float32 values, as int32; exact, unlike log2."""
    return (x.view(torch.int32) >> MANTISSA_BITS) & 0xFF


def power_of_two_below(x: torch.Tensor) -> torch.Tensor:
    """2**floor(log2|x|) for normal float32 x (0 for zeros and subnormals, inf for NaN/Inf), by
    clearing the sign and mantissa bits: one exact integer pass."""
    return (x.view(torch.int32) & EXPONENT_MASK).view(torch.float32)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32, built from its bit pattern, for integer k in [MIN_NORMAL_EXPONENT, MAX_EXPONENT]."""
    return ((k.to(torch.int32) + EXPONENT_BIAS) << MANTISSA_BITS).view(torch.float32)


# Set by `branch_free` only: whether `needs` assumes every rare case on CPU too.
_assume_rare_cases = False
# Set by `assume_ordinary` only: whether the block formats take their ordinary path unchecked.
_assume_ordinary = False


def checks_rare_cases(device: torch.device) -> bool:
    """Whether rare per-block cases are checked on `device` (the CPU, unless `branch_free` or while
    torch.compile traces: a check reads data on the host, which would break the graph) rather than
    assumed; a caller whose check needs work of its own can skip that work where they are assumed."""
    return not _assume_rare_cases and device.type == "cpu" and not torch.compiler.is_compiling()


def needs(rare: torch.Tensor) -> bool:
    """Whether a rare per-block case occurs in `rare` (a boolean tensor): checked on CPU, where the
    check is cheap and spares ordinary data the per-element fix; assumed on accelerators, so the fix
    runs branch-free with no host synchronisation (results are identical either way)."""
    return not checks_rare_cases(rare.device) or bool(rare.any())


@contextmanager
def branch_free() -> Iterator[None]:
    """Within this block `needs` assumes every rare case on CPU too, as on accelerators: lets tests
    check on CPU that the branch-free path gives the same bits as the checked one."""
    global _assume_rare_cases
    previous, _assume_rare_cases = _assume_rare_cases, True
    try:
        yield
    finally:
        _assume_rare_cases = previous


def assumes_ordinary() -> bool:
    """Whether the block formats take their ordinary path (every scale a normal power of two both
    ways, no NaN/Inf) without checking it, as within `assume_ordinary`."""
    return _assume_ordinary


@contextmanager
def assume_ordinary() -> Iterator[None]:
    """Within this block the block formats take their ordinary path unchecked, even while
    torch.compile traces: the compiled kernels trace it for inputs a check of their own (the
    formats' `ordinary_input`) has found ordinary, and a kernel without the rare-case fixes is
    several times cheaper. On other inputs the results would be wrong."""
    global _assume_ordinary
    previous, _assume_ordinary = _assume_ordinary, True
    try:
        yield
    finally:
        _assume_ordinary = previous


def fields_within(x: torch.Tensor, lowest: int, highest: int) -> torch.Tensor:
    """Where float32 x is zero or has its exponent field in [lowest, highest] (highest < 255, so
    NaN/Inf are outside), element-wise."""
    magnitude = x.view(torch.int32) & ~SIGN_MASK
    field = magnitude >> MANTISSA_BITS
    return (magnitude == 0) | ((field >= lowest) & (field <= highest))


def _outside(k: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Where the exponent k lies outside [low, high], per element (for torch.where)."""
    return (k < low) | (k > high)


def _any_outside(k: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Whether some exponent in k lies outside [low, high], as a 0-dim boolean (True when k is empty, which
    takes the general path): one vectorised pass, over 10 times faster on CPU than the per-element mask
    and its any(), for a check whose answer alone is needed."""
    if not k.numel():
        return torch.ones((), dtype=torch.bool, device=k.device)
    least, most = torch.aminmax(k)
    return (least < low) | (most > high)


def scale_by_pow2(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """x * 2**k exactly (up to the final rounding of the result), even where 2**k alone is not a
    normal float32: there the shift is split in two halves, each a normal power of two; elsewhere
    the second factor is 1.0, which changes no bit. k is usually per block, so the check is cheap."""
    out_of_range = _outside(k, MIN_NORMAL_EXPONENT, MAX_EXPONENT)
    if not needs(out_of_range):
        return x * pow2(k)
    first = torch.where(out_of_range, k >> 1, k)  # floor(k / 2): a shift, not the division compiled kernels loop over
    return x * pow2(first) * pow2(k - first)


def quantize_scaled(x: torch.Tensor, k: torch.Tensor, quantize: RoundFn, normal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantize(x * 2**-k) * 2**k, x * 2**-k), each product exact up to its final rounding: the
    block formats' scale-round-unscale. When 2**k and 2**-k are both normal (nearly always; `normal`:
    the caller has checked it), each is one exact power of two (a product, which is cheaper than
    the division x / 2**k and rounds exactly like it)."""
    if normal or not needs(_any_outside(k, MIN_NORMAL_EXPONENT, -MIN_NORMAL_EXPONENT)):
        scaled = x * pow2(-k)
        return quantize(scaled).mul_(pow2(k)), scaled
    scaled = scale_by_pow2(x, -k)
    return scale_by_pow2(quantize(scaled), k), scaled


def round_half_even(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties to even (IEEE default, ONNX Round)."""
    return torch.round(v)


def round_half_up(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties toward +inf: fix the ties of round-half-even, found exactly since
    v - round(v) is exact in float32."""
    r = torch.round(v)
    return r.add_(torch.sub(v, r).eq_(0.5))


def round_half_away_from_zero(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero: ties toward +inf on the magnitude."""
    return torch.copysign(round_half_up(v.abs()), v)


_ROUNDERS: dict[int, RoundFn] = {
    ROUND_HALF_AWAY_FROM_ZERO: round_half_away_from_zero,
    ROUND_HALF_UP: round_half_up,
    ROUND_HALF_TO_EVEN: round_half_even,
}


def rounder(mode: int) -> RoundFn:
    """The rounding function for a `rounding_mode` attribute value (0, 1 or 2)."""
    if mode not in _ROUNDERS:
        raise ValueError(f"rounding_mode must be one of {ROUNDING_MODES}, got {mode!r}")
    return _ROUNDERS[mode]


class _StraightThrough(torch.autograd.Function):
    """Forward: the precomputed y. Backward: the incoming gradient where `passes`, zero elsewhere.
    One saved mask and one pass each way, instead of the three extra passes of x - x.detach()."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, y: torch.Tensor,
                passes: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(passes)
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (passes,) = ctx.saved_tensors
        return (grad if passes is None else torch.where(passes, grad, 0.0)), None, None


def tracks_gradient(x: torch.Tensor) -> bool:
    """Whether autograd records ops on x here (x requires grad, grad mode on): only then does a
    quantizer need its straight-through mask (a parameter under no_grad does not: 62 MiB for an LM head)."""
    return x.requires_grad and torch.is_grad_enabled()


def straight_through(x: torch.Tensor, y: torch.Tensor, passes: torch.Tensor | None) -> torch.Tensor:
    """Value of y with the gradient of x where the boolean mask `passes` holds (identity inside
    the range; everywhere when None), zero elsewhere."""
    if not tracks_gradient(x):
        return y
    return _StraightThrough.apply(x, y.detach(), passes)


def compute_in_float32(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Run a float32 QDQ on x, casting float16/bfloat16 inputs up and the result back."""
    if x.dtype == torch.float32:
        return fn(x)
    if not x.is_floating_point():
        raise TypeError(f"quantize-dequantize expects a floating-point tensor, got {x.dtype}")
    return fn(x.float()).to(x.dtype)
