"""Graph optimisations before a conversion: parallel MatMuls sharing an input fuse into one
MatMul + Split with the same results up to float summation order, and constant folding.

Fusion bound. Each output element of the fused MatMul is the same dot product of length K as
before, only possibly summed in another order. Any float32 evaluation order of sum(x_i w_i) is
within gamma_(K-1) * sum|x_i w_i| of the exact value, gamma_n = n u / (1 - n u), u = 2^-24 (FMA
only removes roundings), so two orders differ by at most 2 gamma_(K-1) (|x| @ |W|) elementwise.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from finetune.onnx.fold import fold_constants
from finetune.onnx.io import load_model
from finetune.tools.optimize import fuse_parallel_matmuls

from .tools_models import attention, make_model, mk, run


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """The model with extra float32 graph outputs."""
    model = load_model(model)
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    return model


def _outputs(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))


def test_qkv_projections_fuse_into_one_matmul_and_split() -> None:
    width = 64
    model = _with_outputs(attention(width=width), ["q", "k", "v"])
    fused = load_model(model)
    assert fuse_parallel_matmuls(fused) == ["fused 1 group(s) of parallel MatMuls (3 MatMuls) into MatMul + Split"]
    ops = [(n.op_type, n.name) for n in fused.graph.node]
    assert ops[:2] == [("MatMul", "q_proj_fused_matmul"), ("Split", "q_proj_split")]
    assert not {"q_proj", "k_proj", "v_proj"} & {name for _, name in ops}
    weights = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    assert weights["q_proj_fused_weight"].shape == (width, 3 * width)
    assert not {"wq", "wk", "wv"} & set(weights)
    onnx.checker.check_model(fused, full_check=True)

    x = np.random.default_rng(3).standard_normal((2, 5, width)).astype(np.float32)
    before, after = _outputs(model, x), _outputs(fused, x)
    gamma = (width - 1) * 2.0**-24 / (1 - (width - 1) * 2.0**-24)
    original = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for name, weight in (("q", "wq"), ("k", "wk"), ("v", "wv")):
        bound = 2 * gamma * (np.abs(x).astype(np.float64) @ np.abs(original[weight]))
        assert np.all(np.abs(after[name].astype(np.float64) - before[name]) <= bound), name
    np.testing.assert_allclose(after["y"], before["y"], rtol=1e-5, atol=1e-6)
    print(f"QKV fusion: largest difference {max(np.abs(after[n] - before[n]).max() for n in 'qkvy'):.1e}")


def test_only_constant_2d_weights_of_one_type_fuse() -> None:
    """A weight fed at run time, a 3-D weight, a float16 weight and a lone MatMul stay as they are."""
    weights = {"w2": np.ones((4, 3), np.float32), "w3": np.ones((2, 4, 3), np.float32), "w16": np.ones((4, 3), np.float16)}
    nodes = [mk("MatMul", ["x", "w2"], ["a"]), mk("MatMul", ["x", "x_t"], ["b"]), mk("MatMul", ["x", "w3"], ["c"]),
             mk("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16), mk("MatMul", ["x16", "w16"], ["d"]),
             mk("Transpose", ["x"], ["x_t"], perm=[1, 0])]
    model = make_model(nodes[-1:] + nodes[:-1], [4, 4], None, weights, np.float32)
    before = model.SerializeToString()
    assert fuse_parallel_matmuls(model) == []
    assert model.SerializeToString() == before


def test_constant_subgraphs_fold_and_the_rest_stays() -> None:
    """Mul of two initializers and Shape -> Gather -> Concat of a static shape fold (float16
    values exactly as float16 arithmetic gives them); a random op and nodes writing graph outputs
    do not."""
    two, three = np.array(2.1, np.float16), np.array(3.3, np.float16)
    nodes = [mk("Mul", ["two", "three"], ["k"]), mk("Shape", ["x"], ["shape"]),
             mk("Gather", ["shape", "zero"], ["rows"], axis=0), mk("Concat", ["rows", "minus_one"], ["target"], axis=0),
             mk("Reshape", ["x", "target"], ["flat"]), mk("Mul", ["flat", "k"], ["scaled"]),
             mk("RandomNormal", [], ["noise32"], shape=[1]), mk("Cast", ["noise32"], ["noise"], to=TensorProto.FLOAT16),
             mk("Add", ["scaled", "noise"], ["y"]),
             mk("Add", ["two", "three"], ["sum"])]
    weights = {"two": two, "three": three, "zero": np.array([0], np.int64), "minus_one": np.array([-1], np.int64)}
    model = make_model(nodes, [2, 3, 4], None, weights, np.float16)
    model.graph.output.append(helper.make_tensor_value_info("sum", TensorProto.FLOAT16, []))
    changes = fold_constants(model)
    assert changes == ["folded 4 constant node(s) into initializers", "removed 4 unused initializer(s)"]
    assert [n.op_type for n in model.graph.node] == ["Reshape", "Mul", "RandomNormal", "Cast", "Add", "Add"]
    folded = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert folded["k"].dtype == np.float16 and folded["k"] == two * three
    np.testing.assert_array_equal(folded["target"], [2, -1])
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float16)
    assert run(model, x).shape == (2, 12)
    assert {t.name for t in model.graph.initializer} == {"two", "three", "k", "target"}
