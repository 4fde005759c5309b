"""Quantized token tables (issue 44): a Gather's constant [vocabulary, width] table gets one scale per
row (token) and blocks along the width, onnxruntime runs the model, the lifted module agrees with it,
the codes are the format's rounding of the float table, AdaQuant leaves them alone, and a Gather of
computed data stays float with a warning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from finetune.config import FastFinetune
from finetune.lift import lift_model
from finetune.lift.agreement import agrees
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.zoo_decoder import DecoderShape, decoder_feeds, export_decoder

from .lift_helpers import onnx_model, run_ort, run_torch, tensor
from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)

SHAPE = DecoderShape()
TABLE = "embed_tokens.weight"
INT8_ROWS = {"format": "int", "dtype": "int8", "symmetric": True, "granularity": "channel"}
INT4_G32 = {"format": "int", "dtype": "int4", "symmetric": True, "granularity": "block", "block_size": 32}


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded tiny decoder, TorchScript export without a cache (its LM head is a separate, untied weight)."""
    return export_decoder(tmp_path_factory.mktemp("table") / "decoder.onnx", cache=False, dynamo=False)


def table_config(weight: dict) -> dict:
    """`weight` on the layers and, by an op-type override, on the Gather's token table, stored as
    integer codes (weight_storage: compact), so that the codes are the model's initializers."""
    return {"weight": weight, "op_type_overrides": {"Gather": {"weight": weight}}, "weight_storage": "compact"}


def table_codes(model: onnx.ModelProto) -> tuple[np.ndarray, np.ndarray, dict]:
    """(codes, scale, attributes) of the DequantizeLinear feeding the token table's Gather."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[0] not in inits and "embed" in n.name)
    dq = next(n for n in model.graph.node if n.output[0] == gather.input[0])
    assert dq.op_type == "DequantizeLinear"
    return inits[dq.input[0]], inits[dq.input[1]], {a.name: helper.get_attribute_value(a) for a in dq.attribute}


@pytest.mark.parametrize(("weight", "scale_shape", "attributes"), [
    (INT8_ROWS, (SHAPE.vocabulary,), {"axis": 0}),
    (INT4_G32, (SHAPE.vocabulary, SHAPE.width // 32), {"axis": 1, "block_size": 32}),
], ids=["int8-rows", "int4-g32"])
def test_the_token_table_is_quantized_per_row_and_lifts_within_the_bound(export: Path, weight: dict, scale_shape: tuple,
                                                                         attributes: dict) -> None:
    """One scale per token (INT8) or per 32 columns of a token (INT4): the codes are the table divided by
    its scale, rounded to nearest and clipped (one division: exact), onnxruntime runs the model and the
    lifted module's logits are within float rounding of onnxruntime's."""
    feeds = decoder_feeds(False, 2)
    quantized = quantize_model(export, table_config(weight), feeds).model
    codes, scale, found = table_codes(quantized)
    assert scale.shape == scale_shape and found == attributes
    table = numpy_helper.to_array(next(t for t in onnx.load(export).graph.initializer if t.name == TABLE))
    wide = scale[:, None] if scale.ndim == 1 else np.repeat(scale, 32, axis=1)
    limit = 127 if weight["dtype"] == "int8" else 7
    assert np.array_equal(codes.astype(np.int32), np.clip(np.rint(table / wide), -limit - 1, limit).astype(np.int32))
    inputs = [feeds[0][i.name] for i in quantized.graph.input]
    assert all(agrees(a, e, exact=False) for a, e in zip(run_torch(lift_model(quantized), inputs), run_ort(quantized, inputs)))


def test_adaquant_leaves_the_table_codes_as_written(export: Path) -> None:
    """The table is no tunable layer: a few AdaQuant steps change layer weights, not the table's codes."""
    feeds = decoder_feeds(False, 4)
    quantized = quantize_model(export, table_config(INT4_G32), feeds).model
    config = FastFinetune(algorithm="adaquant", iterations=4, batch_size=2, validation_share=0)
    tuned, _ = finetune_model(quantized, feeds, config, float_model=export)
    before, after = table_codes(quantized), table_codes(tuned)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    changed = [a.name for a, b in zip(tuned.graph.initializer, quantized.graph.initializer) if a.raw_data != b.raw_data]
    assert changed


def test_computed_data_is_an_activation_and_a_table_read_along_its_width_stays_float() -> None:
    """Relu(x) gathered by rows is an activation: quantized as any other, no warning. A constant table
    gathered along axis 1 has no rows to scale: it stays float, named in the warnings."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Gather", ["r", "i"], ["g"], name="rows"),
             helper.make_node("Gather", ["t", "i"], ["c"], name="columns", axis=1),
             helper.make_node("MatMul", ["g", "c"], ["y"])]
    model = onnx_model(nodes, [tensor("x", [4, 3]), tensor("i", [2], onnx.TensorProto.INT64)], [tensor("y", [2, 2])],
                       {"t": rng.standard_normal((3, 4)).astype(np.float32)})
    feeds = [{"x": np.ones((4, 3), np.float32), "i": np.array([0, 2])}]
    activation = {"format": "int", "dtype": "int8", "symmetric": False}
    config = {"activation": activation, "weight": INT8_ROWS, "op_types": ["Gather", "MatMul"]}
    result = quantize_model(model, config, feeds)
    assert [w["node"] for w in result.summary["warnings"] if "node" in w] == ["columns"]
    gathers = {n.name: n for n in result.model.graph.node if n.op_type == "Gather"}
    producers = {output: n for n in result.model.graph.node for output in n.output}
    assert producers[gathers["rows"].input[0]].op_type == "DequantizeLinear"
    assert gathers["columns"].input[0] == "t"
