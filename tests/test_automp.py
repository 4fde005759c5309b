"""Automatic mixed precision: the cost model, the search on real and constructed models, the
onnxruntime re-measure, the report, Quark's AutoMixprecision names, and the refusals."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from finetune.automp import auto_mixed_precision, prepare_mixed_precision
from finetune.automp.metrics import relative_l2
from finetune.automp.resume import candidate_outputs, cut_tails
from finetune.automp.search import Search
from finetune.automp.switch import SwitchableModel
from finetune.cli import main as cli_main
from finetune.config import ConfigError, load_config
from finetune.formats import BF16, BFP16, FP8_E4M3FN, MX4, MX6, MX9, MXFP4, MXINT8, IntSpec, bits_per_element
from finetune.lift import lift_model
from finetune.onnx.session import inference_session
from finetune.quantize import quantize_model
from finetune.zoo import DigitsCNN, DigitsTransformer, digits_split, export_onnx, train_digits_cnn

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)

MX_LADDER = {"preset": "MX9", "auto_mixed_precision": {"ladder": ["MX4", "MX6", "MX9"], "target": 0.98}}
INT8_ACT = {"format": "int", "dtype": "int8", "symmetric": False, "granularity": "tensor", "power_of_two": False,
            "calibration": "minmax"}
INT8_WEIGHT = {**INT8_ACT, "symmetric": True}
INT16_ACT = {**INT8_ACT, "dtype": "int16"}
QUARK_A16W8 = {"activation_type": "QInt16", "weight_type": "QInt8", "calibrate_method": "MinMax", "include_auto_mp": True,
               "extra_options": {"AutoMixprecision": {"ActTargetQuantType": "QInt8", "WeightTargetQuantType": "QInt8",
                                                      "OutputIndex": 0, "L2Target": 0.1}}}  # Quark's documented example


@pytest.mark.parametrize(("spec", "bits"), [
    (MX4, 4.0), (MX6, 6.0), (MX9, 9.0), (BFP16, 9.0), (MXFP4, 4.25), (MXINT8, 8.25), (IntSpec("int8"), 8.0),
    (IntSpec("uint16"), 16.0), (IntSpec("int4", axis=1, block_size=32), 5.0), (BF16, 16.0), (FP8_E4M3FN, 8.0), (None, 32.0),
])
def test_bits_per_element_of_notable_formats(spec: object, bits: float) -> None:
    assert bits_per_element(spec) == bits


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The trained digits CNN, calibration batches (training split) and labelled evaluation batches (test split)."""
    folder = tmp_path_factory.mktemp("digits")
    x_train, _, x_test, y_test = digits_split()
    path = export_onnx(train_digits_cnn(), x_test[:2], folder / "cnn.onnx")
    calibration = [{"x": b.numpy()} for b in x_train[:256].split(64)]
    evaluation = [(a.numpy(), b.numpy()) for a, b in zip(x_test.split(128), y_test.split(128))]
    return {"path": path, "calibration": calibration, "evaluation": evaluation, "labels": y_test.numpy()}


def _outputs(model: onnx.ModelProto | Path, batches: list) -> np.ndarray:
    session = inference_session(model)
    return np.concatenate([session.run(None, {"x": x})[0] for x, *_ in batches])


def test_the_target_is_met_in_onnxruntime_on_the_evaluation_data(digits: dict, tmp_path: Path) -> None:
    result = auto_mixed_precision(digits["path"], MX_LADDER, digits["calibration"], evaluation_data=digits["evaluation"],
                                  output_dir=tmp_path, curve_points=3)
    quantized, reference = _outputs(result.model, digits["evaluation"]), _outputs(digits["path"], digits["evaluation"])
    agreement = float((quantized.argmax(1) == reference.argmax(1)).mean())
    chosen = result.report["chosen"]
    assert agreement >= 0.98 and agreement == chosen["onnxruntime_metric"] == chosen["torch_metric"] and chosen["met"]
    uniform = {p["name"]: p for p in result.report["uniform"]}
    assert uniform["MX4"]["metric"] < 0.98 <= uniform["MX9"]["metric"]  # the search had something to do
    assert uniform["MX4"]["average_bits"] <= chosen["average_bits"] < uniform["MX6"]["average_bits"]
    assert {layer["rung"] for layer in result.report["layers"]} <= {"MX4", "MX6", "MX9"}
    # the model carries the formats the report states, node by node
    rungs = {layer["node"]: layer["rung"] for layer in result.report["layers"]}
    widths = {"MX4": 11, "MX6": 13, "MX9": 16}
    for node in result.model.graph.node:
        if node.op_type == "Conv" or node.op_type == "Gemm":
            weight_qdq = next(n for n in result.model.graph.node if n.output and n.output[0] == node.input[1])
            width = next(a.i for a in weight_qdq.attribute if a.name == "bit_width")
            assert width == widths[rungs[node.name]], node.name
    assert json.loads((tmp_path / "automp.json").read_text())["chosen"] == json.loads(json.dumps(chosen))
    assert (tmp_path / "automp.png").read_bytes().startswith(b"\x89PNG")


