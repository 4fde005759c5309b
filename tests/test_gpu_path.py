"""The GPU path proven on the CPU: tuning steps run on the meta device, which takes the branches a GPU
takes (anything but the CPU) and raises on every read of a device value (`.item()`, `bool(t)`,
`.tolist()`, `.cpu()`, a boolean-mask index), so a step that would make the host wait for a GPU fails
here (every algorithm and unit kind on the zoo's digits models, with the methods that join them); and
ops without a deterministic CUDA kernel are found on the CPU before any work."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from finetune.config import STEP_GROUP, FastFinetune
from finetune.lift import lift_model
from finetune.notices import Warnings
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.recon import audit
from finetune.recon.audit import nondeterministic_on_cuda, refuse_nondeterministic
from finetune.recon.data.batches import Draw
from finetune.recon.data.cache import ActivationCache
from finetune.recon.data.losses import Loss
from finetune.recon.data.rows import unit_data
from finetune.recon.data.streams import FloatStream, QuantizedStream, cache_inputs
from finetune.recon.methods import UnitWork, run_methods
from finetune.recon.optimisation import Optimisation
from finetune.recon.units import cut, find_units
from finetune import zoo
from finetune.zoo import digits_split, export_onnx, train_digits_cnn, train_digits_transformer

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)

META = torch.device("meta")


@dataclass
class Stand:
    """What the tuning code asks of Lightning's Fabric, on one device of any kind (one process)."""

    device: torch.device
    world_size: int = 1
    global_rank: int = 0

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def setup_optimizers(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def backward(self, loss: torch.Tensor, model: Any = None) -> None:
        loss.backward()

    def call(self, *_: Any, **__: Any) -> None:
        """No callback listens here."""


# (model, preset, settings): every algorithm that runs steps, layer and block units, and the methods that join them.
CASES = {
    "cnn-adaround-layer": ("cnn", "XINT8", {"algorithm": "adaround"}),
    "cnn-adaround-block": ("cnn", "XINT8", {"algorithm": "adaround", "unit": "block"}),
    "cnn-adaquant-layer-mx4": ("cnn", "MX4", {"algorithm": "adaquant", "adaquant": {"update_bias": True}}),
    "cnn-adaquant-block-equalization": ("cnn", "MX4", {"algorithm": "adaquant", "unit": "block",
                                                       "adaquant": {"learn_equalization": True}}),
    "cnn-adaquant-block-scales": ("cnn", "A8W8", {"algorithm": "adaquant", "unit": "block",
                                                  "adaquant": {"learn_scales": "all"}}),
    "transformer-adaquant-block-mxfp4": ("transformer", "MXFP4", {"algorithm": "adaquant", "unit": "block"}),
    "transformer-adaround-layer": ("transformer", "XINT8", {"algorithm": "adaround"}),
}


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The zoo's digits CNN and transformer as ONNX, and three calibration batches (made once a test
    run, in its base temporary folder, for this module and tests/test_gpu_fake.py)."""
    return _digits_models(tmp_path_factory.getbasetemp())


@functools.cache
def _digits_models(base: Path) -> dict[str, Any]:
    """The digits fixture's files and batches, under `base`."""
    x, _, _, _ = digits_split()
    folder = base / "gpu-path-digits"
    folder.mkdir()
    return {"cnn": export_onnx(train_digits_cnn(), x[:2], folder / "cnn.onnx"),
            "transformer": export_onnx(train_digits_transformer(), x[:2], folder / "transformer.onnx"),
            "feeds": [{"x": x[i: i + 16].numpy()} for i in range(0, 48, 16)]}


QUANTIZED: dict[tuple[Path, str, str], onnx.ModelProto] = {}  # quantized_model's results, by model, preset and calibration


def quantized_model(path: Path, preset: str, feeds: list[dict[str, np.ndarray]]) -> onnx.ModelProto:
    """The model at `path` quantized with `preset` on `feeds`, made once a test run for both GPU-path
    modules (many cases share a model, preset and calibration; nothing here edits the result)."""
    digest = hashlib.sha256()
    for feed in feeds:
        for name, array in sorted(feed.items()):
            digest.update(f"{name}{array.dtype}{array.shape}".encode() + array.tobytes())
    key = (path, preset, digest.hexdigest())
    if key not in QUANTIZED:
        QUANTIZED[key] = quantize_model(path, preset, feeds).model
    return QUANTIZED[key]


