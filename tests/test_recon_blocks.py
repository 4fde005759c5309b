"""Block units (unit: block): which layers form a block, that a block reads one value only, and
fast finetune over blocks on a residual CNN and a transformer encoder; partial last batches."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import helper

from finetune.config import ConfigError, FastFinetune
from finetune.lift import FakeQuantize, lift_model
from finetune.notices import Warnings
from finetune.quantize import quantize_model
from finetune.recon import cut, find_units, finetune_model
from finetune.recon.data.batches import Draw, mixed
from finetune.recon.methods.qdrop import dropped_quantization
from finetune.recon.units.blocks import MAX_BLOCK_LAYERS
from finetune.zoo import export_onnx, text_detector_onnx_path, text_recognizer_onnx_path

from .lift_helpers import (
    CNN_INPUT,
    ENCODER_INPUT,
    ResidualCNN,
    assert_same,
    onnx_model,
    randomized,
    tensor,
    transformer_encoder,
)
from .recon_helpers import assert_stream_equals_full_model, one_thread, run  # noqa: F401  (one_thread: autouse fixture)

OP_TYPES = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def feeds(shape: tuple[int, ...], sizes: tuple[int, ...] = (4, 4, 4)) -> list[dict[str, np.ndarray]]:
    return [{"x": np.random.default_rng(i).standard_normal((n, *shape[1:]), np.float32)} for i, n in enumerate(sizes)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A residual CNN and a two-layer transformer encoder with random weights, as float ONNX."""
    folder = tmp_path_factory.mktemp("blocks")
    return {name: export_onnx(randomized(factory()), torch.randn(*shape), folder / f"{name}.onnx")
            for name, factory, shape in [("cnn", ResidualCNN, CNN_INPUT), ("encoder", transformer_encoder, ENCODER_INPUT)]}


def block_units(path: Path, shape: tuple[int, ...], preset: str = "XINT8"):
    module = lift_model(quantize_model(path, preset, feeds(shape)).model)
    return module, find_units(module, OP_TYPES, unit="block")


def test_blocks_follow_the_exporters_scopes_between_single_value_cuts(models: dict[str, Path]) -> None:
    """Each residual block is one unit from the value entering it to its output; the stem reads the
    model input; the head stays alone. Each encoder layer (attention, feed-forward, both norms) is one."""
    _, units = block_units(models["cnn"], CNN_INPUT)
    assert [u.name for u in units] == ["/stem/stem", "/blocks/blocks/0", "/blocks/blocks/1", "/head/Gemm"]
    assert [[layer.name.rsplit("/", 2)[-2] for layer in u.layers] for u in units] == [
        ["0"], ["conv1", "conv2"], ["conv1", "conv2"], ["head"]]
    assert {u.op_type for u in units} == {"block"}
    assert (units[0].source, units[0].source_argument) == ("", 0)  # the model input
    assert units[1].source == "/stem/stem/3/MaxPool" and units[1].source_argument is None
    assert units[1].target_module == units[2].source == "/blocks/blocks/0/Relu_1"  # residual Add, then its ReLU
    _, units = block_units(models["encoder"], ENCODER_INPUT)
    assert [u.name for u in units] == ["/layers/0", "/layers/1"]
    assert [len(u.layers) for u in units] == [4, 4]  # in-projection, out-projection, linear1, linear2
    assert [u.target_module for u in units] == ["/layers/0/norm2/LayerNormalization", "/layers/1/norm2/LayerNormalization"]


def test_a_block_reads_only_its_entry_and_the_stream_reaches_it_exactly(models: dict[str, Path]) -> None:
    """The training module of every block has one input, and the quantized stream delivers there
    exactly what the whole quantized model computes at the block's entry."""
    batches = feeds(CNN_INPUT)
    module = lift_model(quantize_model(models["cnn"], "XINT8", batches).model)
    units = find_units(module, OP_TYPES, unit="block")
    plan = cut(module, units)
    assert [len([n for n in train.graph.nodes if n.op == "placeholder"]) for train in plan.train] == [1] * len(units)
    assert_stream_equals_full_model(module, units, batches)


