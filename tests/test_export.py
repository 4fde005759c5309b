"""Round trips: lift, change every trainable parameter, export into the original graph, and check
that onnxruntime on the exported model computes what the torch module computes."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from finetune.export import export_model
from finetune.lift import lift_model
from finetune.onnx import CUSTOM_DOMAIN, QUARK_DOMAIN

from .lift_helpers import (
    CNN_INPUT,
    ENCODER_INPUT,
    FLOAT_ATOL,
    FLOAT_RTOL,
    ResidualCNN,
    assert_same,
    export_dynamo,
    export_legacy,
    onnx_model,
    random_input,
    randomized,
    run_ort,
    run_torch,
    tensor,
    transformer_encoder,
)
from .test_lift_qdq import assert_within_one_step, output_step, quantize_with_onnxruntime


def _perturb(module: torch.nn.Module, relative: float = 0.05, seed: int = 0) -> None:
    """Change every trainable parameter by a random relative amount."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1 + relative * torch.randn(p.shape, generator=generator))


def _topology(model: onnx.ModelProto) -> list[tuple]:
    """Nodes and initializers without tensor values: what export must keep."""
    nodes = [(n.op_type, n.domain, n.name, tuple(n.input), tuple(n.output)) for n in model.graph.node]
    tensors = [(t.name, t.data_type, tuple(t.dims)) for t in model.graph.initializer]
    return nodes + tensors


def _round_trip(original: onnx.ModelProto, inputs: list[np.ndarray]) -> tuple[torch.nn.Module, onnx.ModelProto]:
    """Lift, perturb, export; checks the topology is unchanged and the original untouched."""
    before = original.SerializeToString()
    module = lift_model(original)
    _perturb(module)
    exported = export_model(module, original)
    assert original.SerializeToString() == before
    assert _topology(exported) == _topology(original)
    owned = copy.deepcopy(original)  # a tuning run's own copy: written into, the same bytes
    assert export_model(module, owned, in_place=True) is owned and owned.SerializeToString() == exported.SerializeToString()
    assert not np.allclose(run_ort(exported, inputs)[0], run_ort(original, inputs)[0])
    return module, exported


@pytest.mark.parametrize(
    ("name", "exporter", "opset"),
    [("cnn", export_legacy, 13), ("cnn", export_dynamo, 21), ("encoder", export_legacy, 17), ("encoder", export_dynamo, 18)],
)
def test_float_model_round_trip(name: str, exporter, opset: int, tmp_path: Path) -> None:
    """Conv, Gemm and MatMul weights written back as float initializers."""
    factory, shape = {"cnn": (ResidualCNN, CNN_INPUT), "encoder": (transformer_encoder, ENCODER_INPUT)}[name]
    original = exporter(randomized(factory()), shape, opset, tmp_path / "model.onnx")
    inputs = [random_input(shape, seed=5)]
    module, exported = _round_trip(original, inputs)
    assert_same(exported, module, inputs, FLOAT_ATOL, FLOAT_RTOL)


def test_onnxruntime_quantized_model_round_trip(tmp_path: Path) -> None:
    """Tuned weights go back as int8 / int32 codes of the original scales; onnxruntime on the
    exported model matches the torch module within one output code step (summation order)."""
    _, original = quantize_with_onnxruntime(tmp_path)
    inputs = [random_input((3, *CNN_INPUT[1:]), seed=4)]
    module, exported = _round_trip(original, inputs)
    assert_within_one_step(run_ort(exported, inputs)[0], run_torch(module, inputs)[0], output_step(exported))
    written = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    for name, source in module.finetune_params.items():
        np.testing.assert_array_equal(written[source.initializer], source.transform.encode(module.get_parameter(name)))


