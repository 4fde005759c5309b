"""The Triton code inductor writes for the compiled quantize-dequantize kernels (formats.kernels) on a
CUDA or ROCm GPU, generated and compiled on a machine without one, and the properties that code must
have for a GPU run to give the bits the CPU checks (tests/test_formats_compiled.py): every narrow-float
round trip of the traced graph kept, IEEE division, no fused multiply-add, no flushed subnormals, no
atomics, deterministic mode recorded.

How it runs without a GPU: the kernels are traced on fake CUDA tensors (FakeTensorMode); torch's
device queries answer with a stand-in of the target's properties, and Triton's backend is made from
the target rather than from a driver; inductor's constant folding, which evaluates constant
sub-graphs on the real device, evaluates them on the CPU instead; the generated wrapper is recorded
rather than compiled and its call runs the graph on the fake tensors. Dynamo and AOTAutograd trace
once for all targets, and inductor lowers the traced graphs for each target in turn (about a fifth
of the tracing saved; the code is the one a trace of each target's own gives). Each kernel's source is then
compiled by inductor's own ahead-of-time path (the one its compile workers take, which skips the
driver) to an sm_90 cubin or a gfx942 hsaco. For ROCm, torch.version.hip is set too, so inductor
writes its HIP flavour of the code (ROCm's DeviceProperties, pointer-range hints)."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from finetune.formats import BFPSpec, FormatSpec, MXSpec
from finetune.formats.compiled import kernel_key
from finetune.formats.kernels import Kernel


@dataclass(frozen=True)
class Target:
    """A GPU the kernels are generated and compiled for, as inductor and Triton see it."""

    name: str
    backend: str  # Triton's: "cuda" or "hip"
    arch: int | str  # compute capability, or the gfx name
    warp_size: int
    multi_processors: int


SM_90 = Target("sm_90", "cuda", 90, 32, 132)  # H100
GFX942 = Target("gfx942", "hip", "gfx942", 64, 304)  # MI300X
TARGETS = (SM_90, GFX942)
HIP_VERSION = "7.0"  # what torch.version.hip reads while code is made for a ROCm target

# Triton's names of the narrow float types the formats round through.
TRITON_TYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8e4nv",
                torch.float8_e5m2: "float8e5"}
# PTX's conversion to each narrow type, round to nearest even: the cast that must survive LLVM and ptxas.
PTX_ROUNDING = {torch.bfloat16: "cvt.rn.bf16", torch.float16: "cvt.rn.f16", torch.float8_e4m3fn: "e4m3x2.f32",
                torch.float8_e5m2: "e5m2x2.f32"}
# PTX instructions whose bits differ from eager CUDA's: approximate division and functions, subnormals
# flushed to zero, a multiply-add fused into one rounding.
PTX_INEXACT = re.compile(r"\b(?:div\.full|div\.approx|rcp\.approx|sqrt\.approx|ex2\.approx|lg2\.approx)|\.ftz\b|\bfma\.")
ATOMICS = {"cuda": re.compile(r"\b(?:atom|red)\.[a-z]"), "hip": re.compile(r"_atomic")}
FAST_MATH_FLAGS = re.compile(r"\b(?:fdiv|fmul|fadd|fsub) (?:[a-z]+ )*(?:fast|afn|arcp|contract|reassoc)\b")


@dataclass
class GraphCode:
    """One compiled function of a kernel (values, forward or gradient): the narrow float types its
    traced graph rounds through, and the Triton kernels (name -> source) inductor wrote for it."""

    function: str  # "values", "forward" or "gradient"
    narrow_types: set[torch.dtype]
    kernels: dict[str, str] = field(default_factory=dict)


def generated_code(spec: FormatSpec, shape: tuple[int, ...], scale: torch.Tensor | None,
                   zero_point: torch.Tensor | None, targets: tuple[Target, ...]) -> dict[Target, list[GraphCode]]:
    """The Triton code, on each of `targets`, of the compiled kernels that serve float32 inputs of
    `shape`: the forward (values for INT and float formats) and the straight-through gradient, traced
    as a GPU run traces them (formats.kernels.Kernel, its INDUCTOR_OPTIONS included). Dynamo and
    AOTAutograd trace once, for the first target; inductor lowers each traced graph for every target."""
    blocked = isinstance(spec, (BFPSpec, MXSpec))
    with _stand_in(targets) as graphs, torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        x, grad = torch.empty(shape, device="cuda:0"), torch.empty(shape, device="cuda:0")
        if not blocked:  # as formats.compiled passes them: tensors, not constants inductor would fold
            scale = torch.ones(()) if scale is None else scale
            zero_point = torch.zeros(()) if zero_point is None else zero_point
        scale, zero_point = (None if t is None else t.to("cuda:0") for t in (scale, zero_point))
        kernel = Kernel(kernel_key(spec, x, scale, zero_point), 0, lambda warm, seconds: None)
        _, saved = kernel.forward(x, scale, zero_point)
        _label(graphs, "forward" if blocked else "values")
        kernel.gradient(saved, grad, scale, zero_point, torch.contiguous_format)
        _label(graphs, "gradient")
    return graphs


def _label(graphs: dict[Target, list[GraphCode]], function: str) -> None:
    """Name the kernel function of the graphs recorded since the last call."""
    for graph in (graph for target_graphs in graphs.values() for graph in target_graphs):
        graph.function = graph.function or function


def compiled_binaries(name: str, source: str, target: Target) -> list[Any]:
    """Triton's compiled kernels (one per launch configuration inductor may pick) of one generated
    kernel, for `target`, through inductor's ahead-of-time compile (its compile workers' path)."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime import triton_helpers

    with ExitStack() as stack:
        stack.enter_context(triton_helpers.skip_gpu_driver_setup())
        stack.enter_context(torch._inductor.config.patch(use_static_cuda_launcher=False))
        if target.backend == "hip":
            stack.enter_context(mock.patch("torch.version.hip", HIP_VERSION))
        autotuner = getattr(PyCodeCache.load(source), name)
        autotuner.precompile(warm_cache_only=True)
        return [result.kernel for result in autotuner.compile_results]


