"""Single ops that onnx2torch lacks or gets wrong, lifted and compared with onnxruntime: padding
rules, newer op versions, inference-mode normalisation, dynamic batch, missing shapes, constants."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from finetune.lift import LiftError, lift_model

from .lift_helpers import FLOAT_ATOL, FLOAT_RTOL, assert_same, onnx_model, random_input, tensor

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
B = RNG.standard_normal((4,)).astype(np.float32)
WT = RNG.standard_normal((3, 2, 3, 3)).astype(np.float32)


def _one_node(
    op_type: str,
    inputs: list[str],
    attributes: dict[str, Any],
    initializers: dict[str, np.ndarray],
    shape: tuple[int, ...],
    opset: int,
    outputs: int = 1,
) -> tuple[Any, list[np.ndarray]]:
    """A model of one node reading the graph input `x` and initializers, with a random input."""
    names = [f"y{i}" for i in range(outputs)]
    node = helper.make_node(op_type, inputs, names, name=f"the.{op_type}", **attributes)
    model = onnx_model([node], [tensor("x", ["batch", *shape[1:]])], [tensor(n, None) for n in names], initializers, opset)
    return model, [random_input(shape)]


CONV_CASES = {
    "same_upper_stride2": ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (2, 3, 9, 8)),
    "same_lower_stride2": ({"auto_pad": "SAME_LOWER", "strides": [2, 2]}, (2, 3, 9, 8)),
    "same_upper_stride3": ({"auto_pad": "SAME_UPPER", "strides": [3, 3]}, (1, 3, 7, 6)),
    "asymmetric_pads": ({"pads": [0, 1, 2, 0], "strides": [1, 2]}, (1, 3, 7, 6)),
    "valid": ({"auto_pad": "VALID"}, (1, 3, 7, 6)),
}


@pytest.mark.parametrize("opset", [13, 22])
@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_padding(case: str, opset: int) -> None:
    """Conv (Conv-22 too) with auto_pad SAME_*, VALID and asymmetric pads; weights become parameters."""
    attributes, shape = CONV_CASES[case]
    model, inputs = _one_node("Conv", ["x", "w", "b"], attributes, {"w": W, "b": B}, shape, opset)
    module = lift_model(model)
    assert_same(model, module, inputs, FLOAT_ATOL, FLOAT_RTOL)
    assert {s.initializer for s in module.finetune_params.values()} == {"w", "b"}


CONV_TRANSPOSE_CASES = {
    "asymmetric_pads": {"strides": [2, 2], "pads": [0, 1, 1, 0]},
    "output_padding": {"strides": [2, 2], "output_padding": [1, 0], "pads": [1, 0, 0, 1]},
    "output_shape": {"strides": [2, 2], "output_shape": [10, 9]},
    "same_upper": {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
    "same_lower": {"strides": [2, 2], "auto_pad": "SAME_LOWER"},
    "dilated": {"strides": [2, 2], "dilations": [2, 1], "pads": [1, 1, 2, 0]},
}


@pytest.mark.parametrize("case", sorted(CONV_TRANSPOSE_CASES))
def test_conv_transpose_padding(case: str) -> None:
    """ConvTranspose cropped by asymmetric, output_shape and auto_pad pads as onnxruntime does."""
    weights = {"w": WT, "b": B[:2]}
    model, inputs = _one_node("ConvTranspose", ["x", "w", "b"], CONV_TRANSPOSE_CASES[case], weights, (1, 3, 5, 4), 13)
    assert_same(model, lift_model(model), inputs, FLOAT_ATOL, FLOAT_RTOL)


POOL_CASES = {
    "max_same_upper": ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, 12),
    "max_asymmetric": ("MaxPool", {"kernel_shape": [2, 3], "pads": [1, 0, 0, 2]}, 12),
    "max_dilated_ceil": ("MaxPool", {"kernel_shape": [2, 2], "dilations": [2, 2], "ceil_mode": 1, "strides": [2, 2]}, 12),
    "avg_asymmetric_exclude_pad": ("AveragePool", {"kernel_shape": [3, 3], "pads": [0, 1, 2, 1]}, 11),
    "avg_asymmetric_include_pad": ("AveragePool", {"kernel_shape": [3, 3], "pads": [0, 1, 2, 1], "count_include_pad": 1}, 11),
    "avg_same_lower": ("AveragePool", {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_LOWER"}, 19),
    "avg_symmetric_v22": ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}, 22),
}


@pytest.mark.parametrize("case", sorted(POOL_CASES))
def test_pooling(case: str) -> None:
    """Pooling with auto_pad, asymmetric pads (average excludes or counts the padding as asked)."""
    op_type, attributes, opset = POOL_CASES[case]
    model, inputs = _one_node(op_type, ["x"], attributes, {}, (2, 3, 9, 8), opset)
    assert_same(model, lift_model(model), inputs, FLOAT_ATOL, FLOAT_RTOL)


@pytest.mark.parametrize("opset", [13, 22])
def test_global_max_pool(opset: int) -> None:
    """GlobalMaxPool (GlobalMaxPool-22 too), which onnx2torch lacks."""
    model, inputs = _one_node("GlobalMaxPool", ["x"], {}, {}, (2, 3, 5, 4), opset)
    assert_same(model, lift_model(model), inputs)


def test_dropout_of_opset_7_is_identity() -> None:
    """An opset-7 Dropout (is_test era) lifts after the opset upgrade and passes values through."""
    model, inputs = _one_node("Dropout", ["x"], {"ratio": 0.3}, {}, (2, 3), 7)
    module = lift_model(model)
    module.train()
    assert_same(model, module, inputs)


@pytest.mark.parametrize("opset", [12, 22])
def test_dropout_with_training_mode_false_is_identity(opset: int) -> None:
    """A Dropout-12+ whose training_mode is a constant false (as exporters write it) lifts to the identity."""
    model, inputs = _one_node("Dropout", ["x", "ratio", "mode"], {}, {"ratio": np.float32(0.3), "mode": np.bool_(False)},
                              (2, 3), opset)
    assert_same(model, lift_model(model), inputs)


def test_dropout_that_drops_values_is_refused() -> None:
    """A Dropout whose training_mode is true, or computed (here a graph input), would drop values:
    not lifted, with an error naming the node."""
    model, _ = _one_node("Dropout", ["x", "ratio", "mode"], {}, {"ratio": np.float32(0.3), "mode": np.bool_(True)}, (2, 3), 13)
    with pytest.raises(LiftError, match=r"'the\.Dropout' \(ai\.onnx::Dropout, opset 13\).*training_mode is true"):
        lift_model(model)
    node = helper.make_node("Dropout", ["x", "", "mode"], ["y0"], name="the.Dropout")
    computed = onnx_model([node], [tensor("x", ["batch", 3]), tensor("mode", [], TensorProto.BOOL)], [tensor("y0", None)], {}, 13)
    with pytest.raises(LiftError, match=r"'the\.Dropout'.*training_mode 'mode' is computed"):
        lift_model(computed)


def test_batch_norm_stays_in_inference_mode() -> None:
    """BatchNormalization uses running statistics even while the module trains."""
    c = 3
    stats = {"s": RNG.random(c, np.float32) + 0.5, "b": RNG.standard_normal(c).astype(np.float32),
             "m": RNG.standard_normal(c).astype(np.float32), "v": RNG.random(c, np.float32) + 0.5}
    model, inputs = _one_node("BatchNormalization", ["x", "s", "b", "m", "v"], {"epsilon": 1e-3}, stats, (4, c, 5), 15)
    module = lift_model(model).train()
    assert_same(model, module, inputs, FLOAT_ATOL, FLOAT_RTOL)


CAST_CASES = {
    "bfloat16_v13": (TensorProto.BFLOAT16, {}, 13),
    "float8e4m3fn_saturate_v19": (TensorProto.FLOAT8E4M3FN, {}, 19),
    "float8e5m2_no_saturate_v21": (TensorProto.FLOAT8E5M2, {"saturate": 0}, 21),
    "float16_v21": (TensorProto.FLOAT16, {}, 21),
}


@pytest.mark.parametrize("case", sorted(CAST_CASES))
def test_cast_round_trip(case: str) -> None:
    """float → narrow type → float (Cast-19/21 included), saturating fp8 where asked, exactly."""
    to, attributes, opset = CAST_CASES[case]
    nodes = [
        helper.make_node("Cast", ["x"], ["narrow"], name="down", to=to, **attributes),
        helper.make_node("Cast", ["narrow"], ["y"], name="up", to=TensorProto.FLOAT),
    ]
    model = onnx_model(nodes, [tensor("x", [2, 6])], [tensor("y", None)], opset=opset)
    x = np.array([[0.1, -3.3, 500.0, -70000.0, np.inf, np.nan], [1e-9, 2.5, -448.0, 57344.5, 3.0e38, -0.0]], np.float32)
    assert_same(model, lift_model(model), [x])


REDUCE_CASES = {
    "mean_axes": ("ReduceMean", [1, -1], {}),
    "max_keepdims0": ("ReduceMax", [0, 2], {"keepdims": 0}),
    "min_all": ("ReduceMin", None, {}),
    "prod_axes": ("ReduceProd", [1, 2], {"keepdims": 0}),
    "l1": ("ReduceL1", [2], {}),
    "l2": ("ReduceL2", [1], {}),
    "logsumexp": ("ReduceLogSumExp", [0, 1], {}),
    "sumsquare": ("ReduceSumSquare", [2], {"keepdims": 0}),
    "noop_empty": ("ReduceMean", None, {"noop_with_empty_axes": 1}),
    "noop_l1": ("ReduceL1", None, {"noop_with_empty_axes": 1}),
    "noop_l2_empty_name": ("ReduceL2", "", {"noop_with_empty_axes": 1}),
    "noop_logsum": ("ReduceLogSum", None, {"noop_with_empty_axes": 1}),
    "noop_sumsquare": ("ReduceSumSquare", "", {"noop_with_empty_axes": 1}),
    "all_empty_name": ("ReduceL2", "", {}),
}


@pytest.mark.parametrize("case", sorted(REDUCE_CASES))
def test_reduce_18(case: str) -> None:
    """Reduce*-18 with axes as an input, left off or omitted (""), keepdims and noop_with_empty_axes
    (which reduces each element alone: ReduceL2 gives sqrt(x * x), ReduceLogSum log(x))."""
    op_type, axes, attributes = REDUCE_CASES[case]
    initializers = {"axes": np.array(axes, np.int64)} if axes else {}
    names = ["x"] + (["axes"] if axes else [""] if axes == "" else [])
    model, inputs = _one_node(op_type, names, attributes, initializers, (2, 3, 4), 18)
    assert_same(model, lift_model(model), inputs, FLOAT_ATOL, FLOAT_RTOL)


CUMSUM_CASES = {"default": {}, "exclusive": {"exclusive": 1}, "reverse": {"reverse": 1},
                "exclusive_reverse": {"exclusive": 1, "reverse": 1}}


@pytest.mark.parametrize("opset", [11, 14])
@pytest.mark.parametrize("case", sorted(CUMSUM_CASES))
def test_cumsum_attributes_default_off(case: str, opset: int) -> None:
    """CumSum with exclusive and reverse each off unless set (torch.onnx's TorchScript exporter
    writes torch.cumsum with neither), along a negative axis. torch accumulates a float32 cumsum in
    float64 on the CPU and onnxruntime in float32, so they agree within the float32 bound of a sum
    of 5 terms (5 eps times the sum of magnitudes), not exactly."""
    model, inputs = _one_node("CumSum", ["x", "axis"], CUMSUM_CASES[case], {"axis": np.array(-1, np.int64)}, (2, 3, 5), opset)
    bound = 5 * np.finfo(np.float32).eps * float(np.abs(inputs[0]).sum(-1).max())
    assert_same(model, lift_model(model), inputs, atol=bound)


@pytest.mark.parametrize(("mode", "opset"), [("constant", 18), ("reflect", 18), ("edge", 18), ("wrap", 19)])
def test_pad_with_axes(mode: str, opset: int) -> None:
    """Pad-18 (axes input) and Pad-19 (wrap mode) with constant pads, value and axes."""
    initializers = {
        "pads": np.array([1, 2, 2, 0], np.int64), "value": np.array(1.5, np.float32), "axes": np.array([-1, 2], np.int64)
    }
    model, inputs = _one_node("Pad", ["x", "pads", "value", "axes"], {"mode": mode}, initializers, (2, 3, 4, 5), opset)
    assert_same(model, lift_model(model), inputs)


RESIZE_CASES = {  # (mode, coordinate_transformation_mode, nearest_mode, axes), scales, sizes
    "nearest_sizes": (("nearest", "asymmetric", "floor", None), None, [2, 3, 9, 7]),
    "nearest_exact_scales": (("nearest", "half_pixel", "round_prefer_ceil", None), [1, 1, 2, 1.5], None),
    "linear_half_pixel": (("linear", "half_pixel", None, None), [1, 1, 2, 2], None),
    "linear_pytorch_half_pixel_axes": (("linear", "pytorch_half_pixel", None, [2, 3]), None, [7, 11]),
    "cubic_align_corners": (("cubic", "align_corners", None, None), [1, 1, 2, 2], None),
}


@pytest.mark.parametrize("case", sorted(RESIZE_CASES))
def test_resize_18(case: str) -> None:
    """Resize-18 modes whose sampling torch reproduces, with scales, sizes and axes."""
    (mode, transform, nearest, axes), scales, sizes = RESIZE_CASES[case]
    attributes = {"mode": mode, "coordinate_transformation_mode": transform}
    attributes |= ({"nearest_mode": nearest} if nearest else {}) | ({"axes": axes} if axes else {})
    initializers = {"scales": np.array(scales, np.float32)} if scales else {"sizes": np.array(sizes, np.int64)}
    inputs = ["x", "", "scales"] if scales else ["x", "", "", "sizes"]
    model, data = _one_node("Resize", inputs, attributes, initializers, (2, 3, 4, 5), 18)
    assert_same(model, lift_model(model), data, FLOAT_ATOL, FLOAT_RTOL)


def test_resize_without_exact_torch_equivalent_raises() -> None:
    """A Resize that torch cannot reproduce is an error, not a warning."""
    scales = {"scales": np.array([1, 1, 2, 2], np.float32)}
    model, _ = _one_node("Resize", ["x", "", "scales"], {"mode": "nearest"}, scales, (1, 1, 2, 2), 18)
    with pytest.raises(LiftError, match=r"'the\.Resize' \(ai\.onnx::Resize, opset 18\).*round_prefer_floor"):
        lift_model(model)


def test_split_18_uneven() -> None:
    """Split-18 into num_outputs parts, the last one smaller; a multi-output graph gives a tuple."""
    model, inputs = _one_node("Split", ["x"], {"axis": 1, "num_outputs": 3}, {}, (2, 7), 18, outputs=3)
    assert_same(model, lift_model(model), inputs)


INT64_MAX = np.iinfo(np.int64).max
SLICE_CASES = {  # starts, ends, axes, steps; a negative step goes through onnx2torch's module
    "one_axis": ([1], [3], [1], None),
    "negative_bounds_and_axis": ([-3, 0], [-1, INT64_MAX], [-1, 1], None),
    "strided_past_the_end": ([0, 1], [100, INT64_MAX], [2, 3], [2, 3]),
    "empty": ([5], [2], [2], None),
    "all_axes_no_axes_input": ([0, 1, 0, 0], [1, 3, 4, 5], None, None),
    "reversed": ([-1], [-INT64_MAX], [3], [-1]),
}


@pytest.mark.parametrize("case", sorted(SLICE_CASES))
def test_slice_with_constant_bounds(case: str) -> None:
    """Slice-13 with constant bounds equals onnxruntime; with positive steps it is fixed indexing,
    which reads no tensor on the host per call (onnx2torch's module is left for reversals)."""
    starts, ends, axes, steps = SLICE_CASES[case]
    initializers = {"starts": np.array(starts, np.int64), "ends": np.array(ends, np.int64)}
    initializers |= ({"axes": np.array(axes, np.int64)} if axes else {}) | ({"steps": np.array(steps, np.int64)} if steps else {})
    inputs = ["x", "starts", "ends", "axes" if axes else "", "steps" if steps else ""]
    model, data = _one_node("Slice", inputs, {}, initializers, (2, 3, 4, 5), 13)
    lifted = lift_model(model)
    assert_same(model, lifted, data)
    fixed = [type(m).__name__ for m in lifted.modules()].count("Slice")
    assert fixed == (0 if min(steps or [1]) < 0 else 1)

@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_20(approximate: str) -> None:
    """Gelu-20, exact and tanh-approximated."""
    model, inputs = _one_node("Gelu", ["x"], {"approximate": approximate}, {}, (2, 9), 20)
    assert_same(model, lift_model(model), inputs, FLOAT_ATOL, FLOAT_RTOL)


def test_erf_gelu_attention_block() -> None:
    """x·W → Erf-based GELU → LayerNormalization → softmax(q kᵀ) v: MatMul weights become parameters."""
    d = 8
    weights = {name: RNG.standard_normal((d, d)).astype(np.float32) * 0.3 for name in ("wq", "wk", "wv")}
    weights |= {"sqrt2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32), "half": np.array(0.5, np.float32),
                "gamma": RNG.random(d, np.float32), "beta": RNG.standard_normal(d).astype(np.float32)}
    mk = helper.make_node
    nodes = [
        mk("MatMul", ["x", "wq"], ["q"], name="q.proj"), mk("MatMul", ["x", "wk"], ["k"], name="k.proj"),
        mk("MatMul", ["x", "wv"], ["v"], name="v.proj"),
        mk("Div", ["q", "sqrt2"], ["qs"]), mk("Erf", ["qs"], ["e"]), mk("Add", ["e", "one"], ["e1"]),
        mk("Mul", ["q", "e1"], ["g0"]), mk("Mul", ["g0", "half"], ["g"]),
        mk("LayerNormalization", ["g", "gamma", "beta"], ["n"], axis=-1, epsilon=1e-5),
        mk("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), mk("MatMul", ["n", "kt"], ["scores"]),
        mk("Softmax", ["scores"], ["p"], axis=-1), mk("MatMul", ["p", "v"], ["y"]),
    ]
    model = onnx_model(nodes, [tensor("x", ["batch", 5, d])], [tensor("y", None)], weights, opset=17)
    module = lift_model(model)
    for batch in (1, 3):
        assert_same(model, module, [random_input((batch, 5, d))], FLOAT_ATOL, FLOAT_RTOL)
    assert {s.initializer for s in module.finetune_params.values()} == {"wq", "wk", "wv"}
    assert module.finetune_params["initializers.wq"].consumers == ("q/proj",)


def test_constant_weights_and_missing_shapes() -> None:
    """Weights stored as Constant / ConstantOfShape become parameters; no value_info is needed."""
    mk = helper.make_node
    nodes = [
        mk("Constant", [], ["w"], value=helper.make_tensor("w", TensorProto.FLOAT, W.shape, W.reshape(-1))),
        mk("Constant", [], ["shape"], value=helper.make_tensor("shape", TensorProto.INT64, [1], [4])),
        mk("ConstantOfShape", ["shape"], ["b"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.25])),
        mk("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        mk("Relu", ["c"], ["y"]),
    ]
    model = onnx_model(nodes, [tensor("x", None)], [tensor("y", None)])
    module = lift_model(model)
    assert_same(model, module, [random_input((2, 3, 6, 6))], FLOAT_ATOL, FLOAT_RTOL)
    assert {s.initializer for s in module.finetune_params.values()} == {"w", "b"}


def test_dotted_custom_domain_and_unknown_op_error() -> None:
    """Dotted domains do not break module naming; an op without a converter is an error naming
    the node, its domain, op type and opset."""
    node = helper.make_node("FooBar", ["x"], ["y"], name="layer.1.foo", domain="my.custom.domain")
    model = onnx_model([node], [tensor("x", [1])], [tensor("y", [1])], domains=["my.custom.domain"])
    with pytest.raises(LiftError, match=r"'layer\.1\.foo' \(my\.custom\.domain::FooBar, opset 1\)"):
        lift_model(model)


def test_graph_outputs_that_are_inputs_or_initializers() -> None:
    """Outputs in graph order, also when one is an input or an initializer."""
    node = helper.make_node("Relu", ["x"], ["r"], name="relu")
    outputs = [tensor("r", [2]), tensor("x", [2]), tensor("c", [1])]
    model = onnx_model([node], [tensor("x", [2])], outputs, {"c": np.ones(1, np.float32)})
    r, x, c = lift_model(model)(torch.tensor([-1.0, 2.0]))
    assert r.tolist() == [0.0, 2.0] and x.tolist() == [-1.0, 2.0] and c.tolist() == [1.0]


# Gather's constant indices (scalar, negative, an array with a batch of them) along an axis.
GATHER_CASES = {
    "scalar_first": (0, np.array(1, np.int64)),
    "scalar_negative_inner": (2, np.array(-1, np.int64)),
    "array_negative": (1, np.array([2, -3, 0], np.int64)),
    "matrix_int32": (3, np.array([[0, 4], [-1, 1]], np.int32)),
}


@pytest.mark.parametrize("case", sorted(GATHER_CASES))
def test_gather_with_constant_indices(case: str) -> None:
    """Gather equals onnxruntime; a constant scalar index is a Python integer, so the module reads no
    tensor for it (onnx2torch indexed with a 0-d tensor: a host read on a GPU at every call)."""
    axis, indices = GATHER_CASES[case]
    model, data = _one_node("Gather", ["x", "indices"], {"axis": axis}, {"indices": indices}, (2, 3, 4, 5), 13)
    lifted = lift_model(model)
    assert_same(model, lifted, data)
    (gather,) = [m for m in lifted.modules() if type(m).__name__ == "Gather"]
    assert gather.index == (int(indices) if indices.ndim == 0 else None)


# Squeeze and Unsqueeze: axes as an attribute (opset 11) or a constant input (13, 21), negative ones included.
SQUEEZE_CASES = {
    "squeeze_11": ("Squeeze", 11, (2, 1, 3, 1), [1, -1]),
    "squeeze_13": ("Squeeze", 13, (2, 1, 3, 1), [-1, 1]),
    "squeeze_21_every_one": ("Squeeze", 21, (2, 1, 3, 1), None),
    "unsqueeze_11": ("Unsqueeze", 11, (2, 3), [-1, 0]),
    "unsqueeze_13_two_negative": ("Unsqueeze", 13, (2, 3, 4), [-1, -2]),
    "unsqueeze_21_ends": ("Unsqueeze", 21, (2, 3, 4), [0, 4]),
}


@pytest.mark.parametrize("case", sorted(SQUEEZE_CASES))
def test_squeeze_and_unsqueeze_hold_constant_axes(case: str) -> None:
    """Equal to onnxruntime, several negative Unsqueeze axes counted from the output's end (onnx2torch
    placed them wrongly), with constant axes held as Python integers (no tensor read per call)."""
    op, opset, shape, axes = SQUEEZE_CASES[case]
    as_input = opset >= 13 and axes is not None
    attributes = {"axes": axes} if axes is not None and not as_input else {}
    initializers = {"axes": np.array(axes, np.int64)} if as_input else {}
    model, data = _one_node(op, ["x", "axes"] if as_input else ["x"], attributes, initializers, shape, opset)
    lifted = lift_model(model)
    assert_same(model, lifted, data)
    (module,) = [m for m in lifted.modules() if type(m).__name__ == op]
    assert module.axes == (tuple(axes) if axes is not None else None)
