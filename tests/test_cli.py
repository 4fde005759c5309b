"""The `finetune` command line: attach-ops makes models with AMD Quark BFP/MX nodes run in stock
onnxruntime, with outputs equal to the reference vectors, and never touches its input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from finetune.onnx import QUARK_DOMAIN

from .vectors import assert_same_values, load_vector_sets

VECTORS = {v.name: v for v in load_vector_sets()}


def finetune_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune.cli", *args], capture_output=True, text=True, check=False)


def quark_model(path: Path, names: list[str]) -> None:
    """A model with one com.amd.quark node per vector configuration, each on its own input, saved
    as AMD Quark 0.13 writes them (IR 8, opset 17, its domains imported at version 1000 and
    onnxruntime's, used or not), without function bodies."""
    nodes, inputs, outputs = [], [], []
    for i, name in enumerate(names):
        vectors = VECTORS[name]
        nodes.append(helper.make_node(vectors.op_type, [f"x{i}"], [f"y{i}"], name=f"n{i}", domain=QUARK_DOMAIN, **vectors.attributes))
        inputs.append(helper.make_tensor_value_info(f"x{i}", onnx.TensorProto.FLOAT, None))
        outputs.append(helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, None))
    model = helper.make_model(helper.make_graph(nodes, "quark", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(QUARK_DOMAIN, 1000),
                                             helper.make_opsetid("com.vai.quantize", 1000), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    onnx.save(model, path)


def test_attach_ops_runs_quark_models_in_stock_onnxruntime(tmp_path: Path) -> None:
    names = ["bfp_tobfp_bw16_ax1_rm0", "bfpprime_mx9_bw16_axlast_rm2", "bfpprime_mx4_bw11_ax1_rm1",
             "mx_fp4_e2m1_ax1_rm2", "mx_int8_axlast_rm0", "bfp_tobfp_bw16_ax1_rm2_bfloat"]
    source, target = tmp_path / "quark.onnx", tmp_path / "attached.onnx"
    quark_model(source, names)
    before = source.read_bytes()
    with pytest.raises(Exception, match="com.amd.quark:.* is not a registered function/op"):
        ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    result = finetune_cli("attach-ops", str(source), str(target))
    assert result.returncode == 0, result.stderr
    assert source.read_bytes() == before
    session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    for case in range(len(VECTORS[names[0]].pairs)):
        feeds = {f"x{i}": VECTORS[name].pairs[case][0] for i, name in enumerate(names)}
        for i, (name, got) in enumerate(zip(names, session.run(None, feeds))):
            assert_same_values(got, VECTORS[name].pairs[case][1], f"{name} input {case}")


def test_attach_ops_on_a_model_that_has_its_bodies_says_the_copy_is_unchanged(tmp_path: Path) -> None:
    source, attached, again = tmp_path / "quark.onnx", tmp_path / "attached.onnx", tmp_path / "again.onnx"
    quark_model(source, ["mx_int8_axlast_rm0"])
    assert "unchanged copy" not in finetune_cli("attach-ops", str(source), str(attached)).stderr
    result = finetune_cli("attach-ops", str(attached), str(again))
    assert result.returncode == 0, result.stderr
    assert "needs no function bodies" in result.stderr and "unchanged copy" in result.stderr
    assert again.read_bytes() == attached.read_bytes()


def test_attach_ops_names_a_missing_input(tmp_path: Path) -> None:
    result = finetune_cli("attach-ops", str(tmp_path / "nope.onnx"), str(tmp_path / "out.onnx"))
    assert result.returncode == 2
    assert "nope.onnx" in result.stderr and "does not exist" in result.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_attach_ops_names_the_bad_node(tmp_path: Path) -> None:
    path = tmp_path / "bad.onnx"
    node = helper.make_node("MXQuantizeDequantize", ["x"], ["y"], name="bad_mx", domain=QUARK_DOMAIN, element_dtype="fp5")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    result = finetune_cli("attach-ops", str(path), str(tmp_path / "out.onnx"))
    assert result.returncode == 2
    assert "bad_mx" in result.stderr and "element_dtype" in result.stderr
