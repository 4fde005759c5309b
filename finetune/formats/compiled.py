"""Compiled quantize-dequantize kernels: `format_values` and its straight-through gradient run
through torch.compile (inductor: C++/OpenMP on the CPU, Triton on CUDA/ROCm), giving the eager
functions' bits. Traced, the formats take their branch-free, unchunked path (bits.checks_rare_cases,
blocks._chunks), which gives the same bits as the checked, chunked one; on the CPU the block formats
first take their ordinary path unchecked (bits.assume_ordinary) with a check of the input in the
same pass, and the branch-free kernel runs only where that check fails. This module owns the choice
eager/compiled per format (EAGER_FORMATS), the cache of compiled callables and whether a compiler
is at hand at all."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from . import FloatSpec, FormatSpec, IntSpec, format_values, int_quantize_dequantize, kernels, quantize_dequantize
from .bits import straight_through, tracks_gradient
from .kernels import Kernel, Key

logger = logging.getLogger(__name__)

CompileSetting = Literal["auto", True, False]

# What stays eager, and why: the names the fine-tuning report lists (see eager_reason).
EAGER_FORMATS: dict[str, str] = {
    "INT with a rounding hook": "AdaRound's soft rounding is a learned function whose gradient reaches its rounding "
                                "variables; the kernels' straight-through gradient does not carry it",
    "a learned scale": "its gradient reaches the scale, which the kernels' straight-through gradient does not carry",
}

# Tensors smaller than this stay eager in a run (FakeQuantize): there a compiled call's fixed cost
# (guards, the autograd function, the kernel lookup: some 20-30 us) outweighs its gain. Measured on
# 2 shared cores, forward + backward, one thread: INT8 per tensor 159 vs 134 us eager at 6272
# elements, 539 vs 664 us at 100352; digits-CNN tuning steps (tensors of at most 16384 elements)
# took 5.7 ms compiled against 5.0 ms eager at MX4, 2.2 against 2.1 ms at XINT8.
MIN_COMPILED_ELEMENTS = 1 << 16

# A kernel is compiled for a new shape only where the run's training calls can pay for the compile: elements x
# calls ahead (a unit's iterations) at least this. A cold compile of a block format's kernels took 7.5-8 s
# per shape, and saved 6-17 ns per element and call (MX4, BFP16, forward + backward at 0.6M and 6.4M
# elements, one thread on 2 loaded cores); at 8 s and 8 ns that is 1e9. PP-OCR's angle classifier
# (54 layers of distinct shapes up to 0.6M elements at batch 16) otherwise spent 6 of its 6.3 minutes
# of a 20-iteration run compiling. A kernel compiled earlier in the process is used whatever the size.
PAYBACK_ELEMENT_CALLS = 10**9

# A shape whose kernels inductor's on-disk cache already holds (WARM_INDEX says so) compiles in 0.2-0.6 s
# instead of 7.5-8: it pays from this share of PAYBACK_ELEMENT_CALLS on.
WARM_SHARE = 1 / 16

# Compiled kernels held at most: each is one graph (two where an input of batch 1 came too); past it a
# kernel runs eager, so a model of many shapes cannot compile without end.
MAX_KERNELS = 256


def compiler_missing(device: torch.device) -> str | None:
    """What torch.compile lacks to build kernels for `device` (None: nothing): inductor itself,
    a C++ compiler that runs on the CPU (inductor's cpp.cxx, from CXX), Triton on an accelerator."""
    try:
        from torch._inductor import config, cpp_builder, exc
    except ImportError as error:
        return f"torch's inductor compiler ({error})"
    if device.type == "cpu":
        try:
            cpp_builder.get_cpp_compiler()
        except exc.InvalidCxxCompiler:
            names = " or ".join(repr(name) for name in config.cpp.cxx if name)
            return f"a C++ compiler ({names} does not run; install one or set CXX)"
        return None
    from torch.utils._triton import has_triton

    return None if has_triton() else "Triton (pip install triton)"


@functools.cache
def resolve_compile(setting: CompileSetting, device_type: str) -> bool:
    """Whether kernels are compiled for `setting` on a device of this type: `auto` where a compiler is
    at hand (otherwise one warning naming what is missing, once per process), `true` or an error."""
    if setting is False:
        return False
    missing = compiler_missing(torch.device(device_type))
    if missing is None:
        return True
    if setting is True:
        raise RuntimeError(f"fast_finetune.compile is true but {device_type} kernels cannot be compiled: {missing} is missing")
    logger.warning("fast_finetune.compile auto: kernels stay eager on %s, %s is missing", device_type, missing)
    return False


@dataclass
class KernelUse:
    """What the quantizers of a run did: whether kernels were compiled, which formats stayed eager
    (name -> reason), the kernels they ran (compiled now or earlier in the process) and the calls
    that ran eager past MAX_KERNELS."""

    compiled: bool
    eager_formats: dict[str, str]
    calls_ahead: int | None = None  # how often each kernel will run (None: unknown, compile every shape)
    used: set[Key] = field(default_factory=set)
    over_limit: int = 0
    not_worth: set[Key] = field(default_factory=set)
    compiles: list[tuple[bool, float]] = field(default_factory=list)  # (warm, seconds) of each compile in the run

    def summary(self) -> dict[str, Any]:
        """The report's entry: what ran compiled, what stayed eager and why, and what compiling cost."""
        return {"compiled": self.compiled, "eager_formats": dict(self.eager_formats), "kernels": len(self.used),
                "kernels_over_limit": self.over_limit, "shapes_left_eager_as_too_few_calls": len(self.not_worth),
                "compiles": len(self.compiles), "warm_compiles": sum(warm for warm, _ in self.compiles),
                "compile_seconds": round(sum(seconds for _, seconds in self.compiles), 3)}


_use: KernelUse | None = None  # set by compiled_kernels while a run wants compiled kernels


@contextmanager
def compiled_kernels(enabled: bool, calls_ahead: int | None = None) -> Iterator[KernelUse]:
    """Within this block, quantize_dequantize_compiled compiles (when `enabled`) the shapes whose
    `calls_ahead` pay for it (PAYBACK_ELEMENT_CALLS; None: every shape); yields the record of what it did."""
    global _use
    previous, _use = _use, KernelUse(enabled, {}, calls_ahead)
    try:
        yield _use
    finally:
        _use = previous


def kernels_enabled(x: torch.Tensor) -> bool:
    """Whether the current run asked for compiled kernels and x is large enough to gain from them
    (FakeQuantize reads it)."""
    return _use is not None and _use.compiled and x.numel() >= MIN_COMPILED_ELEMENTS


def eager_reason(spec: FormatSpec, scale: torch.Tensor | None, rounding: object) -> str | None:
    """The EAGER_FORMATS name a quantizer falls under (None: it compiles)."""
    if isinstance(spec, IntSpec) and rounding is not None:
        return "INT with a rounding hook"
    if scale is not None and scale.requires_grad:
        return "a learned scale"
    return None


def quantize_dequantize_compiled(
    x: torch.Tensor,
    spec: FormatSpec,
    scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    rounding: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """quantize_dequantize through compiled kernels, with the same values and straight-through
    gradient bit for bit; eager (and so recorded) for the cases EAGER_FORMATS names, which is where
    a `rounding` hook goes, and past MAX_KERNELS."""
    if not x.is_floating_point():
        raise TypeError(f"quantize-dequantize expects a floating-point tensor, got {x.dtype}")
    reason = eager_reason(spec, scale, rounding)
    if reason is not None:
        record_eager(reason)
        if rounding is not None:
            return int_quantize_dequantize(x, scale, 0.0 if zero_point is None else zero_point, spec, rounding)
        return quantize_dequantize(x, spec, scale, zero_point)
    xf = x.float()
    if isinstance(spec, (IntSpec, FloatSpec)):  # inputs, not constants, which inductor would fold: -0.0 + 0.0 is +0.0
        scale = torch.ones((), device=x.device) if scale is None else scale
        zero_point = torch.zeros((), device=x.device) if zero_point is None else zero_point
    kernel = _kernel(spec, xf, scale, zero_point)
    if kernel is None:
        y, passes = format_values(xf.detach(), spec, scale, zero_point, with_mask=tracks_gradient(xf))
        y = straight_through(xf, y, passes)
    elif xf.requires_grad and torch.is_grad_enabled():
        y = _CompiledQDQ.apply(xf, kernel, scale, zero_point)
    else:
        y = kernel.values(xf.detach(), scale, zero_point)
    return y.to(x.dtype)


def record_eager(reason: str) -> None:
    """Note in the run's record that a quantizer of this kind (an EAGER_FORMATS name) stayed eager."""
    if _use is not None:
        _use.eager_formats[reason] = EAGER_FORMATS[reason]


def _layout(x: torch.Tensor) -> torch.memory_format:
    """x's memory format (channels last or contiguous), for the incoming gradient to match it."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


_kernels: dict[Key, Kernel] = {}


def _kernel(spec: FormatSpec, x: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> Kernel | None:
    """The compiled kernel for these inputs, made on first use; None where the run's calls would not
    pay for compiling it, and past MAX_KERNELS."""
    key = kernel_key(spec, x, scale, zero_point)
    kernel = _kernels.get(key)
    if kernel is None:
        if not _pays(key, x.numel()):
            return None
        if len(_kernels) >= MAX_KERNELS:
            if _use is not None:
                _use.over_limit += 1
            return None
        kernel = _kernels[key] = Kernel(key, len(_kernels), functools.partial(_compiled_once, key))
    if _use is not None:
        _use.used.add(key)
        _use.not_worth.discard(key)
    return kernel


def kernel_key(spec: FormatSpec, x: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> Key:
    """The Key of the kernel that serves these inputs (also what tests generate GPU code for)."""
    return Key(spec, _shape_key(spec, x), x.stride(), x.device, _shape(scale), _shape(zero_point))


def _pays(key: Key, elements: int) -> bool:
    """Whether compiling key's kernel pays in the current run (outside one: always). A pass without
    gradients never starts a compile (the streams' and the held-out passes run once per unit or per
    few steps, not once per step); a training call does where elements x calls ahead reach
    PAYBACK_ELEMENT_CALLS, or its WARM_SHARE where inductor's cache holds the kernel."""
    if _use is None or _use.calls_ahead is None:
        return True
    element_calls = elements * _use.calls_ahead
    if torch.is_grad_enabled() and (element_calls >= PAYBACK_ELEMENT_CALLS or (
            element_calls >= PAYBACK_ELEMENT_CALLS * WARM_SHARE and kernels.digest(key) in kernels.warm_kernels())):
        return True
    _use.not_worth.add(key)
    return False


def _compiled_once(key: Key, warm: bool, seconds: float) -> None:
    """Record a compile of one of key's graphs (`warm`: the kernel was in WARM_INDEX when the run
    made it): its cost in the run's record, the kernel's name in WARM_INDEX."""
    name = kernels.digest(key)
    if _use is not None:
        _use.compiles.append((warm, seconds))
    if name not in kernels.warm_kernels():
        kernels.warm_kernels().add(name)
        try:
            with kernels.warm_index().open("a") as index:
                index.write(name + "\n")
        except OSError as error:
            logger.debug("could not note the compiled kernel in %s: %s", kernels.warm_index(), error)


def _shape_key(spec: FormatSpec, x: torch.Tensor) -> tuple[int | None, ...]:
    """x's shape, its batch (first) axis None where batches of any size can share a kernel: the
    tensor has one besides the axis the format works along."""
    axis = getattr(spec, "axis", None)
    if x.dim() < 2 or (axis is not None and axis % x.dim() == 0):
        return tuple(x.shape)
    return (None, *x.shape[1:])


def _shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)


class _CompiledQDQ(torch.autograd.Function):
    """Forward: the compiled forward. Backward: the compiled straight-through gradient, from what
    the forward kept (x or a packed mask)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernel: Kernel, scale: torch.Tensor | None,
                zero_point: torch.Tensor | None) -> torch.Tensor:
        y, saved = kernel.forward(x.detach(), scale, zero_point)
        ctx.kernel, ctx.layout = kernel, _layout(x)
        ctx.save_for_backward(saved, scale, zero_point)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, scale, zero_point = ctx.saved_tensors
        return ctx.kernel.gradient(saved, grad, scale, zero_point, ctx.layout), None, None, None