def _custom_op_model() -> onnx.ModelProto:
    """Float weights behind quantize-dequantize nodes: BFP (com.amd.quark) on a Conv weight, MX
    (com.finetune) on its input, an int8 Q→DQ pair on a MatMul weight and on the activation."""
    rng = np.random.default_rng(3)
    mk = helper.make_node
    nodes = [
        mk("MXQuantizeDequantize", ["x"], ["xq"], name="x.mx", domain=CUSTOM_DOMAIN, element_dtype="fp8_e4m3", block_size=4),
        mk("BFPQuantizeDequantize", ["w"], ["wq"], name="w.bfp", domain=QUARK_DOMAIN, block_size=8),
        mk("Conv", ["xq", "wq", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        mk("Flatten", ["c"], ["f"], name="flatten"),
        mk("QuantizeLinear", ["m", "ms", "mz"], ["mq"], name="m.q", axis=1),
        mk("DequantizeLinear", ["mq", "ms", "mz"], ["md"], name="m.dq", axis=1),
        mk("MatMul", ["f", "md"], ["y"], name="fc"),
    ]
    initializers = {
        "w": rng.standard_normal((4, 8, 3, 3)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
        "m": rng.standard_normal((64, 5)).astype(np.float32) * 0.1, "ms": np.full(5, 0.002, np.float32),
        "mz": np.zeros(5, np.int8),
    }
    domains = [CUSTOM_DOMAIN, QUARK_DOMAIN]
    return onnx_model(nodes, [tensor("x", ["batch", 8, 4, 4])], [tensor("y", None)], initializers, 13, domains)


def test_custom_op_model_round_trip() -> None:
    """Float weights behind BFP / Q→DQ are written as floats; the exported model carries the
    function bodies of our com.finetune ops, keeps AMD Quark's node as Quark wrote it (bodies with
    attach_ops, the same weights), and matches the torch module up to summation order."""
    original = _custom_op_model()
    inputs = [random_input((2, 8, 4, 4), seed=2)]
    module, exported = _round_trip(original, inputs)
    assert {f.name for f in exported.functions} == {"MXQuantizeDequantize"}
    quark_node = next(n for n in exported.graph.node if n.domain == QUARK_DOMAIN)
    assert quark_node == next(n for n in original.graph.node if n.domain == QUARK_DOMAIN)
    attached = export_model(module, original, attach_ops=True)
    assert {f.name for f in attached.functions} == {"MXQuantizeDequantize", "BFPQuantizeDequantize"}
    assert list(attached.graph.initializer) == list(exported.graph.initializer)
    assert_same(exported, module, inputs, FLOAT_ATOL, FLOAT_RTOL)
    assert_same(attached, module, inputs, FLOAT_ATOL, FLOAT_RTOL)
    assert {s.quantizer for s in module.finetune_params.values()} == {"w/bfp", "m/dq", None}


def test_constant_and_constant_of_shape_weights_round_trip() -> None:
    """A weight in a Constant node is rewritten in place; a ConstantOfShape bias becomes a
    Constant node of the new values at the same position."""
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32)
    mk = helper.make_node
    nodes = [
        mk("Constant", [], ["w"], name="w.const", value=numpy_helper.from_array(w, "w")),
        mk("Constant", [], ["shape"], name="shape.const", value=numpy_helper.from_array(np.array([4], np.int64), "shape")),
        mk("ConstantOfShape", ["shape"], ["b"], name="b.fill", value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])),
        mk("Conv", ["x", "w", "b"], ["y"], name="conv"),
    ]
    original = onnx_model(nodes, [tensor("x", ["batch", 3, 5, 5])], [tensor("y", None)])
    module = lift_model(original)
    _perturb(module)
    exported = export_model(module, original)
    assert [n.op_type for n in exported.graph.node] == ["Constant", "Constant", "Constant", "Conv"]
    assert_same(exported, module, [random_input((2, 3, 5, 5))], FLOAT_ATOL, FLOAT_RTOL)


def test_deep_copy_keeps_the_parameter_map() -> None:
    """Fine-tuning code may deep-copy the module; the copy still exports."""
    original = _custom_op_model()
    module = lift_model(original)
    copied = copy.deepcopy(module)
    assert copied.finetune_params == module.finetune_params
    _perturb(copied)
    assert_same(export_model(copied, original), copied, [random_input((2, 8, 4, 4))], FLOAT_ATOL, FLOAT_RTOL)


def test_a_changed_quantizer_scale_is_written_with_its_codes(tmp_path: Path) -> None:
    """A weight scale changed in torch (as learn_scales changes it) goes into the graph's scale
    initializer and the weight's int8 codes are re-encoded with it: onnxruntime computes what the
    module computes."""
    _, original = quantize_with_onnxruntime(tmp_path)
    module = lift_model(original)
    source = next(s for s in module.finetune_params.values() if s.quantizer and s.transform is not None)
    module.get_submodule(source.quantizer).scale.mul_(2)
    exported = export_model(module, original)
    assert_same(exported, module, [random_input(CNN_INPUT)], FLOAT_ATOL, FLOAT_RTOL)
    assert _topology(exported) == _topology(original)