def test_adaround_over_blocks_lowers_every_loss_and_exports_exactly(models: dict[str, Path]) -> None:
    """AdaRound tunes all layers of a block at once (INT4 weights, power-of-two scales): both
    residual blocks end with a lower loss, and onnxruntime computes what torch does, bit for bit."""
    batches = feeds(CNN_INPUT)
    quantized = quantize_model(models["cnn"], {"preset": "XINT8", "weight": {"dtype": "int4"}}, batches).model
    tuned, report = finetune_model(quantized, batches, FastFinetune(iterations=40, unit="block"))
    assert [(u["name"], u["op_type"]) for u in report["units"]][1:3] == [("/blocks/blocks/0", "block"), ("/blocks/blocks/1", "block")]
    assert all(u["status"] == "kept" and u["loss_after"] <= u["loss_before"] for u in report["units"])
    assert all(u["loss_after"] < 0.9 * u["loss_before"] for u in report["units"][1:3])
    assert_same(tuned, lift_model(tuned), [np.random.default_rng(9).standard_normal(CNN_INPUT, np.float32)])  # exact sums


def test_adaquant_over_transformer_blocks(models: dict[str, Path]) -> None:
    """MX4 with AdaQuant over whole encoder layers: the tuned model runs in onnxruntime and is
    closer to the float model on held-out inputs than before."""
    batches = feeds(ENCODER_INPUT, (8, 8, 8, 8))
    quantized = quantize_model(models["encoder"], "MX4", None).model
    tuned, report = finetune_model(quantized, batches, FastFinetune(algorithm="adaquant", iterations=60, unit="block"))
    assert report["kept"] == 2
    x = np.random.default_rng(7).standard_normal((16, *ENCODER_INPUT[1:]), np.float32)
    reference = run(models["encoder"], x)
    assert ((run(tuned, x) - reference) ** 2).mean() < ((run(quantized, x) - reference) ** 2).mean()


def test_a_partial_last_batch_trains_on_sequence_first_values(models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """Inside attention the exporter lays values out (tokens, batch, features); a last batch of 3
    gives those a smaller second axis. Training draws rows from the full batches, and the loss
    before and after still covers every sample; the rows left out are a warning per unit, in the
    log and the report."""
    batches = feeds(ENCODER_INPUT, (4, 4, 3))
    quantized = quantize_model(models["encoder"], "XINT8", batches).model
    with caplog.at_level(logging.WARNING):
        _, report = finetune_model(quantized, batches, FastFinetune(algorithm="adaquant", iterations=20))
    assert report["samples"] == 11 and len(report["units"]) == 8
    assert all(u["iterations"] == 20 for u in report["units"])
    sequence_first = ["/layers/0/self_attn/MatMul", "/layers/1/self_attn/MatMul"]  # the out-projections, on (5 tokens, batch, 16)
    units = [w for w in report["warnings"] if "unit" in w]  # the others: weights stored as codes, no float model
    assert [w["unit"] for w in units] == sequence_first
    assert all(w["reason"].startswith("5 of the 15 rows of its inputs (slices along their leading axis) are left out of its "
                                      "training batches") for w in units)
    assert [r.message.split(":")[0].removeprefix("unit ") for r in caplog.records if "are left out of its training" in r.message] == sequence_first


@pytest.mark.parametrize(("path", "shape"), [(text_detector_onnx_path, (1, 3, 64, 64)), (text_recognizer_onnx_path, (1, 3, 48, 64))],
                         ids=["detector", "recogniser"])
def test_paddle_models_are_not_one_block(path, shape: tuple[int, ...]) -> None:
    """PP-OCRv4's detector and recogniser (paddle2onnx names every node p2o.<Op>.<n>: one shared
    prefix, no module path) were each one block of all their layers. Now no block holds more than
    MAX_BLOCK_LAYERS, and the detector's feature-pyramid span (no single value live across it) is
    tuned layer by layer, each layer a warning."""
    module = lift_model(quantize_model(path(), "MX6", feeds(shape, (1,))).model)
    warnings = Warnings()
    units = find_units(module, OP_TYPES, unit="block", warnings=warnings)
    layers = sum(len(u.layers) for u in units)
    assert layers > 40 and len(units) > 10 and max(len(u.layers) for u in units) <= MAX_BLOCK_LAYERS
    assert len({u.name for u in units}) == len(units)  # two blocks named p2o shared their cached values
    kept_single = [w for w in warnings if "a block holds at most" in w["reason"]]
    assert len(kept_single) == (54 if path is text_detector_onnx_path else 0)


def test_the_detector_tunes_over_blocks_and_onnxruntime_runs_it() -> None:
    """PP-OCRv4's detector at MX6, AdaQuant over blocks for 2 iterations on 64x64 pages: every unit
    runs (it stopped on two units sharing a name), and the tuned model runs in onnxruntime."""
    batches = feeds((1, 3, 64, 64), (2, 2))
    quantized = quantize_model(text_detector_onnx_path(), "MX6", batches).model
    tuned, report = finetune_model(quantized, batches, FastFinetune(algorithm="adaquant", unit="block", iterations=2))
    assert len(report["units"]) > 10
    assert run(tuned, batches[0]["x"]).shape == (2, 1, 64, 64)


def test_a_layer_that_cannot_join_a_block_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A Conv whose block would also read a second model input (added after it) stays a layer unit:
    a warning naming the layer and why, in the log and the report (it was an INFO line)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="/branch/conv/Conv", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "y"], ["s"], name="/branch/Add"),
             helper.make_node("Relu", ["s"], ["out"], name="/branch/Relu")]
    model = onnx_model(nodes, [tensor("x", ["n", 3, 8, 8]), tensor("y", ["n", 4, 8, 8])], [tensor("out", ["n", 4, 8, 8])],
                       {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)}, 17)
    batches = [{name: rng.standard_normal((4, c, 8, 8)).astype(np.float32) for name, c in [("x", 3), ("y", 4)]} for _ in range(2)]
    quantized = quantize_model(model, "XINT8", batches).model
    with caplog.at_level(logging.WARNING):
        _, report = finetune_model(quantized, batches, FastFinetune(iterations=5, unit="block"))
    assert [(u["name"], u["op_type"]) for u in report["units"]] == [("/branch/conv/Conv", "Conv")]
    units = [w for w in report["warnings"] if "unit" in w]  # the others: weights stored as codes, no float model
    assert [w["unit"] for w in units] == ["/branch/conv/Conv"]
    assert re.fullmatch(r"stays a layer unit \(unit: block asked for blocks\): a block of 1 layer\(s\) here would also "
                        r"read \[.*y.*\]", units[0]["reason"])
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert any(message.startswith("unit /branch/conv/Conv: stays a layer unit") for message in warned)


