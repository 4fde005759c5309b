"""Models over protobuf's 2 GB, exercised on small models with the threshold lowered: written as the
model file plus one data file, atomically; quantized through the CLI as the same model in one
proto would be; run by onnxruntime, shape inference and the checker; inputs untouched; the
summary carries the peak memory."""

from __future__ import annotations

import json
import os
import re
import resource
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper, shape_inference

import finetune.files
import finetune.onnx.io
import finetune.onnx.session
from finetune.cli import main
from finetune.lift.params import tensor_array
from finetune.onnx.dtypes import numpy_dtype
from finetune.onnx.io import (
    check_model,
    copy_without_initializers,
    external_array,
    has_external_data,
    infer_shapes_of,
    load_model,
    loaded_tensor,
    model_bytes,
    save_model_atomic,
)
from finetune.onnx.session import inference_session, session_options

WIDTH, LAYERS = 128, 3  # three 64 KiB weights: far past the lowered threshold, well within a test's seconds
LOWERED = 100_000


def stack(seed: int = 0, opset: int = 21) -> onnx.ModelProto:
    """x[N, WIDTH] -> MatMul -> Relu -> MatMul -> Relu -> MatMul -> y, seeded weights."""
    rng = np.random.default_rng(seed)
    nodes, weights = [], []
    for index in range(LAYERS):
        weights.append(numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32), f"w{index}"))
        source = "x" if index == 0 else f"r{index - 1}"
        output = "y" if index == LAYERS - 1 else f"h{index}"
        nodes.append(helper.make_node("MatMul", [source, f"w{index}"], [output], name=f"fc{index}"))
        if index < LAYERS - 1:
            nodes.append(helper.make_node("Relu", [output], [f"r{index}"], name=f"relu{index}"))
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", WIDTH])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


