"""Decoder LLMs as torch.onnx exports them: a tiny seeded Llama-style decoder (finetune.zoo_decoder),
exported by the TorchScript and the dynamo exporter, with and without a key/value cache, lifts to
onnxruntime's logits and greedy tokens, quantizes and lifts within the numerics' bound, tunes with
GPTQ (the TorchScript export's Flatten of a rank-2 mask stopped it), and its decoder blocks are found
as units from the residual chain, for both exporters, and tuned by AdaQuant; a chain whose blocks
would read what a layer computes is no block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from finetune.config import DEFAULT_OP_TYPES, FastFinetune
from finetune.lift import check_lifted, lift_model
from finetune.lift.agreement import agrees, bound
from finetune.onnx.session import inference_session
from finetune.pipeline import quantize_and_finetune
from finetune.quantize import quantize_model
from finetune.lift.graph import constant_nodes
from finetune.recon import find_units, finetune_model
from finetune.recon.units.residual import residual_blocks
from finetune.notices import Warnings
from finetune.zoo import export_onnx
from finetune.zoo_decoder import DecoderShape, decoder_feeds, export_decoder, greedy_tokens, tiny_decoder

from .lift_helpers import assert_same, onnx_model, run_ort, run_torch, tensor
from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)

EXPORTS = [(cache, dynamo) for cache in (False, True) for dynamo in (False, True)]
EXPORT_IDS = [f"{'dynamo' if dynamo else 'torchscript'}-{'cache' if cache else 'no-cache'}" for cache, dynamo in EXPORTS]
SHAPE = DecoderShape()
PROMPT = np.array([[1, 5, 7, 9], [3, 2, 8, 8]])
GREEDY_STEPS = 32
# The weights of one decoder block, in graph order: q, k, v, o (GQA: k and v are half as wide), gate, up, down.
BLOCK_WEIGHTS = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[bool, bool], Path]:
    """The seeded decoder exported four ways (the dynamo exporter takes some seconds each)."""
    folder = tmp_path_factory.mktemp("decoders")
    return {(cache, dynamo): export_decoder(folder / f"{cache}-{dynamo}.onnx", cache, dynamo) for cache, dynamo in EXPORTS}


def session_runner(model: onnx.ModelProto | Path):
    """A greedy-loop runner over onnxruntime (exact numerics: optimisations off)."""
    session = inference_session(onnx.load(model) if isinstance(model, Path) else model)
    return lambda feed: session.run(None, dict(feed))


def gap_recording(run, gaps: list[float]):
    """The runner, recording at each step the gap between the two largest last-token logits, in units of
    the bound float rounding explains in logits of that magnitude (finetune.lift.agreement.bound)."""
    def recorded(feed: dict) -> list[np.ndarray]:
        outputs = run(feed)
        top = np.sort(outputs[0][:, -1], axis=-1)
        gaps.append(float((top[:, -1] - top[:, -2]).min()) / bound(outputs[0]))
        return outputs
    return recorded


def module_runner(module: torch.nn.Module, model: onnx.ModelProto):
    """A greedy-loop runner over a lifted module (inputs in the model's order)."""
    names = [i.name for i in model.graph.input]
    return lambda feed: run_torch(module, [np.ascontiguousarray(feed[name]) for name in names])


@pytest.mark.parametrize(("cache", "dynamo"), EXPORTS, ids=EXPORT_IDS)
def test_the_float_decoder_lifts_to_onnxruntimes_logits_and_greedy_tokens(exports: dict, cache: bool, dynamo: bool) -> None:
    """Every output (logits, present keys and values) within float rounding of onnxruntime's, and 32
    greedy tokens equal: re-running the whole sequence each step, or feeding the cache back. The
    export itself decodes as the torch decoder does. Equal tokens are no luck of this CPU's summation
    orders: at every step onnxruntime's top logit leads by over twice what rounding explains (some 50
    times here), so logits within that bound pick the same token."""
    path = exports[cache, dynamo]
    model, lifted = onnx.load(path), lift_model(path)
    feed = decoder_feeds(cache, 1)[0]
    expected = run_ort(model, [feed[i.name] for i in model.graph.input])
    actual = run_torch(lifted, [feed[i.name] for i in model.graph.input])
    assert len(actual) == len(expected) == (1 + 2 * SHAPE.blocks if cache else 1)
    assert all(agrees(a, e, exact=False) for a, e in zip(actual, expected))
    shape = SHAPE if cache else None
    gaps: list[float] = []
    tokens = greedy_tokens(gap_recording(session_runner(path), gaps), PROMPT, GREEDY_STEPS, shape)
    assert len(gaps) == GREEDY_STEPS and min(gaps) > 2
    assert np.array_equal(greedy_tokens(module_runner(lifted, model), PROMPT, GREEDY_STEPS, shape), tokens)
    assert np.array_equal(greedy_tokens(module_runner(tiny_decoder(cache), model), PROMPT, GREEDY_STEPS, shape), tokens)
    assert len(np.unique(tokens)) > 8  # the decoder wanders: equal tokens are a test of its logits


@pytest.mark.parametrize("preset", ["A8W8", "INT4_PER_CHANNEL", "INT4_BLOCK32"])
@pytest.mark.parametrize(("cache", "dynamo"), EXPORTS, ids=EXPORT_IDS)
def test_the_quantized_decoder_lifts_within_the_numerics_bound(exports: dict, cache: bool, dynamo: bool, preset: str) -> None:
    """INT8 weights and activations, INT4 per channel and in blocks of 32: the lifted module passes
    the node-by-node agreement check; weight-only, where no rounding boundary can be crossed, its
    outputs are within float rounding of onnxruntime's too."""
    feeds = decoder_feeds(cache, 3)
    quantized = quantize_model(exports[cache, dynamo], preset, feeds).model
    lifted = lift_model(quantized)
    check_lifted(quantized, lifted, feeds[0])
    if preset != "A8W8":
        inputs = [feeds[0][i.name] for i in quantized.graph.input]
        assert all(agrees(a, e, exact=False) for a, e in zip(run_torch(lifted, inputs), run_ort(quantized, inputs)))


@pytest.mark.parametrize(("rank", "axis"), [(0, 0), (1, 0), (1, 1), (2, 2), (2, -1), (3, 1), (3, 3)])
def test_flatten_lifts_at_any_rank_and_axis(rank: int, axis: int) -> None:
    """Flatten of a scalar, a vector at axis 1 (onnx2torch raised IndexError below rank 2) or a matrix at
    axis 2 (the TorchScript exporter's flattening of a twice-indexed mask) gives onnxruntime's values."""
    shape = [3, 4, 5][:rank]
    model = onnx_model([helper.make_node("Flatten", ["x"], ["y"], axis=axis)], [tensor("x", shape)], [tensor("y", None)])
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    assert_same(model, lift_model(model), [x])


def test_gptq_tunes_the_torchscript_export(exports: dict) -> None:
    """The issue's traceback (onnx2torch's Flatten on the TorchScript export) is gone: GPTQ keeps all
    15 layers and the tuned model runs in onnxruntime, its INT4 logits on held-out tokens nearer float
    than RTN's (with 512 calibration tokens; on 128, GPTQ's fit of 64-wide inputs does not carry over)."""
    assert any(node.op_type == "Flatten" for node in onnx.load(exports[False, False]).graph.node)
    feeds = decoder_feeds(False, 16, seed=2)
    config = {"weight": {"format": "int", "dtype": "int4", "symmetric": True, "granularity": "channel"},
              "fast_finetune": {"algorithm": "gptq", "batch_size": 4, "validation_share": 0}}
    result = quantize_and_finetune(exports[False, False], config, feeds)
    assert len(result.report["units"]) == 15
    inputs = decoder_feeds(False, 1, seed=9)[0]
    rtn = quantize_model(exports[False, False], {k: v for k, v in config.items() if k != "fast_finetune"}, feeds).model
    float_logits = session_runner(exports[False, False])(inputs)[0]
    errors = [np.abs(session_runner(m)(inputs)[0] - float_logits).mean() for m in (result.model, rtn)]
    assert errors[0] < errors[1]


@pytest.mark.parametrize(("cache", "dynamo"), EXPORTS, ids=EXPORT_IDS)
def test_decoder_blocks_are_units_for_both_exporters(exports: dict, cache: bool, dynamo: bool) -> None:
    """unit: block gives one unit per decoder block (its seven layers: attention, then the SwiGLU MLP),
    from the residual chain where node names carry no scope (dynamo) and where the mask, rotary tables
    and cache leave several values live (both); the LM head follows alone. The module computes what it
    did before (a block takes its own copy of the shape arithmetic it reads)."""
    feeds = decoder_feeds(cache, 2)
    lifted = lift_model(quantize_model(exports[cache, dynamo], "INT4_PER_CHANNEL", feeds).model)
    inputs = [feeds[0][name] for name in feeds[0]]
    before = run_torch(lifted, inputs)
    units = find_units(lifted, DEFAULT_OP_TYPES, unit="block")
    assert [u.op_type for u in units[:2]] == ["block", "block"] and len(units) == 3
    for unit in units[:2]:
        assert [tuple(lifted.get_parameter(layer.weight).shape) for layer in unit.layers] == BLOCK_WEIGHTS
    assert [tuple(lifted.get_parameter(layer.weight).shape) for layer in units[2].layers] == [(64, SHAPE.vocabulary)]
    if not dynamo:
        assert [u.name for u in units[:2]] == ["/layers/0", "/layers/1"]
    assert all(np.array_equal(a, b) for a, b in zip(run_torch(lifted, inputs), before))


@pytest.mark.parametrize(("cache", "dynamo"), EXPORTS, ids=EXPORT_IDS)
def test_adaquant_tunes_decoder_blocks_into_a_model_onnxruntime_runs(exports: dict, cache: bool, dynamo: bool) -> None:
    """A few AdaQuant steps over the two decoder blocks (batches of 2 rows drawn from calibration batches
    of 4: the blocks recompute their sizes) write a model onnxruntime runs, with weights changed."""
    feeds = decoder_feeds(cache, 4)
    quantized = quantize_model(exports[cache, dynamo], "INT4_PER_CHANNEL", feeds).model
    config = FastFinetune(algorithm="adaquant", unit="block", iterations=4, batch_size=2, validation_share=0)
    tuned, report = finetune_model(quantized, feeds, config, float_model=exports[cache, dynamo])
    assert [u["op_type"] for u in report["units"]][:2] == ["block", "block"]
    outputs = session_runner(tuned)(feeds[0])
    assert outputs[0].shape == (4, 8, SHAPE.vocabulary) and np.isfinite(outputs[0]).all()
    changed = [a.name for a, b in zip(tuned.graph.initializer, quantized.graph.initializer) if a.raw_data != b.raw_data]
    assert changed


class ResidualStack(torch.nn.Module):
    """Three residual layers, each branch scaled, where `gated`, by a gate a layer computes once from the input."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 16) if gated else None
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate(x) if self.gate is not None else 1.0
        for block in self.blocks:
            x = x + block(x) * gate
        return x


@pytest.mark.parametrize("gated", [False, True])
def test_a_residual_chain_reading_what_a_layer_computes_is_no_block(tmp_path: Path, gated: bool) -> None:
    """Over layer units, the residual chain of three layers gives three blocks; where every block would
    read a gate a layer computes, that is no stream a block can be cut from (the gate's layer is tuned
    apart from the blocks reading it): the units are left as they were, and so is the graph; with
    unit: block, each layer stays a layer unit, a warning each."""
    torch.manual_seed(0)
    path = export_onnx(ResidualStack(gated).eval(), torch.randn(4, 16), tmp_path / "stack.onnx")
    feeds = [{"x": np.random.default_rng(k).standard_normal((4, 16)).astype(np.float32)} for k in range(2)]
    lifted = lift_model(quantize_model(path, "INT4_PER_CHANNEL", feeds).model)
    code, layers = lifted.code, find_units(lifted, DEFAULT_OP_TYPES)
    units = residual_blocks(lifted, layers, constant_nodes(lifted.graph))
    assert [u.op_type for u in units] == (["Gemm"] * 4 if gated else ["block"] * 3)
    assert lifted.code == code
    if gated:
        warnings = Warnings()
        assert find_units(lifted, DEFAULT_OP_TYPES, unit="block", warnings=warnings) == layers
        assert sorted(w["unit"] for w in warnings) == sorted(u.name for u in layers)
