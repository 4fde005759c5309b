"""FP32/FP16 -> BF16 conversion in its four formats: each converted model runs in onnxruntime with
outputs within bfloat16 rounding of the float model, values beyond the bfloat16 range saturate,
the bf16 format names every node onnxruntime's CPU provider has no kernel for, and the tools
never touch their input.

Error bound. bfloat16 keeps 8 significant bits, so rounding to it (RNE) changes a value by at
most u = 2^-8 relative. In a converted model every node reads inputs rounded to bfloat16 and its
output is rounded again. Measured relative to the largest output magnitude, a node passes on its
inputs' error times a condition factor (1 for data movement, Relu and the bounded activations;
at most about 2 for these test models' MatMul/Conv/Gemm, whose weights are scaled by
1/sqrt(fan-in) so no output is a large cancellation) and adds u for its own rounding, so after D
nodes on the longest path the error is at most 2u * D. Measured: 0.15-0.7% (below 2u) on the small
models against bounds of 4-6%, 3.7% on EfficientNet-Lite0 (depth 119, bound 93%); `pytest -s`
prints them.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from finetune import cli
from finetune.tools import convert_fp16_to_bf16, convert_fp32_to_bf16
from finetune.tools.bf16 import (
    BF16_MAX,
    FORMATS,
    bf16_values,
    convert,
    convert_file,
    detect_source,
)
from finetune.tools.session import make_session, missing_kernels

from .tools_models import (
    INPUT_SHAPES,
    MODELS,
    data_movement,
    longest_path,
    make_model,
    mk,
    run,
)

U = 2.0**-8  # bfloat16 unit roundoff
RUNS_ON_CPU = ("with_cast", "customqdq", "simulate_bf16")
DTYPES = {"float32": np.float32, "float16": np.float16}


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref|, in float64."""
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def sample(name: str, dtype: type, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(INPUT_SHAPES[name]).astype(dtype)


@pytest.mark.parametrize("source", DTYPES)
@pytest.mark.parametrize("fmt", RUNS_ON_CPU)
@pytest.mark.parametrize("name", MODELS)
def test_converted_model_is_within_bf16_rounding(name: str, fmt: str, source: str) -> None:
    dtype = DTYPES[source]
    model = MODELS[name](dtype)
    x = sample(name, dtype)
    converted = convert(model, fmt, source)
    out = run(converted, x)
    assert out.dtype == dtype and np.isfinite(out).all()
    error, bound = relative_error(out, run(model, x)), 2 * U * longest_path(model)
    print(f"{name} {source} {fmt}: max relative error {error:.2e} (bound {bound:.2e})")
    assert 0 < error <= bound


@pytest.mark.parametrize("source", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_with_cast_and_customqdq_round_identically(name: str, source: str) -> None:
    """onnxruntime's Cast and our quantize-dequantize function body round the same tensors the
    same way (graph optimisations off, so onnxruntime computes both graphs as written)."""
    dtype = DTYPES[source]
    model, x = MODELS[name](dtype), sample(name, dtype)
    with_cast = run(convert(model, "with_cast", source), x, optimize=False)
    customqdq = run(convert(model, "customqdq", source), x, optimize=False)
    np.testing.assert_array_equal(with_cast, customqdq)


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {name: node for node in model.graph.node for name in node.output}


def test_with_cast_rounds_every_tensor_between_nodes() -> None:
    """Every float input of an original node, and the graph output, comes from Cast(to=float)
    of Cast(to=bfloat16); Resize's roi and scales (not bfloat16 in the op's schema) stay exact."""
    model = MODELS["cnn"]()
    converted = convert(model, "with_cast", "float32")
    producers = _producers(converted)
    originals = {node.name for node in model.graph.node}
    checked = 0
    for node in converted.graph.node:
        if node.name not in originals:
            continue
        for index, name in enumerate(node.input):
            if node.op_type == "Resize" and index > 0:
                assert name in {"roi", "scales"}
                continue
            back = producers[name]
            assert back.op_type == "Cast" and back.attribute[0].i == TensorProto.FLOAT, (node.name, name)
            assert producers[back.input[0]].op_type == "Cast" and producers[back.input[0]].attribute[0].i == TensorProto.BFLOAT16
            checked += 1
    assert checked == 13
    back = producers["y"]
    assert back.op_type == "Cast" and producers[back.input[0]].attribute[0].i == TensorProto.BFLOAT16


def test_customqdq_uses_our_domain_with_bodies() -> None:
    converted = convert(MODELS["mlp"](), "customqdq", "float32")
    ops = {(n.domain, n.op_type) for n in converted.graph.node}
    assert ("com.finetune", "ExtendedQuantizeLinear") in ops and ("com.finetune", "ExtendedDequantizeLinear") in ops
    assert {(f.domain, f.name) for f in converted.functions} >= {("com.finetune", "ExtendedQuantizeLinear")}


@pytest.mark.parametrize("source", DTYPES)
def test_simulate_bf16_stores_bf16_values_in_the_original_type(source: str) -> None:
    dtype = DTYPES[source]
    model = MODELS["attention"](dtype)
    converted = convert(model, "simulate_bf16", source)
    assert [n.op_type for n in converted.graph.node] == ["MatMul", "Split", "Transpose", "MatMul", "Mul", "Softmax",
                                                          "MatMul", "MatMul", "Add"]
    for tensor in converted.graph.initializer:
        if tensor.data_type == TensorProto.INT64:
            continue
        values = numpy_helper.to_array(tensor)
        assert values.dtype == dtype
        np.testing.assert_array_equal(values, values.astype(ml_dtypes.bfloat16).astype(dtype))


def test_bf16_model_of_cpu_kernel_ops_runs_within_rounding() -> None:
    """A model of ops that have bfloat16 kernels on onnxruntime's CPU provider runs as bf16."""
    model = data_movement()
    x = sample("data_movement", np.float32)
    converted = convert(model, "bf16", "float32")
    assert missing_kernels(converted) == {}
    types = {i.name: i.type.tensor_type.elem_type for i in [*converted.graph.value_info]}
    assert types["n"] == TensorProto.BFLOAT16 and converted.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert {t.name: t.data_type for t in converted.graph.initializer}["gamma_bf16"] == TensorProto.BFLOAT16
    out = run(converted, x)
    error, bound = relative_error(out, run(model, x)), 2 * U * longest_path(model)
    print(f"data_movement float32 bf16: max relative error {error:.2e} (bound {bound:.2e})")
    assert out.dtype == np.float32 and 0 < error <= bound
    np.testing.assert_array_equal(out, run(convert(model, "with_cast", "float32"), x))


def test_bf16_format_lists_every_node_the_cpu_provider_cannot_run(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="finetune.tools.bf16"):
        converted = convert(MODELS["attention"](), "bf16", "float32")
    expected = {
        "MatMul(bfloat16, bfloat16)": ["q_proj_fused_matmul", "scores", "mix", "out_proj"],
        "Mul(bfloat16, bfloat16)": ["scaled"],
        "Softmax(bfloat16)": ["softmax"],
        "Add(bfloat16, bfloat16)": ["residual"],
    }
    assert missing_kernels(converted) == expected
    message = caplog.text
    assert "GPU execution providers" in message
    assert all(label in message and all(n in message for n in nodes) for label, nodes in expected.items())
    with pytest.raises(ValueError, match="no kernel") as error:
        make_session(converted)
    assert all(n in str(error.value) for nodes in expected.values() for n in nodes)


def test_bf16_format_converts_weights_and_keeps_the_boundary_type() -> None:
    converted = convert(MODELS["cnn"](), "bf16", "float32")
    weights = {t.name: t.data_type for t in converted.graph.initializer}
    assert weights["scales"] == weights["roi"] == TensorProto.FLOAT  # Resize's scales/roi cannot be bfloat16
    assert {weights[f"{w}_bf16"] for w in ("c1", "c1b", "c2", "fc", "fcb")} == {TensorProto.BFLOAT16}
    assert converted.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert converted.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert [n.op_type for n in converted.graph.node][:2] == ["Clip", "Cast"] and converted.graph.node[-1].op_type == "Cast"
    onnx.checker.check_model(converted, full_check=True)


# ---------------------------------------------------------------- saturation


def _scale_model(weight: float, dtype: type) -> onnx.ModelProto:
    """y = (x * w) * 2 on a vector: an overflowing weight and an overflowing activation."""
    nodes = [mk("Mul", ["x", "w"], ["h"], name="scale"), mk("Mul", ["h", "two"], ["y"], name="double")]
    return make_model(nodes, [3], [3], {"w": np.full(3, weight, dtype), "two": np.array(2.0, dtype)}, dtype)


@pytest.mark.parametrize("fmt", RUNS_ON_CPU)
def test_float32_values_beyond_bf16_saturate(fmt: str) -> None:
    """A weight of 3.4e38 (float32, beyond bfloat16's 3.3895e38) and an activation doubled past it
    clamp to the largest bfloat16 value instead of becoming inf; NaN stays NaN."""
    converted = convert(_scale_model(3.4e38, np.float32), fmt, "float32")
    stored = numpy_helper.to_array(next(t for t in converted.graph.initializer if t.name == "w"))
    assert np.all(stored == np.float32(BF16_MAX))
    out = run(converted, np.array([1.0, -1.0, np.nan], np.float32))
    if fmt == "simulate_bf16":  # activations stay float32: 2 * 3.3895e38 overflows float32 itself
        assert np.isinf(out[:2]).all()
    else:
        np.testing.assert_array_equal(out[:2], [BF16_MAX, -BF16_MAX])
    assert np.isnan(out[2])
    big = run(convert(_scale_model(1.0, np.float32), fmt, "float32"), np.array([1.7e38, 3.4e38, np.inf], np.float32))
    expected = [BF16_MAX, BF16_MAX, BF16_MAX] if fmt != "simulate_bf16" else [3.4e38, np.inf, np.inf]
    np.testing.assert_array_equal(big, np.array(expected, np.float32))


@pytest.mark.parametrize("fmt", ["with_cast", "customqdq"])
def test_float16_values_beyond_bf16_in_float16_saturate(fmt: str) -> None:
    """65500 rounds to bfloat16 65536, which float16 cannot hold: it clamps to 65280, the largest
    bfloat16 value float16 holds, for weights and activations."""
    converted = convert(_scale_model(65500.0, np.float16), fmt, "float16")
    stored = numpy_helper.to_array(next(t for t in converted.graph.initializer if t.name == "w"))
    assert stored.dtype == np.float16 and np.all(stored == 65280)
    out = run(converted, np.array([1.0, 0.5, -0.25], np.float16))
    np.testing.assert_array_equal(out, np.array([65280, 65280, -32640], np.float16))
    simulated = convert(_scale_model(65500.0, np.float16), "simulate_bf16", "float16")
    assert np.all(numpy_helper.to_array(next(t for t in simulated.graph.initializer if t.name == "w")) == 65280)


def test_bf16_format_saturates_inputs_at_the_boundary() -> None:
    model = make_model([mk("Transpose", ["x"], ["y"], name="t", perm=[1, 0])], [3, 2], [2, 3], {}, np.float32)
    x = np.array([[3.4e38, -3.4e38], [np.inf, -np.inf], [np.nan, 1.0 + 2**-9]], np.float32)
    expected = np.array([[BF16_MAX, BF16_MAX, np.nan], [-BF16_MAX, -BF16_MAX, 1.0]], np.float32)
    np.testing.assert_array_equal(run(convert(model, "bf16", "float32"), x), expected)
    weights = bf16_values(np.array([3.4e38, -np.inf, np.nan, 1.0 + 2**-9], np.float32))
    np.testing.assert_array_equal(weights, np.array([BF16_MAX, -BF16_MAX, np.nan, 1.0], np.float32))


# ---------------------------------------------------------------- files and command lines


@pytest.mark.parametrize(("tool", "source"), [(convert_fp32_to_bf16, "float32"), (convert_fp16_to_bf16, "float16")])
def test_tools_convert_files_and_never_touch_the_input(tmp_path: Path, tool: ModuleType, source: str) -> None:
    dtype = DTYPES[source]
    source_path, target = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(MODELS["mlp"](dtype), source_path)
    before = source_path.read_bytes()
    for fmt in FORMATS:
        assert tool.main(["--input", str(source_path), "--output", str(target), "--format", fmt]) == 0
        assert source_path.read_bytes() == before
        converted = onnx.load(target)
        assert converted.graph.input[0].type.tensor_type.elem_type == onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    assert not list(tmp_path.glob(".*tmp"))
    assert tool.main(["--input", str(source_path), "--output", str(source_path)]) == 2
    assert source_path.read_bytes() == before


def test_wrong_tool_for_the_model_says_which_to_use(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "fp16.onnx"
    onnx.save(MODELS["mlp"](np.float16), path)
    assert convert_fp32_to_bf16.main(["--input", str(path), "--output", str(tmp_path / "o.onnx")]) == 2
    assert "convert_fp16_to_bf16" in caplog.text
    assert not (tmp_path / "o.onnx").exists()


def test_cli_convert_bf16_detects_the_source_type(tmp_path: Path) -> None:
    path, target = tmp_path / "fp16.onnx", tmp_path / "o.onnx"
    onnx.save(MODELS["mlp"](np.float16), path)
    assert detect_source(onnx.load(path)) == "float16"
    assert cli.main(["convert-bf16", "--input", str(path), "--output", str(target)]) == 0
    x = sample("mlp", np.float16)
    assert relative_error(run(onnx.load(target), x), run(onnx.load(path), x)) <= 2 * U * 6


def test_tools_run_as_modules_and_help_says_bf16_is_for_gpu_providers(tmp_path: Path) -> None:
    def tool(module: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, check=False)

    text = tool("finetune.tools.convert_fp32_to_bf16", "--help").stdout
    assert "GPU execution providers" in text and "MatMul" in text
    onnx.save(MODELS["mlp"](np.float16), tmp_path / "in.onnx")
    args = ("--input", str(tmp_path / "in.onnx"), "--output", str(tmp_path / "out.onnx"), "--format", "customqdq")
    result = tool("finetune.tools.convert_fp16_to_bf16", *args)
    assert result.returncode == 0, result.stderr
    assert "ExtendedQuantizeLinear" in {n.op_type for n in onnx.load(tmp_path / "out.onnx").graph.node}


def test_convert_file_refuses_control_flow(tmp_path: Path) -> None:
    branch = onnx.helper.make_graph([mk("Identity", ["x"], ["z"])], "b", [], [onnx.helper.make_tensor_value_info("z", TensorProto.FLOAT, [3])])
    nodes = [mk("Greater", ["x", "w"], ["c"], name="cmp"), mk("ReduceMax", ["c"], ["any"], name="any", keepdims=0),
             mk("If", ["any"], ["y"], name="branch", then_branch=branch, else_branch=branch)]
    path = tmp_path / "if.onnx"
    onnx.save(make_model(nodes, [3], [3], {"w": np.zeros(3, np.float32)}, np.float32), path)
    with pytest.raises(ValueError, match="branch"):
        convert_file(path, tmp_path / "o.onnx")


@pytest.mark.slow
def test_real_models_keep_their_predictions(tmp_path: Path) -> None:
    """The digits CNN (scikit-learn's real digits) and EfficientNet-Lite0 (ImageNet weights, crops
    of sample photos): with_cast/customqdq/simulate_bf16 stay within the bound and keep the float
    model's top-1 on all digits and on at least 85% of the crops (many crops show no ImageNet
    class, so their top-2 logits are close enough for bfloat16 rounding to swap)."""
    from finetune import zoo

    _, _, x_test, _ = zoo.digits_split()
    digits = onnx.load(zoo.export_onnx(zoo.train_digits_cnn(), x_test[:1], tmp_path / "digits.onnx"))
    crops = zoo.photo_crops(28)
    lite0 = onnx.load(zoo.export_onnx(zoo.efficientnet_lite0(), crops[:1], tmp_path / "lite0.onnx"))
    cases = (("digits", digits, x_test.numpy(), 1.0), ("efficientnet-lite0", lite0, crops.numpy(), 0.85))
    for name, model, x, agreement in cases:
        ref = run(model, x)
        for fmt in RUNS_ON_CPU:
            out = run(convert(model, fmt, "float32"), x)
            error, bound = relative_error(out, ref), 2 * U * longest_path(model)
            same = float(np.mean(out.argmax(1) == ref.argmax(1)))
            print(f"{name} {fmt}: max relative error {error:.2e} (bound {bound:.2e}), top-1 agreement {same:.1%}")
            assert error <= bound and same >= agreement
