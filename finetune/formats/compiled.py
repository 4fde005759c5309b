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
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from . import BFPSpec, FloatSpec, FormatSpec, IntSpec, MXSpec, format_values, int_quantize_dequantize, quantize_dequantize
from .bfp import ordinary_input as bfp_ordinary_input
from .bits import assume_ordinary, straight_through
from .blocks import block_axis
from .mx import ordinary_input as mx_ordinary_input
from .packed import all_groups, group_size, pack_mask, unpack_mask

logger = logging.getLogger(__name__)

CompileSetting = Literal["auto", True, False]

# What stays eager, and why: the names the fine-tuning report lists (see eager_reason).
EAGER_FORMATS: dict[str, str] = {
    "INT with a rounding hook": "AdaRound's soft rounding is a learned function whose gradient reaches its rounding "
                                "variables; the kernels' straight-through gradient does not carry it",
    "a learned scale": "its gradient reaches the scale, which the kernels' straight-through gradient does not carry",
}

# Inductor settings every kernel needs for eager's bits: a cast to a narrower float and back rounds
# (by default inductor drops the pair, and with it the rounding of BF16, FP16, FP8 and the bfloat16
# pre-rounding of BFP).
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}

# Tensors smaller than this stay eager in a run (FakeQuantize): there a compiled call's fixed cost
# (guards, the autograd function, the kernel lookup: some 20-30 us) outweighs its gain. Measured on
# 2 shared cores, forward + backward, one thread: INT8 per tensor 159 vs 134 us eager at 6272
# elements, 539 vs 664 us at 100352; digits-CNN tuning steps (tensors of at most 16384 elements)
# took 5.7 ms compiled against 5.0 ms eager at MX4, 2.2 against 2.1 ms at XINT8.
MIN_COMPILED_ELEMENTS = 1 << 16

# A kernel is compiled for a new shape only where the run's calls can pay for the compile: elements x
# calls ahead (a unit's iterations) at least this. A cold compile of a block format's kernels took 7.5-8 s
# per shape, and saved 6-17 ns per element and call (MX4, BFP16, forward + backward at 0.6M and 6.4M
# elements, one thread on 2 loaded cores); at 8 s and 8 ns that is 1e9. PP-OCR's angle classifier
# (54 layers of distinct shapes up to 0.6M elements at batch 16) otherwise spent 6 of its 6.3 minutes
# of a 20-iteration run compiling. A kernel compiled earlier in the process is used whatever the size.
PAYBACK_ELEMENT_CALLS = 10**9

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
    used: set[_Key] = field(default_factory=set)
    over_limit: int = 0
    not_worth: set[_Key] = field(default_factory=set)

    def summary(self) -> dict[str, Any]:
        """The report's entry."""
        return {"compiled": self.compiled, "eager_formats": dict(self.eager_formats), "kernels": len(self.used),
                "kernels_over_limit": self.over_limit, "shapes_left_eager_as_too_few_calls": len(self.not_worth)}


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
        y, passes = format_values(xf.detach(), spec, scale, zero_point, with_mask=xf.requires_grad)
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


@dataclass(frozen=True)
class _Key:
    """What one compiled kernel serves: a format on inputs of one shape and layout (batch axis None
    where it is dynamic), on one device, with scale and zero point of given shapes (None: absent)."""

    spec: FormatSpec
    shape: tuple[int | None, ...]
    stride: tuple[int, ...]
    device: torch.device
    scale: tuple[int, ...] | None
    zero_point: tuple[int, ...] | None


