"""Cross-layer equalisation: the float function is kept, channel ranges of each pair meet, what
cannot be rescaled is left alone, and per-tensor INT4 weights lose far less on the result."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from finetune.config import FastFinetune, load_config
from finetune.lift import lift_model
from finetune.notices import Notice
from finetune.onnx.equalize import MAX_SWEEPS, equalize_model, find_pairs
from finetune.onnx.normalize import normalize_model
from finetune.pipeline import quantize_and_finetune
from finetune.quantize import quantize_model
from finetune.recon import finetune_model

from .lift_helpers import run_torch
from .tools_models import make_model, mk, run

X_SHAPE = [2, 4, 8, 8]
INT4_TENSOR = {"format": "int", "dtype": "int4", "symmetric": True, "granularity": "tensor", "calibration": "minmax"}


def separable_cnn(seed: int = 0, between: str = "Clip") -> onnx.ModelProto:
    """x[2,4,8,8] -> Conv 3x3 (8) -> Clip(0, 6) -> Pad -> depthwise Conv 3x3 -> Relu -> grouped Conv 1x1
    (2 groups, 6) -> y, with channel ranges spread over three decades, as folded batch norms leave them."""
    rng = np.random.default_rng(seed)
    spread = 10.0 ** rng.uniform(-2, 1, size=(8, 1, 1, 1))
    weights = {
        "w1": (rng.standard_normal((8, 4, 3, 3)) * spread / 6).astype(np.float32),
        "b1": (rng.standard_normal(8) * spread.ravel()).astype(np.float32),
        "w2": (rng.standard_normal((8, 1, 3, 3)) / spread / 3).astype(np.float32),
        "b2": rng.standard_normal(8).astype(np.float32),
        "w3": (rng.standard_normal((6, 4, 1, 1)) / 2).astype(np.float32),
        "low": np.array(0, np.float32), "high": np.array(6, np.float32),
        "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64),
    }
    first = (mk("Clip", ["a", "low", "high"], ["c"], name="clip") if between == "Clip"
             else mk(between, ["a"], ["c"], name="between"))
    nodes = [mk("Conv", ["x", "w1", "b1"], ["a"], name="conv1", pads=[1, 1, 1, 1]), first,
             mk("Pad", ["c", "pads"], ["p"], name="pad"),
             mk("Conv", ["p", "w2", "b2"], ["d"], name="depthwise", group=8),
             mk("Relu", ["d"], ["r"], name="relu"),
             mk("Conv", ["r", "w3"], ["y"], name="grouped", group=2)]
    return normalize_model(make_model(nodes, X_SHAPE, None, weights, np.float32))[0]


def inputs(seed: int = 1) -> np.ndarray:
    return (3 * np.random.default_rng(seed).standard_normal(X_SHAPE)).astype(np.float32)


def weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_equalised_model_computes_the_same_function() -> None:
    model = separable_cnn()
    before = model.SerializeToString()
    equalised, changes = equalize_model(model)
    assert model.SerializeToString() == before
    assert any("2 Conv pair(s)" in c and "1 Clip node(s) became per-channel Max/Min" in c for c in changes)
    x = inputs()
    expected = run(model, x)
    assert np.abs(run(equalised, x) - expected).max() <= 1e-5 * np.abs(expected).max()
    ops = [n.op_type for n in equalised.graph.node]
    assert "Clip" not in ops and ops.count("Max") == ops.count("Min") == 1


def test_each_pair_ends_with_equal_channel_ranges() -> None:
    equalised, _ = equalize_model(separable_cnn())
    w = weights(equalised)
    first, depthwise = np.abs(w["w1"]).max(axis=(1, 2, 3)), np.abs(w["w2"]).max(axis=(1, 2, 3))
    np.testing.assert_allclose(first, depthwise, rtol=1e-3)
    grouped = np.abs(w["w3"]).reshape(2, 3, 4).max(axis=1).reshape(8)  # input channel g * 4 + j of group g
    np.testing.assert_allclose(depthwise, grouped, rtol=1e-3)
    original = np.abs(weights(separable_cnn())["w1"]).max(axis=(1, 2, 3))
    assert first.max() / first.min() < original.max() / original.min() / 10


def test_the_clip_bounds_follow_each_channel() -> None:
    """A channel divided by s is clipped at 6 / s, so values above 6 stay clipped where they were."""
    equalised, _ = equalize_model(separable_cnn())
    w = weights(equalised)
    ratio = np.abs(weights(separable_cnn())["w1"]).max(axis=(1, 2, 3)) / np.abs(w["w1"]).max(axis=(1, 2, 3))
    np.testing.assert_allclose(w["clip/min_per_channel"].ravel(), 6 / ratio, rtol=1e-5)
    assert w["clip/min_per_channel"].shape == (8, 1, 1) and not w["clip/max_per_channel"].any()
    assert "low" not in w and "high" not in w


@pytest.mark.parametrize("between", ["Relu", "Sigmoid"])
def test_only_scale_commuting_ops_may_sit_between(between: str) -> None:
    pairs = find_pairs(separable_cnn(between=between).graph)
    expected = [("conv1", "depthwise"), ("depthwise", "grouped")] if between == "Relu" else [("depthwise", "grouped")]
    assert [(p.first.name, p.second.name) for p in pairs] == expected


def test_branches_shared_weights_and_channel_padding_are_left_alone() -> None:
    branched = separable_cnn()
    branched.graph.output.append(onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, None))
    shared = separable_cnn()
    shared.graph.node.append(mk("Conv", ["x", "w1"], ["extra"], name="reuses_w1", pads=[1, 1, 1, 1]))
    shared.graph.output.append(onnx.helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, None))
    padded = separable_cnn()  # one channel in front, one cropped at the back: as many channels, shifted
    widths = next(t for t in padded.graph.initializer if t.name == "pads")
    widths.CopyFrom(numpy_helper.from_array(np.array([0, 1, 1, 1, 0, -1, 1, 1], np.int64), "pads"))
    for model in (branched, shared, padded):
        assert [(p.first.name, p.second.name) for p in find_pairs(model.graph)] == [("depthwise", "grouped")]


def test_sweeps_stop_once_the_scales_settle() -> None:
    _, changes = equalize_model(separable_cnn())
    sweeps = int(next(c for c in changes if "sweep" in c).split(" in ")[1].split()[0])
    assert 2 <= sweeps < MAX_SWEEPS


def test_per_tensor_int4_weights_lose_far_less_after_equalisation() -> None:
    model, x = separable_cnn(), inputs()
    expected = run(model, x)
    config = {"weight": INT4_TENSOR}
    plain = quantize_model(model, config, None)
    equalised = quantize_model(model, {**config, "cross_layer_equalization": True}, None)
    assert any("cross-layer equalisation" in c for c in equalised.summary["normalization"])
    assert [n.op_type for n in equalised.float_model.graph.node].count("Min") == 1
    errors = [float(np.square(run(result.model, x) - expected).mean()) for result in (equalised, plain)]
    assert errors[0] < errors[1] / 4


def test_compact_weights_take_the_equalised_float_model_as_reference() -> None:
    """With weights stored as codes the finetune reference is the float model; it must be the
    equalised one the codes were made from, so the float targets equal those the float-stored run
    takes from the quantized model with its quantizers off."""
    model = separable_cnn()
    data = [{"x": inputs(seed)} for seed in range(4)]
    config = {"activation": {**INT4_TENSOR, "dtype": "int8"}, "weight": INT4_TENSOR, "cross_layer_equalization": True,
              "fast_finetune": {"iterations": 5}}
    losses = {}
    for storage in ("float", "compact"):
        result = quantize_and_finetune(model, load_config({**config, "weight_storage": storage}), data)
        losses[storage] = [u["loss_before"] for u in result.report["units"]]
    np.testing.assert_allclose(losses["compact"], losses["float"], rtol=1e-5)


def test_the_lifted_equalised_model_runs_like_onnxruntime() -> None:
    """The per-channel Max/Min bounds lift to torch and compute what onnxruntime computes."""
    data = [{"x": inputs(seed)} for seed in range(4)]
    quantized = quantize_model(separable_cnn(), {"preset": "XINT8", "cross_layer_equalization": True}, data).model
    assert {"Max", "Min"} <= {n.op_type for n in quantized.graph.node}
    x = inputs(seed=9)
    np.testing.assert_allclose(run_torch(lift_model(quantized), [x])[0], run(quantized, x, optimize=False), rtol=0, atol=1e-5)


def test_a_float_model_that_was_not_quantized_into_the_codes_is_refused() -> None:
    """Weights stored as codes of the equalised model, with the original float model given as the
    reference: its targets belong to another model, and finetune says so instead of tuning towards them."""
    model = separable_cnn()
    data = [{"x": inputs(seed)} for seed in range(4)]
    config = {"weight": INT4_TENSOR, "weight_storage": "compact", "cross_layer_equalization": True}
    result = quantize_model(model, config, data)
    with pytest.raises(ValueError, match=r"conv1.*does not quantize to the codes.*QuantizeResult.float_model"):
        finetune_model(result.model, data, FastFinetune(iterations=5), float_model=model)
    _, report = finetune_model(result.model, data, FastFinetune(iterations=5), float_model=result.float_model)
    assert report["float_reference"] == "float model"


def test_equalisation_that_does_nothing_or_does_not_settle_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for and without effect (float16 weights form no pair), or stopped by the sweep limit
    before the scales settled: each a notice, as the quantizer's summary lists them."""
    half = separable_cnn()
    for tensor in half.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT and tensor.dims:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    notices: list[Notice] = []
    _, changes = equalize_model(half, notices)
    assert changes == [] and notices == [Notice("model", "cross_layer_equalization", "found no Conv pair to equalise (a Conv "
                                                "with float32 weights feeding another, through Relu, Clip or Pad only): "
                                                "nothing was equalised")]
    monkeypatch.setattr("finetune.onnx.equalize.MAX_SWEEPS", 1)
    notices = []
    equalize_model(separable_cnn(), notices)
    assert [n.name for n in notices] == ["cross_layer_equalization"]
    assert notices[0].reason.startswith("did not settle in 1 sweeps (the last moved a scale by ")