def unit_works(path: Path, preset: str, config: FastFinetune, feeds: list[dict[str, np.ndarray]],
               cache: ActivationCache, stand: Stand | None = None) -> Iterator[tuple[UnitWork, list[Any]]]:
    """Each unit of the quantized model in turn, with the run's methods (which prepared the units): its
    data measured on the CPU as a run caches it, its module a copy of the lifted model on the stand's
    device, the meta device unless told (yielded while the streams still hold the unit's values)."""
    stand = stand or Stand(META)
    quantized = quantized_model(path, preset, feeds)
    module, placed = lift_model(quantized), lift_model(quantized).to(stand.device)
    units = find_units(module, config.op_types, False, config.unit)
    methods = run_methods(config)
    for method in methods:
        units = method.prepare(module, units, Warnings())
    cpu, inputs, plan, placed_plan = Stand(torch.device("cpu")), cache_inputs(feeds, ["x"], cache), cut(module, units), cut(placed, units)
    floats = FloatStream(module, units, inputs, cache, cpu.device, quantizers_off=True)
    stream = QuantizedStream(plan, ["x"], inputs, cache, cpu.device)

    def unread() -> Loss:
        raise AssertionError("a step measured the unit's loss")

    for k, unit in enumerate(units):
        float_inputs, targets = floats.advance(k)
        data = unit_data(placed_plan.train[k], unit.input_axis, unit.output_axes, stream.before(k, unit), float_inputs,
                         targets, list(zip(unit.side_inputs, stream.side_inputs(unit))), cpu)
        yield UnitWork(k, unit, units, placed, data, stand, frozenset(), frozenset(), Warnings(), {}, unread,
                       Loss(1.0, None, 1.0), True), methods
        stream.after(k)


def meta_steps(work: UnitWork, methods: list[Any], config: FastFinetune, steps: int,
               device_budget: int = 2**32) -> torch.optim.Optimizer:
    """`steps` of the unit's optimisation on its device (the meta device unless told), its rows staged
    there within `device_budget` bytes, its methods' parts installed (their exits, which write what was
    learned once per unit, are not steps: the throwaway module keeps them); returns the Adam that
    stepped, as a GPU run takes it."""
    optimisation = Optimisation(work, methods, Draw.of(config), device_budget, None)
    batches = optimisation._batches()
    parts = [part for method in methods if (part := method.part(work, batches, steps)) is not None]
    optimizer = torch.optim.Adam([group for part in parts for group in part.groups], lr=1e-3)
    installed = contextlib.ExitStack()
    for part in parts:
        installed.enter_context(part)
    assert optimisation._steps(work.data.train, optimizer, batches, parts, steps, None) == steps
    return optimizer


@pytest.mark.parametrize("case", list(CASES))
def test_tuning_steps_run_on_the_meta_device_without_reading_it(digits: dict, case: str) -> None:
    """A group of steps (the host reads nothing between its readings of a group's losses) of every unit
    runs on the meta device: no read of a device value, no CPU tensor mixed into the step, no shape that
    depends on a value."""
    model, preset, settings = CASES[case]
    config = FastFinetune(**settings, bias_correction=False, validation_share=0, batch_size=8)
    with ActivationCache(2**30) as cache:
        for work, methods in unit_works(digits[model], preset, config, digits["feeds"], cache):
            meta_steps(work, methods, config, STEP_GROUP)


def test_a_read_in_a_step_fails_on_the_meta_device(digits: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check fails on the bug it is for: a step that reads its loss (a synchronisation per step on a GPU)."""
    config = FastFinetune(algorithm="adaquant", bias_correction=False, validation_share=0, batch_size=8)
    step = Optimisation._step

    def reading(self: Optimisation, *args: Any) -> torch.Tensor:
        loss = step(self, *args)
        float(loss)
        return loss

    monkeypatch.setattr(Optimisation, "_step", reading)
    with ActivationCache(2**30) as cache:
        work, methods = next(unit_works(digits["cnn"], "MX4", config, digits["feeds"], cache))
        with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
            meta_steps(work, methods, config, 2)


class Upsampling(torch.nn.Module):
    """Two convolutions with a bilinear upsampling and a reflection padding between them, in one scope
    (one block unit), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(),
                                         torch.nn.Upsample(scale_factor=2, mode="bilinear"), torch.nn.ReflectionPad2d(1),
                                         torch.nn.Conv2d(4, 4, 3))
        self.head = torch.nn.Linear(4 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).flatten(1))