def test_reruns_give_the_same_bytes(digits: dict) -> None:
    runs = [auto_mixed_precision(digits["path"], MX_LADDER, digits["calibration"], evaluation_data=digits["evaluation"])
            for _ in range(2)]
    assert runs[0].model.SerializeToString() == runs[1].model.SerializeToString()
    for run in runs:
        run.report.pop("seconds")
    assert runs[0].report == runs[1].report


def test_choices_from_one_preparation_are_the_fresh_searches(digits: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two targets chosen from one preparation give the assignments, onnxruntime metrics, model
    bytes and reports (timings apart) of a fresh search per target; the sensitivity is measured once."""
    measured = []
    real_measure = Search.measure_sensitivity
    monkeypatch.setattr(Search, "measure_sensitivity", lambda self, *args: measured.append(1) or real_measure(self, *args))
    prepared = prepare_mixed_precision(digits["path"], MX_LADDER, digits["calibration"], evaluation_data=digits["evaluation"])
    shared = list(prepared.search.trace)
    chosen = {target: prepared.choose(target) for target in (0.9, 0.98)}
    assert measured == [1] and prepared.search.trace == shared  # the choices went on from copies
    seconds = [choice.report.pop("seconds") for choice in chosen.values()]
    assert "sensitivity_shared" not in seconds[0] and seconds[1]["sensitivity_shared"]
    assert seconds[0]["sensitivity"] == seconds[1]["sensitivity"] == prepared.seconds["sensitivity"]
    for target, choice in chosen.items():
        config = {**MX_LADDER, "auto_mixed_precision": {**MX_LADDER["auto_mixed_precision"], "target": target}}
        fresh = auto_mixed_precision(digits["path"], config, digits["calibration"], evaluation_data=digits["evaluation"])
        assert choice.model.SerializeToString() == fresh.model.SerializeToString() and choice.config == fresh.config
        assert choice.report["chosen"]["onnxruntime_metric"] == fresh.report["chosen"]["onnxruntime_metric"]
        fresh.report.pop("seconds")
        assert choice.report == fresh.report  # the same assignment, trace and uniform points
    assert chosen[0.9].report["layers"] != chosen[0.98].report["layers"]  # the targets chose differently


def _mlp_with_one_sensitive_layer(path: Path) -> Path:
    """Four Linear layers; the third has in every block of 16 weights one about 100 times the others,
    on an input channel the second layer holds at zero: it adds nothing to the output, but sets the
    block's exponent, so MX4's two mantissa bits round the block's other weights to zero (MX9 keeps them)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    with torch.no_grad():
        model[1].weight[::16] = 0.0
        model[1].bias[::16] = 0.0
        model[2].weight[:, ::16] = 5.0
    return export_onnx(model, torch.randn(2, 32), path)


def test_one_obviously_sensitive_layer_stays_high_and_only_it(tmp_path: Path) -> None:
    path = _mlp_with_one_sensitive_layer(tmp_path / "mlp.onnx")
    data = [{"x": np.random.default_rng(i).standard_normal((64, 32)).astype(np.float32)} for i in range(4)]
    config = {"preset": "MX9", "auto_mixed_precision": {"ladder": ["MX4", "MX9"], "metric": "l2", "target": 0.4}}
    result = auto_mixed_precision(path, config, data)
    rungs = [layer["rung"] for layer in result.report["layers"]]
    assert rungs == ["MX4", "MX4", "MX9", "MX4"], result.report["layers"]
    sensitivities = [layer["sensitivity"]["MX4"]["relative_l2"] for layer in result.report["layers"]]
    assert max(sensitivities) == sensitivities[2] > 3 * sorted(sensitivities)[-2]


@pytest.mark.parametrize("network", [DigitsCNN, DigitsTransformer])
def test_resumed_sensitivity_forwards_are_bit_identical_to_full_ones(network: type, tmp_path: Path) -> None:
    """Each candidate (one layer lowered) run from the top model's cached values at its layer gives
    the bytes a full forward of the switched model gives (the transformer's tails read residuals)."""
    torch.manual_seed(0)
    x_train, _, x_test, _ = digits_split()
    path = export_onnx(network().eval(), x_test[:2], tmp_path / "model.onnx")
    calibration = [{"x": b.numpy()} for b in x_train[:128].split(64)]
    models = {f"layer{r}": lift_model(quantize_model(path, preset, calibration).model) for r, preset in enumerate(["MX4", "MX6", "MX9"])}
    nodes = [(n.name, n.op_type) for n in onnx.load(path).graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    switch = SwitchableModel(models["layer2"], models, nodes)
    top = {node: {"activation": "layer2", "weight": "layer2"} for node, _ in nodes}
    for node, keys in top.items():
        switch.set(node, keys)
    candidates = [(node, {"activation": f"layer{r}", "weight": f"layer{r}"}) for node, _ in nodes for r in (0, 1)]
    batches = [(b,) for b in x_test[:96].split(32)]
    tails = cut_tails(switch, 0)
    resumed = candidate_outputs(switch, tails, batches, candidates, top)
    for (node, keys), output in zip(candidates, resumed, strict=True):
        switch.set(node, keys)
        full = switch.outputs(batches, 0)
        switch.set(node, top[node])
        assert full.dtype == output.dtype and full.shape == output.shape and full.tobytes() == output.tobytes(), node
    assert len(nodes) > 3 and len({output.tobytes() for output in resumed}) == len(candidates)  # every switch changed the output
    last = tails.tails[nodes[-1][0]].module.graph.nodes
    assert len(last) < len(switch.module.graph.nodes) / 3  # the last layer's tail is a small part of the graph


@pytest.mark.slow
def test_a_sensitivity_split_over_two_processes_is_the_one_process_one(digits: dict, caplog: pytest.LogCaptureFixture) -> None:
    """Two gloo CPU processes (fast_finetune devices 2), each evaluating every candidate on its share
    of the 4 evaluation batches (256 and 193 samples), give the one-process sensitivity bit for bit,
    hence the same moves and the same choice."""
    split = {**MX_LADDER, "fast_finetune": {"devices": 2, "strategy": "ddp_spawn"}}
    with caplog.at_level(logging.INFO, logger="finetune.automp"):
        one, two = (prepare_mixed_precision(digits["path"], config, digits["calibration"], evaluation_data=digits["evaluation"])
                    for config in (MX_LADDER, split))
    assert any("split over 2 processes" in r.getMessage() for r in caplog.records)
    points = [[p for p in prepared.search.trace if p.phase == "sensitivity"] for prepared in (one, two)]
    assert len(points[0]) == 10 and points[1] == points[0]
    assert two.search.trace == one.search.trace and two.search.moves == one.search.moves
    assert two.search.copy().run(0.98) == one.search.copy().run(0.98)


@pytest.mark.slow
def test_finetune_in_loop_tunes_every_search_candidate_then_the_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from finetune.automp import api

    path = _mlp_with_one_sensitive_layer(tmp_path / "mlp.onnx")
    data = [{"x": np.random.default_rng(i).standard_normal((64, 32)).astype(np.float32)} for i in range(2)]
    config = {"preset": "MX9", "auto_mixed_precision": {"ladder": ["MX4", "MX9"], "metric": "l2", "target": 0.4,
                                                        "finetune_in_loop": True, "loop_iterations": 2},
              "fast_finetune": {"algorithm": "adaquant", "iterations": 3, "batch_size": 32}}
    tuned = []
    real_tune = api._tune
    monkeypatch.setattr(api, "_tune", lambda *args: tuned.append(args[3:]) or real_tune(*args))
    result = auto_mixed_precision(path, config, data)
    searched = [p for p in result.report["trace"] if p["phase"] in ("bottom", "search")]
    assert searched and tuned == [(2,)] * len(searched) + [()]  # each candidate at the loop's budget, then the choice in full
    assert result.report["chosen"]["met"] and result.finetune_report["units"]
    with pytest.raises(ValueError, match="finetune_in_loop tunes each candidate with the config's fast_finetune"):
        auto_mixed_precision(path, {key: value for key, value in config.items() if key != "fast_finetune"}, data)


def test_the_trace_is_monotone_where_it_must_be(digits: dict) -> None:
    result = auto_mixed_precision(digits["path"], MX_LADDER, digits["calibration"], evaluation_data=digits["evaluation"],
                                  curve_points=4)
    trace = result.report["trace"]
    curve = [p["average_bits"] for p in trace if p["phase"] == "curve"]
    assert len(curve) == 4 and curve == sorted(curve, reverse=True)  # longer prefixes never cost more
    uniform = [p["average_bits"] for p in result.report["uniform"]]
    assert uniform == sorted(uniform) and len(uniform) == 3
    assert result.report["evaluations"] == len(trace)


def test_search_bisection_measures_log_of_the_moves() -> None:
    """100 items, two rungs, the metric drops by one per lowered item: the search finds the exact
    prefix with ~log2(100) evaluations beyond the sensitivity pass."""
    from finetune.automp.metrics import METRICS

    count = 100
    def evaluate(assignment: tuple[int, ...]) -> tuple[float, float]:
        lowered = count - sum(assignment)
        return 1.0 - lowered / 1000, float(np.sqrt(sum(i + 1 for i, r in enumerate(assignment) if r == 0)))
    def bits(assignment: tuple[int, ...]) -> float:
        return float(sum(4 + 5 * r for r in assignment)) / count
    search = Search([2] * count, evaluate, bits, METRICS["cosine"])
    search.measure_sensitivity()
    assert [m.item for m in search.moves[:3]] == [0, 1, 2]  # least noise per bit first
    chosen = search.run(0.9605)
    assert count - sum(chosen) == 39 and chosen[:39] == (0,) * 39
    assert len([p for p in search.trace if p.phase == "search"]) <= 3 * 8


def test_the_target_met_at_the_bottom_rung_puts_everything_there(digits: dict, caplog: pytest.LogCaptureFixture) -> None:
    config = {"preset": "MX9", "auto_mixed_precision": {"ladder": ["MX4", "MX9"], "metric": "cosine", "target": 0.5}}
    with caplog.at_level(logging.INFO, logger="finetune.automp"):
        result = auto_mixed_precision(digits["path"], config, digits["calibration"])
    assert {layer["rung"] for layer in result.report["layers"]} == {"MX4"}
    assert any(r.getMessage().endswith("at its cheapest rung, which all take: 5 of 5 layers lowered to MX4") for r in caplog.records)
    assert result.report["chosen"]["holds"] == "5 of 5 layers lowered to MX4"


def test_top1_accuracy_with_labels_and_a_drop(digits: dict) -> None:
    config = {"preset": "MX9", "auto_mixed_precision": {"ladder": ["MXFP4", "MXFP6_E2M3", "MXFP8_E4M3"],
                                                        "metric": "top1_accuracy", "max_drop": 0.01}}
    result = auto_mixed_precision(digits["path"], config, digits["calibration"], evaluation_data=digits["evaluation"])
    report = result.report
    reference = _outputs(digits["path"], digits["evaluation"])
    assert report["float_metric"] == float((reference.argmax(1) == digits["labels"]).mean())
    assert report["target"] == pytest.approx(report["float_metric"] - 0.01)
    accuracy = float((_outputs(result.model, digits["evaluation"]).argmax(1) == digits["labels"]).mean())
    assert accuracy == report["chosen"]["onnxruntime_metric"] >= report["target"]


def test_tensor_granularity_with_int_ladders_agrees_with_onnxruntime(digits: dict) -> None:
    """Activations and weights on separate INT ladders: an int32 bias between an int8 input and an
    int16 weight takes s_input * s_weight in torch as the exported model does."""
    config = {"activation": INT8_ACT, "weight": INT8_WEIGHT, "auto_mixed_precision": {
        "ladder": {"activation": [INT8_ACT, {**INT8_ACT, "dtype": "int16"}], "weight": [INT8_WEIGHT, {**INT8_WEIGHT, "dtype": "int16"}]},
        "granularity": "tensor", "metric": "l2", "target": 0.01}}
    result = auto_mixed_precision(digits["path"], config, digits["calibration"])
    chosen = result.report["chosen"]
    assert chosen["onnxruntime_metric"] <= 0.01
    # Both metrics are ||q - f|| / ||f|| against the same float outputs f, so by the triangle inequality
    # they differ by at most ||q_torch - q_ort|| / ||f||. That gap is not a fixed number: torch and
    # onnxruntime sum Conv products in CPU-dependent orders, and a last-bit difference that crosses a
    # rounding boundary moves an int8 activation by a whole step (0.0060364 against 0.0060353 on one CPU).
    float_outputs = _outputs(digits["path"], [(b["x"],) for b in digits["calibration"]])
    ort_outputs = _outputs(result.model, [(b["x"],) for b in digits["calibration"]])
    lifted = lift_model(result.model)
    with torch.no_grad():
        torch_outputs = np.concatenate([lifted(torch.from_numpy(b["x"])).numpy() for b in digits["calibration"]])
    gap = float(np.linalg.norm((torch_outputs - ort_outputs).astype(np.float64)) / np.linalg.norm(float_outputs.astype(np.float64)))
    assert abs(chosen["torch_metric"] - chosen["onnxruntime_metric"]) <= gap + 1e-6 * chosen["onnxruntime_metric"]
    assert gap <= 0.25 * chosen["onnxruntime_metric"]  # the two simulations agree far closer than either is to float
    roles = {layer["role"] for layer in result.report["layers"]}
    assert roles == {"activation", "weight"}


def _int16_zero_points(model: onnx.ModelProto) -> int:
    """How many QuantizeLinear nodes quantize to int16 (their zero point's type): the activations still at int16."""
    types = {init.name: init.data_type for init in model.graph.initializer}
    return sum(1 for n in model.graph.node if n.op_type == "QuantizeLinear" and types.get(n.input[2]) == onnx.TensorProto.INT16)


@pytest.fixture(scope="module")
def transformer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    _, _, x_test, _ = digits_split()
    return export_onnx(DigitsTransformer().eval(), x_test[:2], tmp_path_factory.mktemp("transformer") / "model.onnx")


@pytest.mark.parametrize("network", ["cnn", "transformer"])
def test_quarks_documented_auto_mixprecision_lowers_every_layer_l2_target_allows(
        network: str, digits: dict, transformer: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Quark's example (activations QInt16, weights QInt8, target types QInt8, L2Target 0.1): uniform
    int8 meets the target, so every activation goes to int8, and the log and report say so."""
    path = digits["path"] if network == "cnn" else transformer
    with caplog.at_level(logging.INFO, logger="finetune.automp"):
        result = auto_mixed_precision(path, QUARK_A16W8, digits["calibration"], output_dir=tmp_path)
    count = len(result.report["layers"])
    holds = f"{count} of {count} activations lowered to int8; no weight lowered ({count} of {count} at int8)"
    chosen = result.report["chosen"]
    assert chosen["holds"] == holds and chosen["fractions"] == {"weight": {"int8": 1.0}, "activation": {"int8": 1.0}}
    assert {layer["rung"] for layer in result.report["layers"]} == {"int8+int8"} and _int16_zero_points(result.model) == 0
    assert any(r.getMessage().startswith(f"auto mixed precision: {holds}") for r in caplog.records)
    assert json.loads((tmp_path / "automp.json").read_text())["chosen"]["holds"] == holds
    reference = _outputs(path, [(feed["x"],) for feed in digits["calibration"]])
    measured = _outputs(result.model, [(feed["x"],) for feed in digits["calibration"]])
    assert chosen["onnxruntime_metric"] == relative_l2(measured, reference) <= 0.1


def test_a_native_ladder_written_precise_first_is_searched_cheapest_first(digits: dict, caplog: pytest.LogCaptureFixture) -> None:
    native = {"activation": INT16_ACT, "weight": INT8_WEIGHT, "auto_mixed_precision": {
        "ladder": {"activation": [INT16_ACT, INT8_ACT], "weight": [INT8_WEIGHT, INT8_WEIGHT]}, "metric": "l2", "target": 0.1}}
    with caplog.at_level(logging.INFO, logger="finetune.automp"):
        results = [auto_mixed_precision(digits["path"], config, digits["calibration"]) for config in (QUARK_A16W8, native)]
    assert results[0].model.SerializeToString() == results[1].model.SerializeToString()
    assert results[0].report["ladder"] == results[1].report["ladder"] == {"activation": ["int8", "int16"], "weight": ["int8", "int8"]}
    assert any(r.getMessage() == "auto_mixed_precision.ladder taken cheapest first by bits per element: int8+int8, int16+int8"
               for r in caplog.records)  # the native ladder; Quark's translation lists the target types first already


def test_a_target_nothing_cheaper_meets_keeps_the_precise_rung(digits: dict) -> None:
    """An L2 target between the all-int16 model's and that of any one layer lowered keeps every
    activation at int16; `lower` (Quark's NumTarget) lowers exactly that many, those adding the least
    noise per bit saved. The cheaper type is int4: one activation lowered to int8 may even cancel
    noise (0.006335 against 0.006345 all at int16, on one CPU's trained CNN), one at int4 adds 4x."""
    options = {**QUARK_A16W8["extra_options"]["AutoMixprecision"], "ActTargetQuantType": "QInt4"}
    prepared = prepare_mixed_precision(digits["path"], {**QUARK_A16W8, "extra_options": {"AutoMixprecision": options}},
                                       digits["calibration"])
    top = prepared.search.trace[0].l2
    lowest = min(p.l2 for p in prepared.search.trace if p.phase == "sensitivity")
    assert lowest > 2 * top
    kept = prepared.choose((top + lowest) / 2)
    assert kept.report["chosen"]["holds"] == "no activation lowered (5 of 5 at int16); no weight lowered (5 of 5 at int8)"
    assert kept.report["chosen"]["met"] and _int16_zero_points(kept.model) == 5
    two = prepared.choose(lower=2)
    assert two.report["chosen"]["holds"].startswith("2 of 5 activations lowered to int4, 3 at int16;")
    assert two.report["goal"] == "lower" and two.report["chosen"]["met"] is None and _int16_zero_points(two.model) == 3
    least = [move.item for move in prepared.search.moves if move.rung == 0][:2]  # least noise per bit saved
    assert {i for i, layer in enumerate(two.report["layers"]) if layer["rung"] == "int4+int8"} == set(least)


def test_keep_top_keeps_that_many_layers_high(digits: dict) -> None:
    config = {"preset": "MX9", "auto_mixed_precision": {"ladder": ["MX4", "MX9"], "keep_top": 2}}
    result = auto_mixed_precision(digits["path"], config, digits["calibration"])
    rungs = [layer["rung"] for layer in result.report["layers"]]
    assert sorted(rungs) == ["MX4", "MX4", "MX4", "MX9", "MX9"] and result.report["chosen"]["met"] is None


@pytest.mark.parametrize(("section", "labels", "message"), [
    ({"ladder": ["MX4", "MX9"], "target": 1e-6, "metric": "l2"}, None, r"l2 1e-06 is missed even with every searched layer at the top rung \(l2 0\.00"),
    ({"ladder": ["MX4", "MX9"], "target": 0.9, "metric": "top1_accuracy"}, None, "needs labels"),
    ({"ladder": ["MX4", "MX9"], "target": 0.9, "metric": "top1_accuracy"}, np.zeros(3), "labels hold 3 entries but the evaluation data hold 256"),
    ({"ladder": ["MX4", "NOPE"], "target": 0.9}, None, r"ladder\[1\].*NOPE"),
    ({"ladder": ["MX4", "MX9"], "target": 0.9, "metric": "tests.test_automp:nan_metric"}, None, "returned NaN"),
    ({"ladder": ["MX4", "MX9"], "target": 0.9, "exclude": ["/no/such/node"]}, None, "neither a node"),
    ({"ladder": {"activation": [INT8_ACT, INT16_ACT], "weight": [{**INT8_WEIGHT, "dtype": "int16"}, INT8_WEIGHT]}, "target": 0.9,
      "metric": "l2"}, None, r"ladder: rungs int8\+int16 and int16\+int8 have no order by cost"),
])
def test_bad_input_is_refused_in_one_line(digits: dict, section: dict, labels: np.ndarray | None, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        auto_mixed_precision(digits["path"], {"preset": "MX9", "auto_mixed_precision": section}, digits["calibration"],
                             labels=labels)
    assert "\n" not in str(error.value)


def nan_metric(outputs: np.ndarray, float_outputs: np.ndarray, labels: np.ndarray | None) -> float:
    return float("nan")


def test_top1_on_an_output_that_is_not_a_score_vector_is_refused(tmp_path: Path) -> None:
    path = export_onnx(torch.nn.Linear(8, 1), torch.randn(2, 8), tmp_path / "one.onnx")
    with pytest.raises(ValueError, match="needs output 0 to be a batch of class scores"):
        auto_mixed_precision(path, {"preset": "MX9", "auto_mixed_precision": {"ladder": ["MX4", "MX9"], "target": 0.9}},
                             [{"x": np.ones((4, 8), np.float32)}])


@pytest.mark.parametrize(("section", "message"), [
    ({"ladder": ["MX4"]}, "exactly one of target, max_drop, keep_top, lower"),
    ({"ladder": ["MX4"], "target": 0.9, "keep_top": 2}, "exactly one of"),
    ({"ladder": ["MX4"], "target": 1.5}, r"lies in \[0, 1\]"),
    ({"ladder": ["MX4"], "target": 0.9, "metric": "accuracy"}, "must be one of l2, cosine"),
    ({"ladder": {"activation": ["MX4"], "weight": ["MX4", "MX9"]}, "target": 0.9}, "ladders of one length"),
    ({"ladder": [], "target": 0.9}, "at least one rung"),
])
def test_config_errors_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        load_config({"preset": "MX9", "auto_mixed_precision": section})
    assert str(error.value).startswith("auto_mixed_precision.")


def test_cli_auto_mp_with_labels_in_the_evaluation_folder(digits: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    calibration, evaluation = tmp_path / "cal", tmp_path / "eval"
    calibration.mkdir()
    evaluation.mkdir()
    for i, feed in enumerate(digits["calibration"]):
        np.save(calibration / f"{i:03d}.npy", feed["x"])
    for i, (x, _) in enumerate(digits["evaluation"]):
        np.save(evaluation / f"{i:03d}.npy", x)
    np.save(evaluation / "labels.npy", digits["labels"])
    output = tmp_path / "out.onnx"
    code = cli_main(["quantize", str(digits["path"]), "--config", "MX9", "--data", str(calibration), "--auto-mp",
                     "--ladder", "MX4", "MX6", "MX9", "--metric", "top1_accuracy", "--max-drop", "0.02",
                     "--evaluation-data", str(evaluation), "-o", str(output)])
    assert code == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("auto mixed precision:"))
    report = json.loads(output.with_name("out.onnx.automp.json").read_text())
    assert output.with_name("out.onnx.automp.png").exists()
    assert f"{report['chosen']['onnxruntime_metric']:.6g}" in line and report["evaluation_data"] == str(evaluation)
    accuracy = float((_outputs(output, digits["evaluation"]).argmax(1) == digits["labels"]).mean())
    assert accuracy == report["chosen"]["onnxruntime_metric"] >= report["target"]
    # the chosen precision per layer, as a config beside the output, quantizes to the same model
    chosen = load_config(output.with_name("out.onnx.automp.config.yaml"))
    assert chosen.auto_mixed_precision is None and len(chosen.node_overrides) == len(report["layers"])
    again = tmp_path / "again.onnx"
    assert cli_main(["quantize", str(digits["path"]), "--config", str(output.with_name("out.onnx.automp.config.yaml")),
                     "--data", str(calibration), "-o", str(again)]) == 0
    assert again.read_bytes() == output.read_bytes()
