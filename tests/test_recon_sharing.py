"""The weights a run holds once: with the float model given, the tuned module reads the float
reference's storage wherever both hold the same values or it stores codes the float weight quantizes
to, and tuning gives the same bytes as a run holding two copies (every storage a later float segment
reads is copied before it changes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from finetune.config import FastFinetune
from finetune.export import export_model
from finetune.lift import lift_model
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.recon import run as recon_run
from finetune.recon.data.reference import codes_values
from finetune.recon.data.sharing import SharedWeights, coded_float_names, float_weights
from finetune.zoo import digits_split
from finetune.zoo_decoder import decoder_feeds, export_decoder

from .recon_helpers import export_digits_cnn, one_thread  # noqa: F401  (one_thread: autouse fixture)

CASES = {  # name: (quantize config, fast_finetune settings)
    "float weights, AdaQuant": ({"preset": "XINT8"}, {"algorithm": "adaquant", "iterations": 20}),
    "codes, AdaRound": ({"preset": "XINT8", "weight": {"dtype": "int4"}, "weight_storage": "compact"}, {"iterations": 20}),
    "float weights, blocks of layers": ({"preset": "MX6"}, {"algorithm": "adaquant", "iterations": 10, "unit": "block"}),
}


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The digits CNN as ONNX and 4 calibration batches of 32."""
    x_train, _, x_test, _ = digits_split()
    path = export_digits_cnn(tmp_path_factory.mktemp("sharing") / "digits.onnx", x_test[:1])
    return {"path": path, "small": [{"x": x_train[i : i + 32].numpy()} for i in range(0, 128, 32)]}


def _tuned(model: onnx.ModelProto, data: object, settings: dict, float_model: object, share: bool,
           monkeypatch: pytest.MonkeyPatch) -> tuple[onnx.ModelProto, dict]:
    """Tune with the float model as reference, holding shared storages or (share False) two copies:
    neither lifted into the reference's tensors nor sharing them afterwards."""
    with monkeypatch.context() as patch:
        if not share:
            patch.setattr(recon_run, "SharedWeights", lambda *args: None)
            patch.setattr(recon_run, "float_weights", lambda reference, coded: {})
        return finetune_model(model, data, FastFinetune(seed=3, **settings), float_model=float_model)


