"""Fine-tuning models over protobuf's 2 GB, exercised on small models with the threshold lowered:
GPTQ and AdaQuant through `finetune_model`, `finetune tune` and `finetune quantize --finetune` give
the bytes the in-proto model gives, written as the model file plus one data file that onnxruntime
loads; the resume fingerprint is the in-proto run's; the report carries the peak memory."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

import finetune.lift.agreement
import finetune.onnx.io
import finetune.pipeline
import finetune.recon
import finetune.recon.api
import finetune.recon.run
from finetune.cli import main
from finetune.config import FastFinetune
from finetune.host_memory import HEAP_SLACK
from finetune.lift import LiftError, check_liftable, lift_model, unliftable_ops
from finetune.onnx.io import INLINE_TENSOR_BYTES, has_external_data, load_model, model_bytes, model_digest, save_model_atomic
from finetune.onnx.session import inference_session
from finetune.pipeline import quantize_and_finetune
from finetune.quantize import quantize_model
from finetune.recon import finetune_model

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)
from .test_external_data import LOWERED, WIDTH, assert_same, data_files, high_water_kib, lowered, snapshot, stack  # noqa: F401

SETTINGS = {"gptq": FastFinetune(algorithm="gptq", batch_size=4, validation_share=0.0),
            "adaquant": FastFinetune(algorithm="adaquant", iterations=5, batch_size=4, validation_share=0.0)}


def feeds(count: int = 2) -> list[dict[str, np.ndarray]]:
    """Seeded calibration batches of four rows."""
    rng = np.random.default_rng(3)
    return [{"x": rng.standard_normal((4, WIDTH)).astype(np.float32)} for _ in range(count)]


def pair(tmp_path: Path, model: onnx.ModelProto) -> dict[str, Path]:
    """The model written in one proto and with external data, each in a folder of its own."""
    paths = {}
    for form in ("inline", "external"):
        (tmp_path / form).mkdir()
        paths[form] = tmp_path / form / "model.onnx"
        save_model_atomic(model, paths[form], external_data=form == "external")
    return paths


def fingerprints(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The resume fingerprints of the runs to come, in order (recorded as the runs compute them)."""
    seen: list[dict[str, Any]] = []
    compute = finetune.recon.run.run_fingerprint
    monkeypatch.setattr(finetune.recon.run, "run_fingerprint", lambda *args: seen.append(compute(*args)) or seen[-1])
    return seen


def assert_pair_and_equal(paths: dict[str, Path], name: str) -> None:
    """The external run's output is the model plus one data file, the in-proto one's only where its size needs it,
    both with the same graph and tensor bytes, and onnxruntime gives equal outputs on both."""
    inline, external = (paths[form].with_name(name) for form in ("inline", "external"))
    assert has_external_data(external) and len(data_files(external)) == 1
    assert has_external_data(inline) == (model_bytes(load_model(inline)) >= LOWERED)
    assert_same(load_model(external), load_model(inline))
    x = feeds(1)[0]
    np.testing.assert_array_equal(*(inference_session(path).run(None, x)[0] for path in (inline, external)))


@pytest.mark.parametrize("algorithm", SETTINGS)
def test_finetune_model_through_external_data_gives_the_in_proto_bytes(tmp_path: Path, lowered: None,
                                                                        monkeypatch: pytest.MonkeyPatch, algorithm: str) -> None:
    paths = pair(tmp_path, quantize_model(stack(), "INT4_BLOCK32", None).model)
    inputs = snapshot(paths["external"].parent)
    seen = fingerprints(monkeypatch)
    for form, path in paths.items():
        high_water = high_water_kib()
        _, report = finetune_model(path, feeds(), SETTINGS[algorithm], output_dir=path.parent, name="run",
                                   model_path=path.with_name("tuned.onnx"))
        assert high_water <= report["peak_rss_kib"] <= high_water_kib()
        assert json.loads((path.parent / "run.json").read_text())["peak_rss_kib"] == report["peak_rss_kib"]
    assert snapshot(paths["external"].parent) | inputs == snapshot(paths["external"].parent)  # inputs untouched
    assert_pair_and_equal(paths, "tuned.onnx")
    assert len(seen) == 2 and seen[0] == seen[1]
    assert seen[0]["model"] == model_digest(load_model(paths["inline"])) != model_digest(stack())


def test_cli_tune_and_quantize_finetune_keep_external_data(tmp_path: Path, lowered: None) -> None:
    """`quantize --finetune gptq` and `tune --finetune adaquant` on its output, from each form."""
    paths = pair(tmp_path, stack(opset=17))
    for path in paths.values():
        folder = path.parent / "data"
        folder.mkdir()
        for index, feed in enumerate(feeds()):
            np.save(folder / f"{index}.npy", feed["x"])
        quantize = ["quantize", path, "--config", "INT4_BLOCK32", "--finetune", "gptq", "--data", folder, "--batch-size", "4",
                    "-o", path.with_name("q.onnx")]
        assert main([str(a) for a in quantize]) == 0
        tune = ["tune", path.with_name("q.onnx"), "--data", folder, "--finetune", "adaquant", "--iterations", "5",
                "--batch-size", "4", "-o", path.with_name("t.onnx")]
        assert main([str(a) for a in tune]) == 0
        assert json.loads(path.with_name("t.onnx.finetune.json").read_text())["peak_rss_kib"] > 0
    for name in ("q.onnx", "t.onnx"):
        assert_pair_and_equal(paths, name)