@pytest.fixture
def lowered(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if every model of more than LOWERED bytes were over 2 GB."""
    monkeypatch.setattr("finetune.onnx.io.EXTERNAL_DATA_THRESHOLD", LOWERED)


def data_files(path: Path) -> list[str]:
    """The data files named after the model at `path`."""
    return sorted(f.name for f in path.parent.iterdir() if re.fullmatch(re.escape(path.name) + r"\.[0-9a-f]{16}\.data", f.name))


def assert_same(actual: onnx.ModelProto, expected: onnx.ModelProto) -> None:
    """The same graph and tensor values (onnx.load marks a tensor read from a data file as stored in
    the proto, a field the original leaves unset)."""
    assert copy_without_initializers(actual) == copy_without_initializers(expected)
    assert [(t.name, t.data_type, list(t.dims)) for t in actual.graph.initializer] == \
        [(t.name, t.data_type, list(t.dims)) for t in expected.graph.initializer]
    for a, b in zip(actual.graph.initializer, expected.graph.initializer):
        assert a.raw_data == b.raw_data and a.data_location == onnx.TensorProto.DEFAULT


def snapshot(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}


def high_water_kib() -> int:
    """This process's peak resident memory so far, in KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_a_large_model_is_written_as_the_model_and_one_data_file(tmp_path: Path, lowered: None) -> None:
    model = stack()
    assert model_bytes(model) == model.ByteSize() > LOWERED
    path = tmp_path / "model.onnx"
    save_model_atomic(model, path)
    assert has_external_data(path) and path.stat().st_size < 4096  # the weights are in the data file
    assert len(data_files(path)) == 1 and sorted(f.name for f in tmp_path.iterdir()) == ["model.onnx", *data_files(path)]
    assert_same(load_model(path), model)
    save_model_atomic(stack(seed=1), path)  # another model replaces the pair: its data file, the old one removed
    assert len(data_files(path)) == 1 and len(list(tmp_path.iterdir())) == 2
    assert_same(load_model(path), stack(seed=1))


def test_small_models_go_external_only_on_request(tmp_path: Path) -> None:
    inline, external = tmp_path / "inline.onnx", tmp_path / "external.onnx"
    save_model_atomic(stack(), inline)
    save_model_atomic(stack(), external, external_data=True)
    assert not has_external_data(inline) and not data_files(inline)
    assert has_external_data(external) and len(data_files(external)) == 1
    assert load_model(inline) == stack()
    assert_same(load_model(external), stack())


def test_an_interrupted_write_leaves_the_old_pair_which_readers_see_until_the_model_is_renamed(
    tmp_path: Path, lowered: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "model.onnx"
    save_model_atomic(stack(seed=0), path)
    before = snapshot(tmp_path)
    seen_between = []
    rename = os.replace

    def fail_on_the_model(source: str | os.PathLike, target: str | os.PathLike) -> None:
        if Path(target) == path:  # the new data file is in place; the model file is the commit
            seen_between.append(load_model(path))
            raise OSError(28, "No space left on device")
        rename(source, target)

    monkeypatch.setattr(finetune.files.os, "replace", fail_on_the_model)
    with pytest.raises(OSError, match="cannot write .*model.onnx"):
        save_model_atomic(stack(seed=1), path)
    assert len(seen_between) == 1
    assert_same(seen_between[0], stack(seed=0))  # between the renames a reader gets the old model and its data
    assert snapshot(tmp_path) == before  # no new data file, no temporary: the old pair, byte for byte
    monkeypatch.setattr(finetune.files.os, "replace", rename)
    save_model_atomic(stack(seed=1), path)
    assert_same(load_model(path), stack(seed=1))
    assert len(list(tmp_path.iterdir())) == 2


def test_a_model_past_by_file_bytes_reaches_onnxruntime_as_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below 2 GB but from BY_FILE_BYTES on, onnxruntime is given a model file (with its data file), not the
    serialized proto (two more copies of the weights in memory), for a plain session and for the
    agreement check's session with values exposed; the outputs are the in-memory session's."""
    from finetune.lift.agreement import onnxruntime_values

    model = stack()
    x = np.random.default_rng(1).standard_normal((2, WIDTH)).astype(np.float32)
    in_memory = inference_session(model).run(None, {"x": x})[0]
    given: list[type] = []
    session = ort.InferenceSession

    def spy(source: str | bytes, *args: object, **kwargs: object) -> ort.InferenceSession:
        given.append(type(source))
        return session(source, *args, **kwargs)

    monkeypatch.setattr(finetune.onnx.session.ort, "InferenceSession", spy)
    monkeypatch.setattr(finetune.onnx.io, "BY_FILE_BYTES", model_bytes(model))
    np.testing.assert_array_equal(inference_session(model).run(None, {"x": x})[0], in_memory)
    values = onnxruntime_values(model, {"x": x}, ["h0"])
    np.testing.assert_array_equal(values["y"], in_memory)
    assert values["h0"].shape == (2, WIDTH)
    assert given == [str, str]
    monkeypatch.setattr(finetune.onnx.io, "BY_FILE_BYTES", model_bytes(model) + 1)
    inference_session(model)
    assert given == [str, str, bytes]


def test_sessions_shape_inference_and_checker_take_large_models(lowered: None) -> None:
    model = stack()
    x = np.random.default_rng(1).standard_normal((2, WIDTH)).astype(np.float32)
    through_files = inference_session(model).run(None, {"x": x})[0]
    in_memory = ort.InferenceSession(model.SerializeToString(), session_options()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(through_files, in_memory)  # one graph, one library, the same kernels
    expected = shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    inferred = load_model(model)
    infer_shapes_of(inferred)
    assert inferred == expected and inferred.graph.value_info
    check_model(model)
    model.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(onnx.checker.ValidationError, match="NoSuchOp"):
        check_model(model)


# Weights only (int4 codes, an eighth of the weights: the in-proto run's output stays in one proto;
# int4 needs opset 21, so the version converter runs too), and int8 activations (a calibration session).
CASES = {"int4": (["--config", "INT4_BLOCK32", "--weight-storage", "compact"], ["q.onnx", "q.onnx.float.onnx"], 21),
         "a8w8": (["--config", "A8W8", "--random-data", "2"], ["q.onnx"], 17)}


@pytest.mark.parametrize("case", CASES)
def test_quantize_through_external_data_gives_the_in_proto_model(tmp_path: Path, lowered: None, case: str) -> None:
    flags, outputs, opset = CASES[case]
    inline, external = tmp_path / "inline", tmp_path / "external"
    inline.mkdir()
    external.mkdir()
    onnx.save(stack(opset=17), inline / "model.onnx")
    save_model_atomic(stack(opset=17), external / "model.onnx", external_data=True)
    inputs = snapshot(external)
    results = {}
    for folder in (inline, external):
        high_water = high_water_kib()
        assert main([str(a) for a in ["quantize", folder / "model.onnx", *flags, "-o", folder / "q.onnx"]]) == 0
        summary = json.loads((folder / "q.onnx.summary.json").read_text())
        assert high_water <= summary["peak_rss_kib"] <= high_water_kib()
        results[folder] = load_model(folder / "q.onnx")
    assert snapshot(external) | inputs == snapshot(external)  # the input and its data file, unchanged
    assert has_external_data(inline / "q.onnx") == (model_bytes(results[inline]) >= LOWERED)
    for name in outputs:  # an input with external data gives outputs with external data
        assert has_external_data(external / name) and len(data_files(external / name)) == 1
    assert_same(results[external], results[inline])
    assert results[inline].opset_import[0].version == opset
    x = np.random.default_rng(2).standard_normal((2, WIDTH)).astype(np.float32)
    values = [inference_session(folder / "q.onnx").run(None, {"x": x})[0] for folder in (inline, external)]
    np.testing.assert_array_equal(*values)


def test_the_output_may_not_be_the_input_or_its_data_file(tmp_path: Path, lowered: None) -> None:
    path = tmp_path / "model.onnx"
    save_model_atomic(stack(), path)
    before = snapshot(tmp_path)
    for output in (path, tmp_path / data_files(path)[0]):
        command = ["quantize", path, "--config", "INT4_BLOCK32", "-o", output]
        assert main([str(a) for a in command]) == 2
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn", "int64", "bool", "int4", "scalar"])
def test_values_in_a_data_file_are_read_straight_into_an_array(tmp_path: Path, dtype: str) -> None:
    """tensor_array reads a tensor of a model loaded without its data straight from the data file
    (external_array: one copy) with the values onnx's own loading gives, bit for bit, for every byte-wide
    type; sub-byte types go through onnx (external_array declines them)."""
    rng = np.random.default_rng(0)
    shape = () if dtype == "scalar" else (3, 40)
    array = rng.standard_normal(shape).astype(np.float32) if dtype != "bool" else rng.standard_normal(shape) > 0
    if dtype not in ("scalar", "bool"):
        array = array.astype(numpy_dtype(dtype)) if dtype != "int64" else (array * 100).astype(np.int64)
    tensors = [numpy_helper.from_array(np.asarray(array), "big"), numpy_helper.from_array(np.zeros(300, np.float32), "pad")]
    model = helper.make_model(helper.make_graph([], "g", [], [], tensors))
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    header = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    stored = {t.name: t for t in header.graph.initializer}["big"]
    read = tensor_array(stored, tmp_path)
    loaded = numpy_helper.to_array(loaded_tensor(stored, tmp_path))
    assert (external_array(stored, tmp_path) is None) == (dtype == "int4")
    assert read.dtype == loaded.dtype and read.shape == loaded.shape
    assert read.tobytes() == loaded.tobytes()