def test_ops_without_a_deterministic_cuda_kernel_are_found_before_any_work(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                           digits: dict) -> None:
    """A block whose step differentiates a bilinear Resize and a reflect Pad is named with both (on CUDA
    under deterministic: true torch would raise from inside its backward, after the earlier units were
    tuned); a CPU run tunes and says so at INFO; the digits CNN's steps have none."""
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((12, 1, 8, 8), np.float32))
    path = export_onnx(Upsampling().eval(), x[:2], tmp_path / "up.onnx")
    feeds = [{"x": x[i: i + 4].numpy()} for i in range(0, 12, 4)]
    quantized = quantize_model(path, "XINT8", feeds).model
    module = lift_model(quantized)
    units = find_units(module, ("Conv", "Gemm"), unit="block")
    found = nondeterministic_on_cuda(module, units, cut(module, units), [torch.from_numpy(feeds[0]["x"])])
    assert found == {"/block/block": ["linear Resize's gradient (bilinear)", "reflect Pad's gradient"]}
    assert all(p.grad is None for p in module.parameters())
    with caplog.at_level(logging.INFO, logger="finetune.recon.audit"):
        finetune_model(quantized, feeds, FastFinetune(iterations=2, unit="block"))
    assert "on CUDA with deterministic: true this run would stop: /block/block: linear Resize's gradient" in caplog.text
    assert nondeterministic_on_cuda(module, units, cut(module, units), [torch.from_numpy(feeds[0]["x"])], backward=False) == {}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune.recon.audit"):  # GPTQ differentiates nothing: nothing to say
        finetune_model(quantized, feeds, FastFinetune(algorithm="gptq", unit="block"))
    assert "this run would stop" not in caplog.text
    cnn = lift_model(quantized_model(digits["cnn"], "XINT8", digits["feeds"]))
    cnn_units = find_units(cnn, ("Conv", "Gemm"), unit="block")
    assert nondeterministic_on_cuda(cnn, cnn_units, cut(cnn, cnn_units), [torch.from_numpy(digits["feeds"][0]["x"])]) == {}


def test_the_audit_holds_one_units_gradients_at_a_time(digits: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each unit's step starts with no gradient left by the units before it (all of them at once were
    a copy of every weight)."""
    cnn = lift_model(quantize_model(digits["cnn"], "XINT8", digits["feeds"]).model)
    units = find_units(cnn, ("Conv", "Gemm"))
    left: list[int] = []
    step = audit._step_ops

    def recording(train: torch.nn.Module, inputs: list[torch.Tensor], backward: bool) -> set[str]:
        left.append(sum(p.grad is not None for p in cnn.parameters()))
        return step(train, inputs, backward)

    monkeypatch.setattr(audit, "_step_ops", recording)
    nondeterministic_on_cuda(cnn, units, cut(cnn, units), [torch.from_numpy(digits["feeds"][0]["x"])])
    assert len(left) == len(units) > 1 and left == [0] * len(units)
    assert all(p.grad is None for p in cnn.parameters())


def test_a_cuda_run_under_deterministic_stops_at_once_or_warns() -> None:
    found = {"/block": ["linear Resize's gradient (bilinear)"], "/other": ["reflect Pad's gradient"]}
    with pytest.raises(ValueError, match=r"^unit /block runs linear Resize's gradient \(bilinear\), which has no "
                                         r"deterministic CUDA kernel \(2 unit\(s\) in all\): set fast_finetune.deterministic: warn"):
        refuse_nondeterministic(found, torch.device("cuda", 0), True, None)
    warned = Warnings()
    refuse_nondeterministic(found, torch.device("cuda", 0), "warn", warned.add)
    assert [w["unit"] for w in warned] == ["/block", "/other"]
    refuse_nondeterministic(found, torch.device("cpu"), True, None)  # the CPU has deterministic kernels for them


ZOO = ["digits cnn", "digits transformer", "magika", "text angle classifier", "text recognizer"]


@functools.cache
def _zoo_inputs(name: str) -> tuple[Path, np.ndarray]:
    """A registry model of the zoo and a few real inputs for it (made once a test run: drawing them takes a second)."""
    if name == "magika":
        return zoo.magika_onnx_path(), zoo.magika_samples(2)[0][:4]
    if name == "text angle classifier":
        return zoo.text_angle_classifier_onnx_path(), zoo.text_angle_lines(4)
    return zoo.text_recognizer_onnx_path(), zoo.text_lines(2)


def zoo_model(digits: dict, name: str) -> tuple[Path, np.ndarray, onnx.ModelProto]:
    """A zoo model's file, a few real inputs and the model quantized at MX4 on them."""
    path, x = (digits[name.split()[1]], digits["feeds"][0]["x"]) if name.startswith("digits") else _zoo_inputs(name)
    input_name = onnx.load(str(path)).graph.input[0].name
    return path, x, quantized_model(path, "MX4", [{input_name: x}])


@pytest.mark.parametrize("name", ZOO)
def test_quantized_zoo_models_run_forward_on_the_meta_device(digits: dict, name: str) -> None:
    """The streams run whole segments forward on the device: every zoo model quantized at MX4 runs
    forward on the meta device, reading nothing there (magika's Expand shapes, computed from Shape,
    stay on the host). silero's voice detectors are not here: an If's condition is read on the host
    by design, once per call."""
    _, x, quantized = zoo_model(digits, name)
    module = lift_model(quantized).to(META)
    outputs = module(torch.empty(x.shape, dtype=torch.from_numpy(x).dtype, device=META))
    assert all(o.device == META for o in (outputs if isinstance(outputs, tuple) else (outputs,)))
