"""The GPU path on fake CUDA tensors, proven on a CPU without a driver: every zoo model, lifted and
quantized, runs forward on a fake cuda:0 (shapes and dtypes only), and a unit's tuning steps run there
with torch's Adam, as a GPU run takes them. Where a step would mix a CPU tensor into the device's work,
read a device value, or make a shape from values, it fails here. ROCm builds are checked through a
spoofed torch.version.hip: device names and the hipBLAS workspace setting."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np
import onnx
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from finetune.config import FastFinetune
from finetune.lift import lift_model
from finetune.recon.audit import refuse_nondeterministic
from finetune.recon.data.cache import ActivationCache
from finetune.recon.device import WORKSPACE_VARIABLES, deterministic, device_name
from finetune.recon.optimisation import Optimisation

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)
from .test_gpu_path import CASES, META, ZOO, Stand, digits, meta_steps, unit_works, zoo_model  # noqa: F401  (digits: a fixture)

CUDA = torch.device("cuda", 0)


# Stand-ins for the host ops that ask the driver: pinning host memory for a copy to the device (a fake
# copy reads no bytes, so unpinned memory does as well).
DRIVER_HOST_OPS: dict[Any, Callable[..., Any]] = {torch.ops.aten.is_pinned.default: lambda tensor, *_: False,
                                                  torch.ops.aten._pin_memory.default: lambda tensor, *_: tensor}


class _HostOpsRunForReal(TorchDispatchMode):
    """Entered above a FakeTensorMode: an op on a fake tensor, or one making a tensor on a CUDA device,
    goes on to the fake mode; any other op (host tensors alone, such as the shape arithmetic the lifted
    models compute on the CPU and then read) runs for real, as on a GPU machine, but those that would
    ask the driver (DRIVER_HOST_OPS)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in DRIVER_HOST_OPS:
            return DRIVER_HOST_OPS[func](*args, **kwargs)
        if any(isinstance(leaf, FakeTensor) or (isinstance(leaf, torch.device) and leaf.type == "cuda")
               for leaf in tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            return func(*args, **kwargs)


class _HostGenerator(torch.Generator):
    """A torch.Generator asked for on a CUDA device, made on the CPU: without a driver none can be made
    there, and fake tensors draw no values anyway."""

    def __new__(cls, device: Any = "cpu") -> Self:
        return super().__new__(cls, "cpu")


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Inside the block tensors on cuda:0 are fake (they carry device, shape and dtype, no values) and
    host tensors are real. A fake op raises where a GPU would fail or wait: a non-scalar CPU tensor
    mixed with a CUDA one, a read of a device value (`.item()`, `bool(t)`), a shape made from values
    (a boolean-mask index, `nonzero`)."""
    with pytest.MonkeyPatch.context() as patch, FakeTensorMode(allow_non_fake_inputs=True), _HostOpsRunForReal():
        patch.setattr(torch, "Generator", _HostGenerator)
        yield


def graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a loss's gradient would reach (its autograd graph's leaves), in no set order."""
    leaves, seen, nodes = [], set(), [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        nodes.extend(following for following, _ in node.next_functions)
    return leaves


@dataclass
class FakeCudaStand(Stand):
    """The Fabric stand-in on fake cuda:0. Backward needs a driver, so it gives every tensor the loss
    reaches a gradient of ones (device and shape are what fake tensors check); the leaves are noted."""

    device: torch.device = CUDA

    def __post_init__(self) -> None:
        self.reached: list[torch.Tensor] = []

    def backward(self, loss: torch.Tensor, model: Any = None) -> None:
        for leaf in graph_leaves(loss):
            leaf.grad = torch.ones_like(leaf)
            self.reached.append(leaf)


@pytest.fixture(scope="module")
def zoo_models(digits: dict) -> Callable[[str], tuple[Path, np.ndarray, onnx.ModelProto]]:  # noqa: F811  (digits: the fixture)
    """Each zoo model's file, a few real inputs and the model quantized at MX4 (tests/test_gpu_path.py's,
    made once a test run)."""
    return functools.partial(zoo_model, digits)


def fake_cuda_forward(module: torch.nn.Module, x: np.ndarray) -> tuple[torch.Tensor, ...]:
    """The module's outputs for x with the module and x on fake cuda:0; every parameter and buffer is there."""
    with fake_cuda():
        placed = module.to(CUDA)
        assert all(t.device == CUDA for t in [*placed.parameters(), *placed.buffers()])
        outputs = placed(torch.from_numpy(x).to(CUDA))
    return outputs if isinstance(outputs, tuple) else (outputs,)


# PP-OCR's two models quantized take 5-8 s of CPU each on fake tensors (about 13,500 fake ops for the angle
# classifier, most of them the MX4 kernels' of 54 layers of distinct shapes, which fake tensors cannot cache).
SLOW = {("text angle classifier", "quantized"), ("text recognizer", "quantized")}


@pytest.mark.parametrize(("name", "form"), [pytest.param(name, form, marks=[pytest.mark.slow] if (name, form) in SLOW else [])
                                            for name in ZOO for form in ("lifted", "quantized")])
def test_zoo_models_run_forward_on_fake_cuda(zoo_models: Callable, name: str, form: str) -> None:
    """Every zoo model runs forward on fake cuda:0, float as lifted and quantized at MX4: no CPU tensor
    mixed into the device's work, no read of a device value, no shape made from values; each output is
    on cuda:0 with the shape and dtype the same module gives on the CPU."""
    path, x, quantized = zoo_models(name)
    module = lift_model(path if form == "lifted" else quantized)
    with torch.no_grad():
        on_cpu = module(torch.from_numpy(x))
    expected = [(o.shape, o.dtype) for o in (on_cpu if isinstance(on_cpu, tuple) else (on_cpu,))]
    outputs = fake_cuda_forward(module, x)
    assert all(isinstance(o, FakeTensor) and o.device == CUDA for o in outputs)
    assert [(o.shape, o.dtype) for o in outputs] == expected


class _Seeded(torch.nn.Module):
    """A lifted model followed by one line of code a GPU run would fail on."""

    def __init__(self, lifted: torch.nn.Module, bug: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lifted, self.bug = lifted, bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bug(self.lifted(x))


SEEDED_BUGS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "a CPU tensor mixed in": (lambda logits: logits + torch.arange(10.0), "cuda:0 and cpu"),
    "a read of a device value": (lambda logits: logits * float(logits.max()), "_local_scalar_dense"),
    "a shape made from values": (lambda logits: logits[logits > 0], "nonzero"),
}


@pytest.mark.parametrize("bug", list(SEEDED_BUGS))
def test_the_fake_cuda_forward_fails_on_a_seeded_bug(zoo_models: Callable, bug: str) -> None:
    """The check fails on each bug it is for, seeded after the quantized digits CNN (whose forward alone
    passes above); a CPU scalar (0-d) mixed in passes, as CUDA allows it."""
    _, x, quantized = zoo_models("digits cnn")
    seeded, message = SEEDED_BUGS[bug]
    with pytest.raises(RuntimeError, match=message):
        fake_cuda_forward(_Seeded(lift_model(quantized), seeded), x)
    (scaled,) = fake_cuda_forward(_Seeded(lift_model(quantized), lambda logits: logits * torch.tensor(2.0)), x)
    assert scaled.device == CUDA


# Tuning steps on fake CUDA: a case of tests/test_gpu_path.py (all of which run there on the meta device)
# per unit kind and algorithm, with each unit's rows staged on the device or (budget 0) each batch gathered
# on the host and copied over.
STEP_CASES = {"cnn-adaround-layer": ("cnn-adaround-layer", 2**32), "cnn-adaround-layer-gathered": ("cnn-adaround-layer", 0),
              "cnn-adaquant-block-scales": ("cnn-adaquant-block-scales", 2**32),
              "transformer-adaquant-block-mxfp4": ("transformer-adaquant-block-mxfp4", 2**32)}


@pytest.mark.parametrize("step_case", list(STEP_CASES))
def test_tuning_steps_run_on_fake_cuda_with_torch_adam(digits: dict, step_case: str) -> None:  # noqa: F811  (the fixture)
    """Two steps of every unit on fake cuda:0 as a GPU run takes them (rows staged on the device, or
    gathered into pinned host memory and copied without blocking; QDrop's masks drawn on the device;
    torch's Adam): every tensor the loss reaches is on cuda:0, and Adam's state for every tensor it
    trains is there too."""
    case, budget = STEP_CASES[step_case]
    model, preset, settings = CASES[case]
    config = FastFinetune(**settings, bias_correction=False, validation_share=0, batch_size=8)
    stand = FakeCudaStand()
    with ActivationCache(2**30) as cache, fake_cuda():
        for work, methods in unit_works(digits[model], preset, config, digits["feeds"], cache, stand):
            optimizer = meta_steps(work, methods, config, 2, budget)
            assert type(optimizer) is torch.optim.Adam
            trained = [p for group in optimizer.param_groups for p in group["params"]]
            assert trained and all(optimizer.state[p]["exp_avg"].device == CUDA for p in trained)
    assert stand.reached and all(leaf.device == CUDA for leaf in stand.reached)


@pytest.mark.parametrize("device", ["meta", "fake cuda"])
def test_a_cpu_tensor_mixed_into_a_step_fails(digits: dict, monkeypatch: pytest.MonkeyPatch, device: str) -> None:  # noqa: F811
    """The step checks fail on the bug they are for, on the meta device (tests/test_gpu_path.py) and on
    fake CUDA: a step whose loss takes a term made on the host."""
    config = FastFinetune(algorithm="adaquant", bias_correction=False, validation_share=0, batch_size=8)
    step = Optimisation._step

    def mixing(self: Optimisation, *args: Any) -> torch.Tensor:
        return step(self, *args) + torch.zeros(1)

    monkeypatch.setattr(Optimisation, "_step", mixing)
    stand, placing = (Stand(META), contextlib.nullcontext()) if device == "meta" else (FakeCudaStand(), fake_cuda())
    with ActivationCache(2**30) as cache, placing:
        work, methods = next(unit_works(digits["cnn"], "MX4", config, digits["feeds"], cache, stand))
        with pytest.raises(RuntimeError, match=r"device cpu is not on the expected device meta|cuda:0 and cpu"):
            meta_steps(work, methods, config, 2)


WORKSPACE_NAMES = sorted({name for _, read in WORKSPACE_VARIABLES.values() for name in read})


@pytest.mark.parametrize(("hip", "users", "expected"), [
    (None, {}, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    (None, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}),
    ("6.4.0", {}, {"HIPBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    ("6.4.0", {"HIPBLAS_WORKSPACE_CONFIG": ":0:0"}, {"HIPBLAS_WORKSPACE_CONFIG": ":0:0"}),
    ("6.4.0", {"ROCBLAS_WORKSPACE_CONFIG": ":1024:4"}, {"ROCBLAS_WORKSPACE_CONFIG": ":1024:4"}),
    ("6.4.0", {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}),
], ids=["cuda", "cuda-users", "rocm", "rocm-users-hipblas", "rocm-users-rocblas", "rocm-users-cublas"])
def test_a_gpu_run_sets_its_builds_blas_workspace_and_keeps_a_users(monkeypatch: pytest.MonkeyPatch, hip: str | None,
                                                                    users: dict[str, str], expected: dict[str, str]) -> None:
    """A deterministic GPU run sets the BLAS workspace through the variable its build reads
    (HIPBLAS_WORKSPACE_CONFIG on ROCm, never CUBLAS_WORKSPACE_CONFIG there, which torch reads first and
    which would hide the user's), and leaves alone a value the user set in any of them."""
    monkeypatch.setattr(torch.version, "hip", hip)
    for name in WORKSPACE_NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in users.items():
        monkeypatch.setenv(name, value)
    with deterministic(0, True, False, CUDA):
        assert {name: os.environ[name] for name in WORKSPACE_NAMES if name in os.environ} == expected


def test_a_rocm_run_names_its_devices_hip(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On a ROCm build (spoofed) the devices torch calls cuda:N are named hip:N where users read them (the
    report's device is `device_name`'s, and so is an op's without a deterministic kernel), and the audit's
    messages name the platform ROCm."""
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert [device_name(torch.device("cuda", 1)), device_name(torch.device("cuda")), device_name(torch.device("cpu"))] == \
        ["hip:1", "hip:0", "cpu"]
    with (pytest.raises(ValueError, match=r"^upsample_bilinear2d_backward_out_cuda has no deterministic kernel on hip:0: set"),
          deterministic(0, True, False, CUDA)):
        raise RuntimeError("upsample_bilinear2d_backward_out_cuda does not have a deterministic implementation, but you set "
                           "'torch.use_deterministic_algorithms(True)'")
    found = {"/block": ["linear Resize's gradient (bilinear)"]}
    with pytest.raises(ValueError, match=r"which has no deterministic ROCm kernel"):
        refuse_nondeterministic(found, CUDA, True, None)
    with caplog.at_level("INFO", logger="finetune.recon.audit"):
        refuse_nondeterministic(found, torch.device("cpu"), True, None)
    assert "on ROCm with deterministic: true this run would stop: /block" in caplog.text
    monkeypatch.setattr(torch.version, "hip", None)
    assert device_name(torch.device("cuda", 1)) == "cuda:1"