def test_output_quantizers_belong_to_layer_units_only() -> None:
    with pytest.raises(ConfigError, match="include_output_quant.*unit: layer only"):
        FastFinetune(unit="block", include_output_quant=True)


def test_inside_a_block_each_activation_quantizer_drops_per_element(models: dict[str, Path]) -> None:
    """QDrop inside blocks while training: an activation quantizer's output is its quantized value
    for about drop_ratio of the elements and the float value elsewhere, the same on a rerun; weight
    quantizers and the module outside training are untouched."""
    module = lift_model(quantize_model(models["encoder"], "MX4", None).model)
    units = find_units(module, OP_TYPES, unit="block")
    train = cut(module, units).train[0]
    quantizer = next(train.get_submodule(n.target) for n in train.graph.nodes
                     if n.op == "call_module" and isinstance(train.get_submodule(n.target), FakeQuantize) and n.target.endswith("norm1/LayerNormalization_output_0_to_bfp_prime11"))
    x = torch.randn(64, 5, 16)
    quantized = quantizer(x)
    outputs = []
    for _ in range(2):
        with dropped_quantization(train, Draw(batch_size=16, seed=5, drop_ratio=0.25), 3):
            outputs.append(quantizer(x))
    kept = outputs[0] == quantized
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(torch.where(kept, quantized, x), outputs[0])
    assert 0.2 < kept[quantized != x].float().mean() < 0.3
    assert torch.equal(quantizer(x), quantized)  # hooks gone after training


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_qdrop_mixing_is_where_bit_for_bit_in_value_and_gradient(dtype: torch.dtype) -> None:
    """QDrop selects between the quantized and float values through their bits on the CPU (where
    branches on coin flips): the same bits as torch.where, signed zeros, infinities and NaN
    payloads included, and the same gradients (+0 where a side was not taken)."""
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(4, 3, 17, generator=generator).to(dtype) for _ in range(3)]
    values[0].view(-1)[:4] = torch.tensor([-0.0, float("inf"), float("nan"), -float("inf")]).to(dtype)
    values[1].view(-1)[:4] = torch.tensor([0.0, -0.0, 1.0, float("nan")]).to(dtype)
    keep = torch.rand(4, 3, 17, generator=generator) < 0.5
    keep.view(-1)[:4] = torch.tensor([True, False, True, False])
    results = []
    for select in (torch.where, mixed):
        quantized, float_value = values[0].clone().requires_grad_(), values[1].clone().requires_grad_()
        out = select(keep, quantized, float_value)
        (out * values[2]).sum().backward()
        results.append([t.detach().view(torch.uint8) for t in (out, quantized.grad, float_value.grad)])
    assert all(torch.equal(a, b) for a, b in zip(*results))
