"""Language-model metrics: perplexity and next-token agreement against a hand computation, padding
excluded, the logits output picked or refused, and end to end on the tiny decoder (float vs RTN INT4
in onnxruntime, automatic mixed precision judged by perplexity, and `finetune evaluate --tokens`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from finetune.automp import auto_mixed_precision
from finetune.automp.metrics import METRICS
from finetune.calibrate.tokens import IGNORED, logits_output_index, next_token_targets
from finetune.onnx.session import inference_session
from finetune.quantize import quantize_model
from finetune.tools.evaluate import evaluate_folders, main
from finetune.zoo_decoder import decoder_feeds, export_decoder

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)

EPS = np.finfo(np.float64).eps


def test_perplexity_equals_a_hand_computation_and_skips_padding() -> None:
    logits = np.array([[[2.0, 0.5, -1.0], [0.0, 3.0, 1.0], [9.0, 9.0, 9.0]]], dtype=np.float32)
    feeds = [{"input_ids": np.array([[0, 2, 1]]), "attention_mask": np.array([[1, 1, 1]])}]
    targets = next_token_targets(feeds)
    assert targets.tolist() == [[2, 1, IGNORED]]
    nll = [math.log(sum(math.exp(v) for v in row)) - row[t] for row, t in zip(logits[0, :2].tolist(), (2, 1))]
    expected = math.exp(sum(nll) / 2)
    measured = METRICS["perplexity"](logits, logits, targets)
    assert abs(measured - expected) <= 64 * EPS * expected  # a few float64 roundings in sums of 3 terms, then exp
    padded = [{"input_ids": np.array([[0, 2, 1]]), "attention_mask": np.array([[1, 1, 0]])}]
    assert next_token_targets(padded).tolist() == [[2, IGNORED, IGNORED]]
    only_first = math.exp(nll[0])
    assert abs(METRICS["perplexity"](logits, logits, next_token_targets(padded)) - only_first) <= 64 * EPS * only_first


def test_next_token_agreement_counts_predicted_positions_only() -> None:
    reference = np.array([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    other = np.array([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])  # agrees at 0, not at 1; position 2 predicts nothing
    targets = next_token_targets([{"input_ids": np.array([[0, 1, 1]])}])
    assert METRICS["next_token_agreement"](other, reference, targets) == 0.5
    assert METRICS["next_token_agreement"](reference, reference, targets) == 1.0


def _outputs_model(outputs: list[tuple[str, int]]) -> onnx.ModelProto:
    """A graph whose outputs have the given names and ranks (float)."""
    values = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2] * rank) for name, rank in outputs]
    return helper.make_model(helper.make_graph([], "g", [], values))


def test_the_logits_output_is_picked_by_name_or_rank_and_ambiguity_refused() -> None:
    assert logits_output_index(_outputs_model([("present.0", 4), ("logits", 3)])) == 1
    assert logits_output_index(_outputs_model([("scores", 3), ("present.0", 4)])) == 0
    with pytest.raises(ValueError, match=r"outputs are a \(rank 3\), b \(rank 3\)"):
        logits_output_index(_outputs_model([("a", 3), ("b", 3)]))


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny decoder (TorchScript export, no cache) and a token folder of .npz files."""
    folder = tmp_path_factory.mktemp("llm")
    tokens = folder / "tokens"
    tokens.mkdir()
    for k, feed in enumerate(decoder_feeds(False, 4, batch=4, length=16)):
        np.savez(tokens / f"{k:02d}.npz", **feed)
    return {"path": export_decoder(folder / "decoder.onnx", cache=False, dynamo=False), "tokens": tokens}


def _perplexity(model: onnx.ModelProto, tokens: Path) -> tuple[float, float, np.ndarray]:
    """(perplexity, the logits) of a model in onnxruntime over a token folder."""
    feeds = [dict(np.load(p)) for p in sorted(tokens.glob("*.npz"))]
    session = inference_session(model)
    logits = np.concatenate([session.run(None, feed)[logits_output_index(model)] for feed in feeds])
    return METRICS["perplexity"](logits, logits, next_token_targets(feeds)), logits, next_token_targets(feeds)


def test_float_and_int4_perplexity_on_the_tiny_decoder(decoder: dict) -> None:
    float_model = onnx.load(decoder["path"])
    float_ppl, float_logits, targets = _perplexity(float_model, decoder["tokens"])
    quantized = quantize_model(float_model, "INT4_PER_CHANNEL", decoder["tokens"]).model
    int4_ppl, int4_logits, _ = _perplexity(quantized, decoder["tokens"])
    assert float_ppl >= 1 and int4_ppl >= 1 and int4_ppl != float_ppl
    agreement = METRICS["next_token_agreement"](int4_logits, float_logits, targets)
    assert 0 < agreement < 1  # 4-bit weights flip some argmax tokens of a random decoder, not all


def test_automp_judged_by_perplexity_meets_its_budget(decoder: dict) -> None:
    config = {"preset": "INT4_PER_CHANNEL", "auto_mixed_precision": {
        "ladder": ["INT4_PER_CHANNEL", "INT4_BLOCK32"], "metric": "perplexity", "max_drop": 150.0, "granularity": "layer"}}
    result = auto_mixed_precision(decoder["path"], config, decoder["tokens"])
    report = result.report
    assert report["metric"] == "perplexity" and report["chosen"]["met"]
    assert report["chosen"]["onnxruntime_metric"] <= report["target"] == pytest.approx(report["float_metric"] + 150)


def test_evaluate_reports_perplexity_of_logits_folders_over_their_tokens(decoder: dict, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    float_model = onnx.load(decoder["path"])
    quantized = quantize_model(float_model, "INT4_PER_CHANNEL", decoder["tokens"]).model
    for folder, model in (("float", float_model), ("int4", quantized)):
        (tmp_path / folder).mkdir()
        session = inference_session(model)
        for path in sorted(decoder["tokens"].glob("*.npz")):
            np.save(tmp_path / folder / f"{path.stem}.npy", session.run(None, dict(np.load(path)))[0])
    main(["--baseline_results_folder", str(tmp_path / "float"), "--quantized_results_folder", str(tmp_path / "int4"),
          "--tokens", str(decoder["tokens"]), "--json"])
    reported = json.loads(capsys.readouterr().out)["language_model"]
    float_ppl, float_logits, targets = _perplexity(float_model, decoder["tokens"])
    int4_ppl, int4_logits, _ = _perplexity(quantized, decoder["tokens"])
    assert reported["positions"] == int((targets != IGNORED).sum())
    assert reported["baseline_perplexity"] == float_ppl and reported["quantized_perplexity"] == int4_ppl  # the same sums
    assert reported["next_token_agreement"] == pytest.approx(METRICS["next_token_agreement"](int4_logits, float_logits, targets),
                                                             rel=1e-12)  # per-file shares weighted back
    with pytest.raises(FileNotFoundError, match="no token file 00.npz or 00.npy"):
        evaluate_folders(tmp_path / "float", tmp_path / "int4", tmp_path)