def test_the_digest_reads_one_tensor_at_a_time_and_names_the_model(tmp_path: Path, lowered: None) -> None:
    """Equal models give equal digests whether read from one proto or a data file; a changed weight
    changes it."""
    paths = pair(tmp_path, stack())
    digests = {form: model_digest(load_model(path)) for form, path in paths.items()}
    assert digests["inline"] == digests["external"] == model_digest(stack())
    assert model_digest(stack(seed=1)) != digests["inline"]


def test_the_preflight_reads_the_graph_not_the_weights(tmp_path: Path) -> None:
    """Which ops a model has is read without its weights: with the data file gone, a model at an opset
    normalisation upgrades still passes, one with an op no converter lifts is named, and a proto gives
    the same answers as its file."""
    path = tmp_path / "model.onnx"
    save_model_atomic(stack(opset=11), path, external_data=True)
    for data in data_files(path):
        (path.parent / data).unlink()
    check_liftable(path)
    unliftable = stack()
    unliftable.graph.node[1].op_type = "NotAnOnnxOp"
    save_model_atomic(unliftable, path, external_data=True)
    for data in data_files(path):
        (path.parent / data).unlink()
    with pytest.raises(LiftError, match=r"NotAnOnnxOp .*'relu0'"):
        check_liftable(path)
    assert unliftable_ops(unliftable) == unliftable_ops(path)
    assert unliftable_ops(stack(opset=11)) == {}


def test_a_float_model_file_is_lifted_one_tensor_at_a_time(tmp_path: Path, lowered: None) -> None:
    """A float model with external data is lifted from its header, each weight read from the data file as
    it is made (the proto never holds the bytes), into the module the loaded model gives; its digest is
    the loaded model's."""
    paths = pair(tmp_path, stack())
    header = load_model(paths["external"], external_values=False)
    module = lift_model(header, folder=paths["external"].parent)
    assert not any(tensor.HasField("raw_data") for tensor in header.graph.initializer if tensor.data_location == onnx.TensorProto.EXTERNAL)
    loaded = lift_model(paths["inline"])
    assert [name for name, _ in module.named_parameters()] == [name for name, _ in loaded.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), loaded.parameters()))
    assert model_digest(header, paths["external"].parent) == model_digest(load_model(paths["inline"]))
    with pytest.raises(LiftError, match="external data file that was not loaded"):
        lift_model(header)


def test_tuning_towards_a_float_model_file_gives_the_in_proto_bytes(tmp_path: Path, lowered: None) -> None:
    """GPTQ over codes towards the float model given as a file with external data (read one tensor at a
    time) or in one proto: the same tuned model."""
    float_paths = pair(tmp_path, stack())
    quantized = quantize_model(stack(), {"preset": "INT4_BLOCK32", "weight_storage": "compact"}, None).model
    tuned = [finetune_model(quantized, feeds(), SETTINGS["gptq"], float_model=path)[0] for path in float_paths.values()]
    assert_same(*tuned)