def code_problems(graph: GraphCode, target: Target) -> list[str]:
    """What in one compiled function's generated and compiled code would break eager's bits or
    determinism on `target` (empty: nothing). A run compiles its kernels under torch's deterministic
    mode (recon.device.deterministic), so the code must have been generated under it too."""
    problems = []
    sources = "\n".join(graph.kernels.values())
    for dtype in sorted(graph.narrow_types, key=str):
        if not _round_trip_kept(sources, TRITON_TYPES[dtype]):
            problems.append(f"{graph.function}: the graph rounds through {dtype}, the Triton code does not")
    device_code = []
    for name, source in graph.kernels.items():
        problems += [f"{name}: {problem}" for problem in _source_problems(source)]
        for binary in compiled_binaries(name, source, target):
            problems += [f"{name} ({target.name}): {problem}" for problem in _binary_problems(binary, target)]
            device_code.append(binary.asm.get("ptx", ""))
    if target.backend == "cuda":
        problems += [f"{graph.function}: no {PTX_ROUNDING[dtype]} rounding in the PTX" for dtype in sorted(graph.narrow_types, key=str)
                     if not any(PTX_ROUNDING[dtype] in ptx for ptx in device_code)]
    return problems


def _round_trip_kept(source: str, triton_type: str) -> bool:
    """Whether some value is cast to `triton_type` and that result cast back to float32 in `source`."""
    narrowed = re.findall(rf"(tmp\d+) = \S+\.to\(tl\.{triton_type}\)", source)
    return any(re.search(rf"= {name}\.to\(tl\.float32\)", source) for name in narrowed)


def _source_problems(source: str) -> list[str]:
    """The generated source's own flags: fused multiply-add off (emulate_precision_casts), no atomics,
    deterministic mode recorded (a run sets it)."""
    problems = []
    if "'enable_fp_fusion': False" not in source:
        problems.append("Triton may fuse a multiply and an add (enable_fp_fusion is not False)")
    if "tl.atomic" in source or "'atomic_add_found': False" not in source:
        problems.append("uses atomics, whose order (and so a float sum's bits) varies from run to run")
    if "'are_deterministic_algorithms_enabled': True" not in source:
        problems.append("not generated under deterministic algorithms (the kernel does not record them)")
    return problems


def _binary_problems(binary: Any, target: Target) -> list[str]:
    """The compiled kernel's: atomics; on NVIDIA inexact instructions in PTX; on AMD fast-math flags
    on LLVM's float operations."""
    device_code = binary.asm["ptx" if target.backend == "cuda" else "amdgcn"]
    problems = ["atomics in the device code"] if ATOMICS[target.backend].search(device_code) else []
    if target.backend == "cuda":
        problems += [f"inexact instruction {found!r} in the PTX" for found in sorted(set(PTX_INEXACT.findall(device_code)))]
    else:
        problems += [f"fast-math flag in {found!r} (LLVM IR)" for found in sorted(set(FAST_MATH_FLAGS.findall(binary.asm["llir"])))]
    return problems