@pytest.mark.parametrize("case", list(CASES))
def test_shared_storage_tunes_the_bytes_two_copies_tune(digits: dict, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config, settings = CASES[case]
    quantized = quantize_model(digits["path"], config, digits["small"]).model
    shared, report = _tuned(quantized, digits["small"], settings, digits["path"], True, monkeypatch)
    copied, apart = _tuned(quantized, digits["small"], settings, digits["path"], False, monkeypatch)
    assert shared.graph == copied.graph
    assert [u["loss_after"] for u in report["units"]] == [u["loss_after"] for u in apart["units"]]
    assert report["float_reference"] == "float model" and apart["weights_held_once"] is None
    held = report["weights_held_once"]  # float weights equal to the float model's, or codes it quantizes to
    assert held["bytes_held_once"] > 0 and held["tensors"] > 0


def test_a_storage_read_by_a_later_segment_is_copied_before_its_unit_changes_it() -> None:
    """Unit 0's weight is also read by segment 1 of the float stream: before unit 0 it gets a storage
    of its own, so the reference's value stays; a weight read last by its own segment stays shared."""
    reference, module = torch.nn.Module(), torch.nn.Module()
    for holder in (reference, module):
        holder.register_parameter("w0", torch.nn.Parameter(torch.ones(4)))
        holder.register_parameter("w1", torch.nn.Parameter(torch.full((4,), 2.0)))
        holder.finetune_params = {"w0": None, "w1": None}
    graphs = []
    for reads in (["w0"], ["w0", "w1"]):
        graph = torch.fx.Graph()
        graph.output(tuple(graph.get_attr(name) for name in reads))
        graphs.append(type("Segment", (), {"module": torch.fx.GraphModule(reference, graph)})())
    sharing = SharedWeights(module, reference, [], graphs)
    assert module.w0.data_ptr() == reference.w0.data_ptr() and module.w1.data_ptr() == reference.w1.data_ptr()
    unit = type("Unit", (), {"layers": [type("Layer", (), {"weight": "w0", "bias": None})()], "scales": ()})()
    sharing.before_unit(0, unit)
    assert module.w0.data_ptr() != reference.w0.data_ptr()
    with torch.no_grad():
        module.w0.add_(1.0)
    assert torch.equal(reference.w0, torch.ones(4))
    last = type("Unit", (), {"layers": [type("Layer", (), {"weight": "w1", "bias": None})()], "scales": ()})()
    sharing.before_unit(1, last)
    assert module.w1.data_ptr() == reference.w1.data_ptr()


def test_the_tiny_decoder_tunes_its_blocks_holding_its_weights_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPTQ over the tiny decoder (its LM head reads the embedding's weight too): one copy or two, the same bytes."""
    path = export_decoder(tmp_path / "decoder.onnx", cache=False, dynamo=False)
    feeds = decoder_feeds(False, 2)
    quantized = quantize_model(path, {"preset": "INT4_BLOCK32"}, feeds).model
    settings = {"algorithm": "gptq", "op_types": ["MatMul"]}
    shared, report = _tuned(quantized, feeds, settings, path, True, monkeypatch)
    copied, _ = _tuned(quantized, feeds, settings, path, False, monkeypatch)
    assert shared.graph == copied.graph
    assert report["weights_held_once"]["bytes_held_once"] > 0


@pytest.mark.parametrize("storage", ["float", "compact"])
def test_the_qdq_model_is_lifted_into_the_float_references_weights(digits: dict, storage: str) -> None:
    """Lifted with the float reference's weights to reuse, each weight reads the reference's storage
    from the start (float storage: equal bit for bit; codes: the float weight quantizes to them), and
    the module computes and writes back what the module lifted alone does, bit for bit."""
    quantized = quantize_model(digits["path"], {"preset": "XINT8", "weight_storage": storage}, digits["small"])
    reference = lift_model(quantized.float_model)
    weights = float_weights(reference, coded_float_names(quantized.model, quantized.float_model))
    module, alone = lift_model(quantized.model, reuse=weights), lift_model(quantized.model)
    pointers = {tensor.untyped_storage().data_ptr() for tensor in weights.values()}
    layers = [name for name, source in module.finetune_params.items() if source.initializer in weights]
    assert len(layers) == 5 and all(module.get_parameter(name).untyped_storage().data_ptr() in pointers for name in layers)
    coded = [name for name in layers if module.finetune_params[name].transform is not None]
    assert len(coded) == (5 if storage == "compact" else 0)
    x = torch.from_numpy(digits["small"][0]["x"])
    assert torch.equal(module(x), alone(x))
    assert export_model(module, quantized.model) == export_model(alone, quantized.model)
    codes_values(module, reference)  # as a model that is its own reference holds them
    for name in coded:
        assert torch.equal(module.get_parameter(name), alone.get_parameter(name))
        assert module.get_parameter(name).untyped_storage().data_ptr() not in pointers


def test_codes_a_float_weight_does_not_quantize_to_are_lifted_as_their_own_values(digits: dict) -> None:
    """A float weight one code away from the stored codes is no stand-in: that parameter holds the
    dequantized codes in a storage of its own."""
    quantized = quantize_model(digits["path"], {"preset": "XINT8", "weight_storage": "compact"}, digits["small"])
    reference = lift_model(quantized.float_model)
    coded = coded_float_names(quantized.model, quantized.float_model)
    weights = float_weights(reference, coded)
    moved = next(iter(coded))
    with torch.no_grad():
        weights[moved].view(-1)[0] += 1.0
    module, alone = lift_model(quantized.model, reuse=weights), lift_model(quantized.model)
    for name, source in module.finetune_params.items():
        if source.initializer in coded:
            shared = module.get_parameter(name).untyped_storage().data_ptr() == weights[source.initializer].untyped_storage().data_ptr()
            assert shared == (source.initializer != moved)
            if not shared:
                assert torch.equal(module.get_parameter(name), alone.get_parameter(name))


def test_a_constant_both_models_hold_equal_is_made_once(tmp_path: Path) -> None:
    """A constant that is no trainable weight (an embedding table, here an added offset) is lifted
    into the float reference's storage too when both models hold it bit for bit (a 2.5 GB decoder's
    table was held twice: 250 MiB)."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "weight")
    offset = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "offset")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "weight"], ["h"], name="matmul"), helper.make_node("Add", ["h", "offset"], ["y"], name="add")],
        "offset", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 8])], [weight, offset])
    path = tmp_path / "offset.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    quantized = quantize_model(path, {"preset": "XINT8"}, [{"x": rng.standard_normal((4, 8)).astype(np.float32)}])
    reference = lift_model(quantized.float_model)
    module = lift_model(quantized.model, reuse=float_weights(reference, coded_float_names(quantized.model, quantized.float_model)))
    assert "offset" not in {source.initializer for source in module.finetune_params.values()}  # a constant, not a weight
    held = reference.initializer_values["offset"]
    assert module.initializer_values["offset"].untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
    assert torch.equal(held, torch.from_numpy(numpy_helper.to_array(offset).copy()))