class _Kernel:
    """One format's compiled kernels on inputs of one shape: the forward of a training step (x,
    scale, zero point -> y and what its gradient needs) and the straight-through gradient. INT and
    float formats compile their values alone, keep x and recompute the mask from it (a saved
    boolean mask costs more: inductor stores booleans slowly on the CPU). Block formats write their
    mask packed to a bit per element in the forward's pass (packed.py); on the CPU they first run a
    kernel without the rare-case fixes and check in the same pass that x needed none (nearly always
    so), running the general kernel only where it did. Each kernel has its own code object, because
    dynamo keeps compiled graphs per code object and stops compiling one past its recompile limit."""

    def __init__(self, key: _Key, number: int) -> None:
        spec = key.spec
        self.dynamic_batch = key.shape[:1] == (None,)
        self.blocked = isinstance(spec, (BFPSpec, MXSpec))
        self.speculates = self.blocked and key.device.type == "cpu"
        group = group_size(spec.block_size) if isinstance(spec, (BFPSpec, MXSpec)) else 0

        def values(x: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
            return (format_values(x, spec, scale, zero_point, with_mask=False)[0],)

        def forward(x: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
            y, passes = format_values(x, spec, scale, zero_point, with_mask=True)
            return y, None if passes is None else pack_mask(passes, block_axis(x, spec.axis), group)

        def gradient(saved: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor | None,
                     zero_point: torch.Tensor | None) -> torch.Tensor:
            if self.blocked:
                passes = unpack_mask(saved, grad.shape, block_axis(grad, spec.axis), group)
            else:
                passes = format_values(saved, spec, scale, zero_point, with_mask=True)[1]
            return grad if passes is None else torch.where(passes, grad, 0.0)

        def checked(fn: Callable[..., tuple[torch.Tensor | None, ...]]) -> Callable[..., tuple[torch.Tensor | None, ...]]:
            def run(x: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
                return *fn(x, scale, zero_point), all_groups(_ordinary_input(x, spec), block_axis(x, spec.axis), group)
            return run

        def compiled(fn: types.FunctionType, name: str) -> Callable[..., Any]:
            return torch.compile(_own_code(fn, f"qdq_{name}_{number}"), dynamic=False, options=INDUCTOR_OPTIONS)

        self._gradient = compiled(gradient, "gradient")
        if self.blocked:
            self._forward = compiled(forward, "forward")
        else:
            self._values = compiled(values, "values")
        if self.speculates:
            self._ordinary_forward = compiled(checked(forward), "ordinary_forward")

    def values(self, x: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> torch.Tensor:
        """The quantized values of float32 x (no autograd). A block format runs its forward, whose
        packed mask costs little, rather than compile a kernel more."""
        if self.blocked:
            return self.forward(x, scale, zero_point)[0]
        return self._values(self._batch_dynamic(x), scale, zero_point)[0]

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None,
                zero_point: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The quantized values of float32 x and what `gradient` takes for it: x itself, or for a
        block format its packed mask."""
        x = self._batch_dynamic(x)
        if not self.blocked:
            return self._values(x, scale, zero_point)[0], x
        if self.speculates:
            return self._speculate(self._ordinary_forward, self._forward, x, scale, zero_point)
        return self._forward(x, scale, zero_point)

    def gradient(self, saved: torch.Tensor | None, grad: torch.Tensor, scale: torch.Tensor | None,
                 zero_point: torch.Tensor | None, layout: torch.memory_format) -> torch.Tensor:
        """The straight-through gradient for the incoming `grad`, from what `forward` returned."""
        if saved is None:
            return grad
        grad = self._batch_dynamic(grad.contiguous(memory_format=layout))
        return self._gradient(self._batch_dynamic(saved), grad, scale, zero_point)

    @staticmethod
    def _speculate(ordinary: Callable[..., Any], general: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
        """The ordinary kernel's results where its check found x ordinary, else the general one's."""
        with assume_ordinary():
            *results, is_ordinary = ordinary(*args)
        return tuple(results) if bool(is_ordinary) else general(*args)

    def _batch_dynamic(self, t: torch.Tensor) -> torch.Tensor:
        """t with its batch axis marked dynamic where the kernel's is, so batches of any size share a graph."""
        if self.dynamic_batch:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return t


def _ordinary_input(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Where the block format `spec` takes its ordinary path on x, element-wise (see the formats' ordinary_input)."""
    return bfp_ordinary_input(x, spec) if isinstance(spec, BFPSpec) else mx_ordinary_input(x, spec)


def _layout(x: torch.Tensor) -> torch.memory_format:
    """x's memory format (channels last or contiguous), for the incoming gradient to match it."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _own_code(fn: types.FunctionType, name: str) -> types.FunctionType:
    """fn with a code object of its own, named `name` (dynamo's logs show it)."""
    return types.FunctionType(fn.__code__.replace(co_name=name, co_qualname=name), fn.__globals__, name,
                              fn.__defaults__, fn.__closure__)


_kernels: dict[_Key, _Kernel] = {}


def _kernel(spec: FormatSpec, x: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> _Kernel | None:
    """The compiled kernel for these inputs, made on first use; None where the run's calls would not
    pay for compiling it, and past MAX_KERNELS."""
    key = _Key(spec, _shape_key(spec, x), x.stride(), x.device, _shape(scale), _shape(zero_point))
    kernel = _kernels.get(key)
    if kernel is None:
        if _use is not None and _use.calls_ahead is not None and x.numel() * _use.calls_ahead < PAYBACK_ELEMENT_CALLS:
            _use.not_worth.add(key)
            return None
        if len(_kernels) >= MAX_KERNELS:
            if _use is not None:
                _use.over_limit += 1
            return None
        kernel = _kernels[key] = _Kernel(key, len(_kernels))
    if _use is not None:
        _use.used.add(key)
    return kernel


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
    def forward(ctx: Any, x: torch.Tensor, kernel: _Kernel, scale: torch.Tensor | None,
                zero_point: torch.Tensor | None) -> torch.Tensor:
        y, saved = kernel.forward(x.detach(), scale, zero_point)
        ctx.kernel, ctx.layout = kernel, _layout(x)
        ctx.save_for_backward(saved, scale, zero_point)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, scale, zero_point = ctx.saved_tensors
        return ctx.kernel.gradient(saved, grad, scale, zero_point, ctx.layout), None, None, None