def test_quantize_and_finetune_hands_a_large_model_over_as_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From BY_FILE_BYTES on the quantized and float models reach tuning as files (tuning would copy a proto
    while the quantizer's result still holds it) and are dropped from that result; the tuned bytes are
    those of the in-memory handover."""
    config = {"preset": "INT4_BLOCK32", "weight_storage": "compact", "fast_finetune": {"algorithm": "gptq", "batch_size": 4,
                                                                                         "validation_share": 0.0}}
    given: list[list[bool]] = []  # per run: whether each model came as a file
    tune = finetune.recon.finetune_model

    def spy(qdq_model: Any, data: Any, settings: Any, float_model: Any, *args: Any, **kwargs: Any) -> Any:
        given.append([isinstance(model, Path) for model in (qdq_model, float_model)])
        assert not given[-1][1] or has_external_data(float_model)  # so it is lifted one tensor at a time
        return tune(qdq_model, data, settings, float_model, *args, **kwargs)

    monkeypatch.setattr(finetune.recon, "finetune_model", spy)
    in_memory = quantize_and_finetune(stack(), config, feeds()).model
    monkeypatch.setattr(finetune.onnx.io, "BY_FILE_BYTES", 1)  # both: the codes take 24 KiB
    by_file = quantize_and_finetune(stack(), config, feeds()).model
    assert given == [[False, False], [True, True]]
    assert_same(by_file, in_memory)


def test_the_quantized_models_bytes_lie_in_a_file_while_units_are_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    """From BY_FILE_BYTES on, the QDQ model's large tensors lie in a temporary file from the lift on (read
    from there one at a time), where onnxruntime's check reads them, and while the units are tuned (they are read again only to be written); before the export all come back but the tuned weights' codes,
    which the export replaces whole: the tuned model is, byte for byte, the one tuned with them in memory."""
    qdq = quantize_model(stack(), "INT4_BLOCK32", None).model
    in_memory, _ = finetune_model(qdq, feeds(), SETTINGS["gptq"])
    calls: list[tuple[int, int, set[str]]] = []  # (tensors pointing to the file, the largest left in the proto, skipped)
    restore = finetune.recon.run.put_back

    def spy(header: onnx.ModelProto, folder: Path, skip: Collection[str] = ()) -> onnx.ModelProto:
        tensors = header.graph.initializer
        calls.append((sum(t.data_location == onnx.TensorProto.EXTERNAL for t in tensors), max(t.ByteSize() for t in tensors),
                      set(skip)))
        return restore(header, folder, skip)

    checked: list[tuple[int, bool, int]] = []  # (tensors pointing to the file, a folder given, outputs onnxruntime gave)
    check, values = finetune.recon.run.check_lifted, finetune.lift.agreement.onnxruntime_values

    def check_spy(model: onnx.ModelProto, module: Any, feed: Any, folder: Path | None = None) -> None:
        checked.append((sum(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer), folder is not None, 0))
        return check(model, module, feed, folder)

    def values_spy(*args: Any, **kwargs: Any) -> dict:
        found = values(*args, **kwargs)
        checked[-1] = (*checked[-1][:2], len(found))
        return found

    lifted_from: list[Path | None] = []
    lift = finetune.recon.run.lift_model

    def lift_spy(model: Any, *args: Any, folder: Path | None = None, **kwargs: Any) -> Any:
        lifted_from.append(folder)
        return lift(model, *args, folder=folder, **kwargs)

    monkeypatch.setattr(finetune.recon.run, "put_back", spy)
    monkeypatch.setattr(finetune.recon.run, "lift_model", lift_spy)
    monkeypatch.setattr(finetune.recon.run, "check_lifted", check_spy)
    monkeypatch.setattr(finetune.lift.agreement, "onnxruntime_values", values_spy)
    monkeypatch.setattr(finetune.onnx.io, "BY_FILE_BYTES", model_bytes(qdq))
    set_aside, _ = finetune_model(qdq, feeds(), SETTINGS["gptq"])
    assert len(lifted_from) == 1 and lifted_from[0] is not None  # the QDQ model was lifted from the set-aside file
    assert checked[0][0] >= 3 and checked[0][1:] == (True, 1)  # and onnxruntime ran it from there
    assert len(calls) == 2
    (aside, largest, skipped), (left, _, _) = calls
    assert aside >= 3 and largest < 2 * INLINE_TENSOR_BYTES  # the three weights' codes, at least, were in the file
    assert len(skipped) == 3 and left == 0  # the tuned codes were not read back: the export wrote them
    assert set_aside.SerializeToString() == in_memory.SerializeToString()


@pytest.mark.parametrize("large", [False, True])
def test_free_heap_goes_back_after_the_preparation_and_after_each_unit_of_a_large_run(monkeypatch: pytest.MonkeyPatch,
                                                                                      large: bool) -> None:
    """After the lifts and after onnxruntime's check always; after each unit only from LARGE_RUN_BYTES of weights on
    (a smaller model's units keep glibc's reuse), and then where the heap holds HEAP_SLACK free."""
    qdq = quantize_model(stack(), "INT4_BLOCK32", None).model
    asked: list[int] = []
    monkeypatch.setattr(finetune.recon.run, "release_freed_host_memory", lambda at_least=0: asked.append(at_least))
    if large:
        monkeypatch.setattr(finetune.recon.run, "LARGE_RUN_BYTES", 1)
    finetune_model(qdq, feeds(), SETTINGS["gptq"])
    assert asked == [0, 0, *([HEAP_SLACK] * 3 if large else [])]


def test_the_lifted_modules_are_freed_before_the_tuned_models_load_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lifted modules live in reference cycles (their fx graphs): tuning collects them when it ends,
    so the output's load check (an onnxruntime session of the model) does not run beside their weights
    (at 2.5 GB that check was the run's peak), whether or not Python's collector has run meanwhile."""
    qdq = quantize_model(stack(), "INT4_BLOCK32", None).model
    lifted: list[weakref.ref] = []
    alive_at_check: list[int] = []
    lift, check = finetune.recon.run.lift_model, finetune.recon.api.require_loads

    def lift_spy(*args: Any, **kwargs: Any) -> Any:
        module = lift(*args, **kwargs)
        lifted.append(weakref.ref(module))
        return module

    def check_spy(*args: Any, **kwargs: Any) -> None:
        alive_at_check.append(sum(ref() is not None for ref in lifted))
        return check(*args, **kwargs)

    monkeypatch.setattr(finetune.recon.run, "lift_model", lift_spy)
    monkeypatch.setattr(finetune.recon.api, "require_loads", check_spy)
    gc.disable()
    try:
        finetune_model(qdq, feeds(), SETTINGS["gptq"])
    finally:
        gc.enable()
    assert lifted and alive_at_check == [0]