@contextmanager
def _stand_in(targets: tuple[Target, ...]) -> Iterator[dict[Target, list[GraphCode]]]:
    """Within this block torch.compile writes code for each of `targets` without a GPU, and records
    it (the yielded lists) instead of compiling it: see the module's docstring. Dynamo and
    AOTAutograd trace as for the first target; inductor compiles each graph for the others first,
    on a copy (its passes edit the graph), then for the first."""
    from torch._inductor import compile_fx
    from torch._inductor.fx_passes import joint_graph
    from torch._inductor.graph import GraphLowering

    graphs: dict[Target, list[GraphCode]] = {target: [] for target in targets}
    current = [targets[0]]
    compile_inner = compile_fx.fx_codegen_and_compile
    fold = joint_graph.UniformValueConstantFolder._deduce_value

    def record(lowering: GraphLowering) -> _FakeModule:
        wrapper = lowering.codegen()[0].value
        kernels = dict(re.findall(r"(\w+) = async_compile\.triton\('\w+', '''(.*?)''', device_str", wrapper, re.S))
        graphs[current[-1]].append(GraphCode("", _narrow_types(lowering.module), kernels))
        return _FakeModule(lowering.module)

    def compile_for_each(graph: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        for target in targets[1:]:
            with _target_patches(target):
                current.append(target)
                compile_inner(copy.deepcopy(graph), *args, **kwargs)
                current.pop()
        return compile_inner(graph, *args, **kwargs)

    patches = [
        _target_patches(targets[0]),
        mock.patch("torch.cuda.current_device", lambda: 0),
        mock.patch("torch._inductor.scheduler.has_triton", lambda: True),
        mock.patch("torch.utils._triton.triton_hash_with_backend", torch.utils._triton.triton_hash_with_backend.__wrapped__),
        mock.patch.object(joint_graph.UniformValueConstantFolder, "_deduce_value", lambda self, node: _on_host(fold, self, node)),
        mock.patch.object(GraphLowering, "compile_to_module", record),
        mock.patch.object(compile_fx, "fx_codegen_and_compile", compile_for_each),
        torch._inductor.config.patch(force_disable_caches=True),
    ]
    with ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield graphs


@contextmanager
def _target_patches(target: Target) -> Iterator[None]:
    """Torch's device queries, inductor's device properties, Triton's backend and torch.version.hip
    answer as `target` does."""
    from torch._inductor.runtime.hints import DeviceProperties
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    properties = DeviceProperties(type=target.backend, index=0, multi_processor_count=target.multi_processors,
                                  cc=target.arch, major=9, regs_per_multiprocessor=65536,
                                  max_threads_per_multi_processor=2048, max_threads_per_block=1024,
                                  warp_size=target.warp_size)
    torch_properties = SimpleNamespace(**properties._asdict(), minor=0, name=f"stand-in {target.name}",
                                       gcnArchName=str(target.arch), total_memory=64 << 30)
    backend = make_backend(GPUTarget(target.backend, target.arch, target.warp_size))
    patches = [
        mock.patch("torch.cuda.get_device_properties", lambda *_: torch_properties),
        mock.patch("torch.cuda.get_device_capability", lambda *_: (9, 0)),
        mock.patch.object(DeviceProperties, "create", lambda _: properties),
        mock.patch("torch.utils._triton.triton_backend", lambda: backend),
        mock.patch("torch.version.hip", HIP_VERSION if target.backend == "hip" else None),
    ]
    with ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


class _FakeModule:
    """Stands for the compiled module of a recorded graph: its call runs the graph on the fake inputs."""

    def __init__(self, graph: torch.fx.GraphModule) -> None:
        self.graph = graph

    def call(self, args: list[Any]) -> Any:
        outputs = self.graph(*args)
        args.clear()
        return outputs


class _OnHost(torch.utils._python_dispatch.TorchDispatchMode):
    """Makes the tensors an op creates on a CUDA device on the CPU instead (constant folding's)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "cuda":
            kwargs["device"] = torch.device("cpu")
        return func(*args, **kwargs)


def _on_host(fold: Any, folder: Any, node: torch.fx.Node) -> Any:
    """Constant folding's value of `node`, computed on the CPU."""
    with _OnHost():
        return fold(folder, node)


def _narrow_types(graph: torch.fx.GraphModule) -> set[torch.dtype]:
    """The narrow float types the graph converts values to."""
    return {node.args[1] for node in graph.graph.nodes
            if node.target is torch.ops.prims.convert_element_type.default and node.args[1] in TRITON_TYPES}
