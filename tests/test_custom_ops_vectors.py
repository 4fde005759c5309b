"""The standard-op function bodies of our custom ops run in stock onnxruntime and match the
reference vectors bit for bit, in both domains, at every optimisation level and opset."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from finetune.onnx import CUSTOM_DOMAIN, QUARK_DOMAIN, attach_custom_ops
from finetune.onnx.session import inference_session

from .vectors import VectorSet, assert_same_values, load_vector_sets

VECTOR_SETS = load_vector_sets()
DOMAINS = [QUARK_DOMAIN, CUSTOM_DOMAIN]
BFP = "BFPQuantizeDequantize"
MX = "MXQuantizeDequantize"
MX9 = {"bfp_method": "to_bfp_prime", "bit_width": 16, "block_size": 16, "rounding_mode": 2}
BFP16 = {"bfp_method": "to_bfp", "bit_width": 16, "block_size": 8, "rounding_mode": 0}


def one_node_model(
    op_type: str, attributes: dict, domain: str = CUSTOM_DOMAIN, opset: int = 17,
    dtype: int = TensorProto.FLOAT, shape: list | None = None,
) -> onnx.ModelProto:
    """x -> op -> y at the given opset; shape None leaves even the rank unknown."""
    node = helper.make_node(op_type, ["x"], ["y"], name="qdq", domain=domain, **attributes)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", dtype, shape)],
        [helper.make_tensor_value_info("y", dtype, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8  # as AMD Quark writes them; attaching raises it to what overloads need
    return model


def session(model: onnx.ModelProto, level: str = "all") -> ort.InferenceSession:
    """A CPU session over the model with its custom ops attached, nothing registered."""
    return inference_session(attach_custom_ops(model), optimization=level)


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], level: str = "all") -> list[np.ndarray]:
    """All outputs of the attached model for the given inputs."""
    return session(model, level).run(None, feeds)


def qdq(x: np.ndarray, op_type: str, attributes: dict, **model_options) -> np.ndarray:
    """y of a single custom node for x."""
    return run(one_node_model(op_type, attributes, **model_options), {"x": x})[0]


# ---------------------------------------------------------------- reference vectors


@pytest.mark.parametrize("level", ["disable", "all"])
@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("vectors", VECTOR_SETS, ids=lambda v: v.name)
def test_vectors(vectors: VectorSet, domain: str, level: str) -> None:
    runner = session(one_node_model(vectors.op_type, vectors.attributes, domain), level)
    for i, (x, y) in enumerate(vectors.pairs):
        got = runner.run(None, {"x": x})[0]
        assert got.shape == y.shape
        assert_same_values(got, y, f"{vectors.name} {domain} {level} input {i}")


@pytest.mark.parametrize("opset", [13, 21])
@pytest.mark.parametrize("vectors", VECTOR_SETS, ids=lambda v: v.name)
def test_vectors_at_other_opsets(vectors: VectorSet, opset: int) -> None:
    runner = session(one_node_model(vectors.op_type, vectors.attributes, opset=opset))
    for i, (x, y) in enumerate(vectors.pairs):
        assert_same_values(runner.run(None, {"x": x})[0], y, f"{vectors.name} opset {opset} input {i}")


@pytest.mark.parametrize(
    "name", ["bfp_tobfp_bw16_ax1_rm0", "bfpprime_mx9_bw16_axlast_rm1", "mx_fp4_e2m1_ax1_rm2", "mx_int8_axlast_rm0"]
)
def test_vectors_with_static_shapes(name: str) -> None:
    """With every shape known, onnxruntime constant-folds the shape arithmetic; same numbers."""
    vectors = next(v for v in VECTOR_SETS if v.name == name)
    for i, (x, y) in enumerate(vectors.pairs):
        got = qdq(x, vectors.op_type, vectors.attributes, shape=list(x.shape))
        assert_same_values(got, y, f"{name} static input {i}")


# ---------------------------------------------------------------- shapes and types


@pytest.mark.parametrize("op_type, attributes", [(BFP, BFP16), (BFP, MX9), (MX, {"element_dtype": "fp6_e2m3"})])
def test_negative_axis_on_rank_3(op_type: str, attributes: dict) -> None:
    x = np.random.default_rng(3).standard_normal((3, 37, 5)).astype(np.float32)
    y = qdq(x, op_type, {**attributes, "axis": -2})
    assert_same_values(y, qdq(x, op_type, {**attributes, "axis": 1}), "axis -2 vs 1")
    moved = qdq(np.ascontiguousarray(x.transpose(0, 2, 1)), op_type, {**attributes, "axis": -1}).transpose(0, 2, 1)
    assert_same_values(y, moved, "axis -2 vs the axis moved last")
    assert not np.array_equal(y, qdq(x, op_type, {**attributes, "axis": -1}))


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("op_type, attributes", [(BFP, BFP16), (BFP, MX9), (MX, {"element_dtype": "fp8_e5m2"})])
def test_float16_is_computed_in_float32(op_type: str, attributes: dict, opset: int) -> None:
    """float16 in, float16 out (CastLike from opset 15, the declared type below)."""
    x = (np.random.default_rng(4).standard_normal((2, 48, 3)) * 100).astype(np.float16)
    x[0, :3, 0] = [np.inf, np.nan, 6e-8]
    got = qdq(x, op_type, attributes, opset=opset, dtype=TensorProto.FLOAT16)
    assert got.dtype == np.float16
    expected = qdq(x.astype(np.float32), op_type, attributes, opset=opset).astype(np.float16)
    assert_same_values(got, expected, "float16")


@pytest.mark.parametrize("axis", [2, -3])
def test_axis_out_of_range_fails_at_run_time(axis: int) -> None:
    """The rank is only known at run time; a bad axis must fail there rather than be wrapped."""
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail):
        qdq(np.ones((1, 32), np.float32), BFP, {**MX9, "axis": axis})


@pytest.mark.parametrize("shape", [(0,), (0, 16), (2, 0, 3)])
def test_empty_tensors(shape: tuple[int, ...]) -> None:
    assert qdq(np.zeros(shape, np.float32), BFP, MX9).shape == shape


def test_one_element_and_rank_1() -> None:
    assert_same_values(qdq(np.array([0.3], np.float32), BFP, MX9), np.array([0.3], np.float32), "one element")
    x = np.linspace(-3, 3, 21, dtype=np.float32)
    assert_same_values(qdq(x, BFP, {**BFP16, "axis": 5}), qdq(x, BFP, {**BFP16, "axis": 0}), "rank 1 ignores axis")


# ---------------------------------------------------------------- the model transformation


def test_bad_attributes_raise() -> None:
    cases = [
        (MX, {"element_dtype": "fp5"}, ["element_dtype", "fp5", "fp4_e2m1"]),
        (BFP, {"rounding_mode": 3}, ["rounding_mode", "(0, 1, 2)"]),
        (BFP, {"bfp_method": "to_mx"}, ["bfp_method", "to_bfp_prime"]),
        (BFP, {**MX9, "sub_block_size": 3}, ["sub_block_size", "divide"]),
        (BFP, {"blocksize": 8}, ["blocksize", "block_size"]),
        (BFP, {"bit_width": "16"}, ["bit_width", "int"]),
        ("FooQuantizeDequantize", {}, ["FooQuantizeDequantize", BFP]),
    ]
    for op_type, attributes, words in cases:
        with pytest.raises(ValueError) as error:
            attach_custom_ops(one_node_model(op_type, attributes, QUARK_DOMAIN))
        for word in ["'qdq'", *words]:
            assert word in str(error.value), (word, str(error.value))


def test_absent_attributes_take_amd_quarks_defaults() -> None:
    """Quark documents one default set for both BFP methods (block 8) and rounding 0 for MX."""
    prime = attach_custom_ops(one_node_model(BFP, {"bfp_method": "to_bfp_prime"}, QUARK_DOMAIN))
    assert prime.graph.node[0].overload == "to_bfp_prime_bw16_b8_sb2_sbs1_ax1_rm0"
    assert attach_custom_ops(one_node_model(BFP, {})).graph.node[0].overload == "to_bfp_bw16_b8_ax1_rm0"
    assert attach_custom_ops(one_node_model(MX, {})).graph.node[0].overload == "int8_b32_ax1_rm0"


def test_opset_below_13_raises() -> None:
    with pytest.raises(ValueError, match="opset >= 13"):
        attach_custom_ops(one_node_model(BFP, BFP16, opset=12))


def test_input_model_is_untouched_and_attaching_is_idempotent() -> None:
    model = one_node_model(MX, {"element_dtype": "int8"}, QUARK_DOMAIN, shape=["n", "c"])
    before = model.SerializeToString()
    once = attach_custom_ops(model)
    assert model.SerializeToString() == before
    assert attach_custom_ops(once) == once
    onnx.checker.check_model(once, full_check=True)
    assert once.ir_version == 10
    assert {(o.domain, o.version) for o in once.opset_import} == {("", 17), (QUARK_DOMAIN, 1)}
    (function,) = once.functions
    assert function.overload == once.graph.node[0].overload == "int8_b32_ax1_rm0"
    assert {n.domain for n in function.node} == {""}


def test_same_attributes_share_one_function_per_domain() -> None:
    nodes = [
        helper.make_node(BFP, ["x"], ["a"], domain=QUARK_DOMAIN, **MX9),
        helper.make_node(BFP, ["a"], ["b"], domain=QUARK_DOMAIN, **MX9),
        helper.make_node(BFP, ["b"], ["c"], domain=CUSTOM_DOMAIN, **MX9),
        helper.make_node(BFP, ["c"], ["y"], domain=CUSTOM_DOMAIN, **BFP16),
    ]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "xy"]
    graph = helper.make_graph(nodes, "g", info[:1], info[1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    attached = attach_custom_ops(model)
    assert sorted((f.domain, f.overload) for f in attached.functions) == sorted([
        (CUSTOM_DOMAIN, "to_bfp_bw16_b8_ax1_rm0"),
        (CUSTOM_DOMAIN, "to_bfp_prime_bw16_b16_sb2_sbs1_ax1_rm2"),
        (QUARK_DOMAIN, "to_bfp_prime_bw16_b16_sb2_sbs1_ax1_rm2"),
    ])
    x = np.random.default_rng(5).standard_normal((2, 32)).astype(np.float32)
    expected = qdq(qdq(qdq(qdq(x, BFP, MX9), BFP, MX9), BFP, MX9), BFP, BFP16)
    assert_same_values(run(model, {"x": x})[0], expected, "chain")


def test_nodes_inside_subgraphs_get_bodies() -> None:
    branch = helper.make_graph(
        [helper.make_node(BFP, ["x"], ["z"], domain=QUARK_DOMAIN, **MX9)], "branch", [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
    )
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)]
    inputs = [
        helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 8
    x = np.random.default_rng(6).standard_normal((2, 32)).astype(np.float32)
    assert_same_values(run(model, {"c": np.array(True), "x": x})[0], qdq(x, BFP, MX9), "subgraph")


# ---------------------------------------------------------------- ExtendedQuantizeLinear / ExtendedDequantizeLinear


def linear_model(
    zero_point: np.ndarray | None, scale: np.ndarray, axis: int = 1, domain: str = QUARK_DOMAIN
) -> onnx.ModelProto:
    """x -> ExtendedQuantizeLinear -> q (as float32 for inspection) -> ExtendedDequantizeLinear -> y."""
    initializers = [numpy_helper.from_array(scale, "s")]
    qdq_inputs = ["s"]
    if zero_point is not None:
        initializers.append(numpy_helper.from_array(zero_point, "zp"))
        qdq_inputs.append("zp")
    nodes = [
        helper.make_node("ExtendedQuantizeLinear", ["x", *qdq_inputs], ["q"], name="q", domain=domain, axis=axis),
        helper.make_node("Cast", ["q"], ["codes"], to=TensorProto.DOUBLE),
        helper.make_node("ExtendedDequantizeLinear", ["q", *qdq_inputs], ["y"], name="dq", domain=domain, axis=axis),
    ]
    outputs = [
        helper.make_tensor_value_info("codes", TensorProto.DOUBLE, None),
        helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def broadcast(parameter: np.ndarray, rank: int, axis: int) -> np.ndarray:
    """A per-axis parameter shaped to broadcast along axis."""
    return parameter.reshape([-1] + [1] * (rank - 1 - axis % rank)) if parameter.ndim else parameter


@pytest.mark.parametrize("level", ["disable", "all"])
@pytest.mark.parametrize("dtype, zero_point, axis", [
    (np.int32, np.array(-7, np.int32), 1),
    (np.int32, np.array([3, -2**31 + 5, 2**31 - 9], np.int32), 1),
    (np.uint32, np.array([0, 2**31, 2**32 - 2], np.uint32), -1),
    (np.int8, np.array(3, np.int8), 1),
])
def test_integer_codes(dtype: type, zero_point: np.ndarray, axis: int, level: str) -> None:
    x = np.random.default_rng(7).standard_normal((2, 3, 3)).astype(np.float32) * 50
    x[0, :, 0] = [2.5, -3.5, 1e30]  # ties and far beyond the range
    scale = np.array([0.5, 1e-6, 2.0], np.float32) if zero_point.ndim else np.array(0.25, np.float32)
    codes, y = run(linear_model(zero_point, scale, axis), {"x": x}, level)
    s, zp = broadcast(scale, 3, axis), broadcast(zero_point, 3, axis).astype(np.int64)
    info = np.iinfo(dtype)
    expected = np.clip(np.rint(x / s).astype(np.float64) + zp, info.min, info.max).astype(np.int64)
    np.testing.assert_array_equal(codes, expected.astype(np.float64))
    assert_same_values(y, ((expected - zp).astype(np.float32) * s).astype(np.float32), f"{dtype.__name__} dq")


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_float_codes_saturate(dtype: type) -> None:
    x = np.array([[1.0, -2.5, 3.3e38, -np.inf, np.nan, 1e-3, 65519.0, 70000.0]], np.float32)
    scale, zero_point = np.array(0.5, np.float32), np.array(1.5, dtype)
    codes, y = run(linear_model(zero_point, scale), {"x": x})
    largest = float(ml_dtypes.finfo(dtype).max)
    with np.errstate(over="ignore", invalid="ignore"):
        shifted = (x / scale + np.float32(zero_point)).astype(np.float32)
        saturated = np.where(np.abs(shifted) > largest, np.sign(shifted) * np.float32(largest), shifted)
    expected = saturated.astype(dtype).astype(np.float32)
    assert_same_values(codes.astype(np.float32), expected, f"{dtype.__name__} codes")
    assert_same_values(y, ((expected - np.float32(zero_point)) * scale).astype(np.float32), f"{dtype.__name__} dq")


def test_missing_zero_point_gives_uint8() -> None:
    x = np.array([[-1.0, 0.4, 0.6, 200.0, 1000.0]], np.float32)
    model = linear_model(None, np.array(1.0, np.float32), domain=CUSTOM_DOMAIN)
    codes, y = run(model, {"x": x})
    np.testing.assert_array_equal(codes, [[0, 0, 1, 200, 255]])
    assert_same_values(y, np.array([[0, 0, 1, 200, 255]], np.float32), "uint8 dq")
    assert attach_custom_ops(model).graph.node[0].overload == "uint8_ax1_nozp"


def test_unknown_zero_point_type_raises() -> None:
    node = helper.make_node("ExtendedQuantizeLinear", ["x", "s", "zp"], ["y"], name="q", domain=QUARK_DOMAIN)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ["x", "s"]]
    graph = helper.make_graph([node], "g", inputs + [helper.make_tensor_value_info("zp", TensorProto.DOUBLE, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(ValueError, match="'q'.*zero_point type='DOUBLE'.*INT32"):
        attach_custom_ops(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_extended_qdq_keeps_a_scalar_input_scalar() -> None:
    """A per-tensor scale must not give a rank-0 input a dimension."""
    zero_point = numpy_helper.from_array(np.zeros((), ml_dtypes.bfloat16), "zp")
    nodes = [helper.make_node("ExtendedQuantizeLinear", ["x", "s", "zp"], ["q"], domain=CUSTOM_DOMAIN),
             helper.make_node("ExtendedDequantizeLinear", ["q", "s", "zp"], ["y"], domain=CUSTOM_DOMAIN)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(np.array(1.0, np.float32), "s"), zero_point])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    y = run(model, {"x": np.array(1.00390625, np.float32)})[0]
    assert y.shape == () and y == np.float32(1.0)
