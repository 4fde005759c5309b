"""One format's compiled quantize-dequantize kernels on inputs of one shape (what formats.compiled
runs and caches), and the record, kept beside inductor's on-disk cache, of the kernels compiled on
this machine before: a kernel listed there compiles warm."""

from __future__ import annotations

import functools
import hashlib
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import BFPSpec, FormatSpec, MXSpec, format_values
from .bfp import ordinary_input as bfp_ordinary_input
from .bits import assume_ordinary
from .blocks import block_axis
from .mx import ordinary_input as mx_ordinary_input
from .packed import all_groups, group_size, pack_mask, unpack_mask

# Inductor settings every kernel needs for eager's bits: a cast to a narrower float and back rounds
# (by default inductor drops the pair, and with it the rounding of BF16, FP16, FP8 and the bfloat16
# pre-rounding of BFP; it also keeps Triton from fusing a multiply and an add), and on a GPU x / scale
# divides with IEEE rounding (Triton's default is PTX's approximate div.full, up to 2 ulp off eager's).
# tests/test_gpu_codegen.py checks both in the generated sm_90 and gfx942 code.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "eager_numerics.division_rounding": True}


def inductor_options(device: torch.device) -> dict[str, object]:
    """INDUCTOR_OPTIONS, and on the CPU the vector width inductor picked (AVX2 256, AVX-512 512, as
    ATEN_CPU_CAPABILITY may lower it) stated, so that it enters the key of inductor's graph cache:
    torch 2.14 leaves it out, and a cache shared by CPUs of two widths (or filled under another
    capability) hands one width's generated code to the other's compiler, which then computes garbage."""
    if device.type != "cpu":
        return INDUCTOR_OPTIONS
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {**INDUCTOR_OPTIONS, "cpp.simdlen": pick_vec_isa().bit_width()}


# Beside inductor's cache: the kernels (one digest a line) compiled there before, so a later run knows which
# compiles are warm. Cleared with the cache, which it lives in.
WARM_INDEX = "finetune-kernels.txt"

@dataclass(frozen=True)
class Key:
    """What one compiled kernel serves: a format on inputs of one shape and layout (batch axis None
    where it is dynamic), on one device, with scale and zero point of given shapes (None: absent)."""

    spec: FormatSpec
    shape: tuple[int | None, ...]
    stride: tuple[int, ...]
    device: torch.device
    scale: tuple[int, ...] | None
    zero_point: tuple[int, ...] | None


class Kernel:
    """One format's compiled kernels on inputs of one shape: the forward of a training step (x,
    scale, zero point -> y and what its gradient needs) and the straight-through gradient. INT and
    float formats compile their values alone, keep x and recompute the mask from it (a saved
    boolean mask costs more: inductor stores booleans slowly on the CPU). Block formats write their
    mask packed to a bit per element in the forward's pass (packed.py); on the CPU they first run a
    kernel without the rare-case fixes and check in the same pass that x needed none (nearly always
    so), running the general kernel only where it did. Each kernel has its own code object, because
    dynamo keeps compiled graphs per code object and stops compiling one past its recompile limit."""

    def __init__(self, key: Key, number: int, on_compile: Callable[[bool, float], None]) -> None:
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

        warm = digest(key) in warm_kernels()

        options = inductor_options(key.device)

        def compiled(fn: types.FunctionType, name: str) -> Callable[..., Any]:
            graph = torch.compile(_own_code(fn, f"qdq_{name}_{number}"), dynamic=False, options=options)
            return _TimedFirstCall(graph, lambda seconds: on_compile(warm, seconds))

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


class _TimedFirstCall:
    """A compiled callable whose first call (which compiles it) is timed and reported."""

    def __init__(self, graph: Callable[..., Any], report: Callable[[float], None]) -> None:
        self.graph, self.report, self.timed = graph, report, False

    def __call__(self, *args: Any) -> Any:
        if self.timed:
            return self.graph(*args)
        start = time.perf_counter()
        result = self.graph(*args)
        self.timed = True
        self.report(time.perf_counter() - start)
        return result


def _ordinary_input(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Where the block format `spec` takes its ordinary path on x, element-wise (see the formats' ordinary_input)."""
    return bfp_ordinary_input(x, spec) if isinstance(spec, BFPSpec) else mx_ordinary_input(x, spec)


def _own_code(fn: types.FunctionType, name: str) -> types.FunctionType:
    """fn with a code object of its own, named `name` (dynamo's logs show it)."""
    return types.FunctionType(fn.__code__.replace(co_name=name, co_qualname=name), fn.__globals__, name,
                              fn.__defaults__, fn.__closure__)


@functools.cache
def digest(key: Key) -> str:
    """A kernel's name in WARM_INDEX: its key under this torch version and its inductor options (the CPU's
    vector width among them), which inductor's cache keys hold too (made once per key: a shape left
    eager asks again at every call)."""
    options = sorted(inductor_options(key.device).items())
    return hashlib.sha256(f"{torch.__version__} {options} {key!r}".encode()).hexdigest()[:20]


@functools.cache
def warm_kernels() -> set[str]:
    """The kernels WARM_INDEX lists (read once per process; compiles add to it)."""
    try:
        return set(warm_index().read_text().split())
    except OSError:
        return set()


def warm_index() -> Path:
    """WARM_INDEX in inductor's cache folder."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / WARM_INDEX
