"""Decoders as onnxruntime-genai's model builder writes them (tests/fixtures/genai: a seeded two-block
Llama at fp32 and at int4, MatMulNBits): token folders of input_ids alone feed them (the mask, and
the empty caches every such model has, filled); they quantize and tune in decoder blocks and keep
their contrib ops; and the int4 model's MatMulNBits weights are read as the QDQ they pack, tuned
against the fp32 model, and written back as MatMulNBits at their accuracy level."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from finetune.calibrate.data import CalibrationData
from finetune.config import FastFinetune
from finetune.export.matmul_nbits import to_matmul_nbits
from finetune.onnx.contrib import matmul_nbits_to_qdq
from finetune.onnx.session import inference_session
from finetune.pipeline import quantize_and_finetune
from finetune.recon.api import finetune_model
from finetune.zoo_decoder import DecoderShape, export_decoder
from tests.lift_helpers import float_sum_bound

from .recon_helpers import one_thread  # noqa: F401  (autouse fixture)

GENAI = Path(__file__).parent / "fixtures" / "genai"
FP32, INT4 = GENAI / "fp32" / "model.onnx", GENAI / "int4" / "model.onnx"
VOCABULARY, KV_HEADS, HEAD = 96, 2, 16


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two token folders of input_ids only (.npy, [4, 16] each): six files to calibrate, two to judge."""
    rng = np.random.default_rng(5)
    folders = {}
    for name, count in (("calibration", 6), ("check", 2)):
        folders[name] = tmp_path_factory.mktemp(name)
        for k in range(count):
            np.save(folders[name] / f"{k}.npy", rng.integers(3, VOCABULARY, (4, 16)))
    return folders


def run(model: onnx.ModelProto | Path, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    """The logits of every feed in onnxruntime, stacked."""
    session = inference_session(model if isinstance(model, onnx.ModelProto) else str(model))
    return np.stack([session.run(["logits"], feed)[0] for feed in feeds])


def test_a_token_folder_of_input_ids_feeds_a_decoder_with_a_cache(tokens: dict[str, Path], tmp_path: Path) -> None:
    """Each .npy of input_ids becomes a whole feed: the mask all ones, each cache empty along its past
    axis with its head size read from the attention (genai's caches name it kv_cache_dim); a torch.onnx
    export with a cache and position ids is fed alike. A folder that leaves out what is not a decoder's
    still fails in one line."""
    feeds = list(CalibrationData(tokens["check"], onnx.load(FP32, load_external_data=False)))
    assert len(feeds) == 2 and set(feeds[0]) == {"input_ids", "attention_mask", *(f"past_key_values.{b}.{p}" for b in (0, 1)
                                                                                   for p in ("key", "value"))}
    assert feeds[0]["past_key_values.0.key"].shape == (4, KV_HEADS, 0, HEAD) and feeds[0]["attention_mask"].all()
    assert run(FP32, feeds).shape == (2, 4, 16, VOCABULARY)
    exported = export_decoder(tmp_path / "cache.onnx", cache=True, dynamo=False)
    fed = next(iter(CalibrationData(tokens["check"], exported)))
    assert fed["position_ids"].tolist() == [list(range(16))] * 4 and fed["past_key_values.0.key"].shape[2] == 0
    assert run(exported, [fed]).shape == (1, 4, 16, DecoderShape().vocabulary)
    model = onnx.load(FP32, load_external_data=False)
    model.graph.input[1].name = "mask"  # no longer a decoder input filled by name
    with pytest.raises(ValueError, match="holds one array but the model has inputs"):
        next(iter(CalibrationData(tokens["check"], model)))


def test_a_genai_decoder_quantizes_and_tunes_in_decoder_blocks(tokens: dict[str, Path]) -> None:
    """A8W8 and AdaQuant with block units: each decoder block is one unit (its attention reading the
    caches and row lengths as side inputs along their batch axis); the written model keeps the
    builder's ops (GroupQueryAttention, the fused skip norms) and runs in onnxruntime."""
    config = {"preset": "A8W8", "fast_finetune": {"algorithm": "adaquant", "unit": "block", "iterations": 20, "batch_size": 4}}
    result = quantize_and_finetune(str(FP32), config, str(tokens["calibration"]))
    assert [unit["name"] for unit in result.report["units"]] == ["/model/layers/0", "/model/layers/1", "/lm_head/MatMul"]
    census = collections.Counter(node.op_type for node in result.model.graph.node)
    assert census["GroupQueryAttention"] == 2 and census["SkipSimplifiedLayerNormalization"] == 4 and census["MatMul"] == 11
    feeds = list(CalibrationData(tokens["check"], onnx.load(FP32, load_external_data=False)))
    assert np.isfinite(run(result.model, feeds)).all()


def with_accuracy_level(model: onnx.ModelProto, level: int) -> onnx.ModelProto:
    """A copy whose MatMulNBits nodes compute at `level` (0: float activations, as the QDQ form does)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        for attribute in node.attribute:
            if attribute.name == "accuracy_level":
                attribute.i = level
    return copy


def nbits_nodes(model: onnx.ModelProto) -> list[tuple[str, dict, list[np.ndarray]]]:
    """Each MatMulNBits node's name, attributes and weight tensors (packed codes, scales), in graph order."""
    tensors = {t.name: t for t in model.graph.initializer}
    return [(node.name, {a.name: helper.get_attribute_value(a) for a in node.attribute},
             [numpy_helper.to_array(tensors[name]) for name in node.input[1:3]])
            for node in model.graph.node if node.op_type == "MatMulNBits"]


def test_matmul_nbits_reads_as_the_qdq_weights_it_packs_and_packs_back_to_the_same_bytes(tokens: dict[str, Path]) -> None:
    """The builder's int4 model as DequantizeLinear(block_size) -> MatMul computes its outputs (at
    accuracy level 0, where onnxruntime keeps float activations: level 4 rounds them to int8), and
    packing it back gives every node its name, attributes, codes and scales again."""
    original = onnx.load(INT4)
    converted = onnx.ModelProto()
    converted.CopyFrom(original)
    levels = matmul_nbits_to_qdq(converted)
    assert set(levels.values()) == {4} and len(levels) == 11 and all(not name.endswith("_Q4") for name in levels)
    assert not any(node.op_type == "MatMulNBits" for node in converted.graph.node)
    feeds = list(CalibrationData(tokens["check"], original))
    expected = run(with_accuracy_level(original, 0), feeds)
    np.testing.assert_allclose(run(converted, feeds), expected, rtol=0, atol=float_sum_bound([expected], 128))
    packed, kept = to_matmul_nbits(converted, levels)
    assert not kept
    for (name, attributes, arrays), (name_back, attributes_back, arrays_back) in zip(nbits_nodes(original), nbits_nodes(packed),
                                                                                       strict=True):
        assert (name_back, attributes_back) == (name, attributes)
        for array, back in zip(arrays, arrays_back):
            np.testing.assert_array_equal(back.reshape(array.shape), array)


@pytest.mark.parametrize("tied", [False, True])
def test_an_int4_genai_model_tunes_against_its_fp32_model_and_stays_matmul_nbits(tokens: dict[str, Path], tied: bool) -> None:
    """GPTQ over decoder blocks from the builder's int4 model, with its fp32 model as the reference: the
    tuned model has the input's nodes and ops (MatMulNBits at accuracy level 4), and its logits lie
    nearer the fp32 model's than the untuned int4 model's on tokens it did not see. Tied (SmolLM2's
    way: the token table a GatherBlockQuantized of the LM head's packed weights), the table keeps
    its bytes and the LM head gets tuned weights of its own."""
    int4, fp32 = (GENAI / f"{precision}{'_tied' if tied else ''}" / "model.onnx" for precision in ("int4", "fp32"))
    config = FastFinetune(algorithm="gptq", unit="block")
    tuned, report = finetune_model(str(int4), str(tokens["calibration"]), config, float_model=str(fp32))
    original = onnx.load(int4)
    assert [(n.op_type, n.name, n.domain) for n in tuned.graph.node] == [(n.op_type, n.name, n.domain) for n in original.graph.node]
    assert [attributes for _, attributes, _ in nbits_nodes(tuned)] == [attributes for _, attributes, _ in nbits_nodes(original)]
    assert report["kept"] == 3
    feeds = list(CalibrationData(tokens["check"], original))
    reference = run(fp32, feeds)
    error_tuned, error_untuned = (float(np.abs(run(m, feeds) - reference).mean()) for m in (tuned, original))
    assert error_tuned < error_untuned
    if tied:
        gather = next(n for n in tuned.graph.node if n.op_type == "Reshape")  # the table's view of the packed weights
        head = next(n for n in tuned.graph.node if n.name == "/lm_head/MatMul_Q4")
        tensors, before = ({t.name: t for t in m.graph.initializer} for m in (tuned, original))
        assert tensors[gather.input[0]] == before[gather.input[0]] and head.input[1] != gather.input[0]


def test_bench_genai_makes_and_scores_every_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """scripts/bench_genai.py's per-setting step on the fixture decoders laid out as its build leaves
    them (the builder itself runs in a venv the suite does not have): every setting scores, ours
    tuned as MatMulNBits; an absent builder environment is a one-line error."""
    import shutil
    import subprocess
    import sys

    from tests.test_bench_llm import SCRIPTS, script

    bench = script("bench_genai", monkeypatch)
    for precision in ("fp32", "int4"):
        shutil.copytree(GENAI / precision, tmp_path / precision)
    rng = np.random.default_rng(7)
    for name in ("calibration", "evaluation"):
        (tmp_path / name).mkdir()
        np.save(tmp_path / name / "000.npy", rng.integers(3, VOCABULARY, (4, 16)))
    results = {setting: bench.run_setting(setting, tmp_path) for setting in bench.SETTINGS if setting != "lift"}
    assert results["float"]["perplexity"] > 1 and "next_token_agreement" not in results["float"]
    assert all(0 <= results[s]["next_token_agreement"] <= 1 for s in bench.SETTINGS[2:])
    lift = bench.run_setting("lift", tmp_path)
    assert lift["logits_difference"] <= lift["logits_bound"] and lift["greedy_equal"]
    assert results["ours_tune_gptq"]["ops"]["MatMulNBits"] == 11 and results["ours_a8w8"]["ops"]["GroupQueryAttention"] == 2
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_genai.py"), "--genai-python", str(tmp_path / "absent")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "is absent: make a venv with onnxruntime-genai" in done.stderr


def test_smoothquant_folds_into_the_builders_rms_norm_gains_and_keeps_the_function(tokens: dict[str, Path]) -> None:
    """SmoothQuant on the builder's fp32 decoder folds 1/s into the gains of its RMS norms (the plain
    one and the normed output of the skip form, whose sum it leaves as it is) for the nine layers they
    feed; only the two o_proj layers, which read GroupQueryAttention's output, get an inserted Mul; the
    logits stay the float model's."""
    from finetune.config import load_config
    from finetune.quantize.smooth import smooth_model

    from .test_smooth_quant import assert_same_function

    model = onnx.load(FP32)
    data = list(CalibrationData(tokens["calibration"], model))
    result, summary = smooth_model(model, load_config({"preset": "A8W8", "smooth_quant": {}}), data, None, [])
    assert (summary["smoothed"], summary["folded"], summary["mul_inserted"], summary["skipped"]) == (11, 9, 2, 0)
    inserted = {layer["node"] for layer in summary["layers"] if layer["action"] != "folded"}
    assert inserted == {"/model/layers.0/attn/o_proj/MatMul", "/model/layers.1/attn/o_proj/MatMul"}, summary["layers"]
    check = list(CalibrationData(tokens["check"], model))
    assert_same_function(run(result, check), run(FP32, check))


@pytest.mark.parametrize(("tied", "online"), [(False, False), (True, False), (False, True)])
def test_rotation_follows_the_builders_fused_rms_norms_and_keeps_the_function(tokens: dict[str, Path], tied: bool,
                                                                              online: bool) -> None:
    """QuaRot's rotation of the residual stream through SkipSimplifiedLayerNormalization (its sum rotated,
    its normed output through the gain folded into the layers reading it) and SimplifiedLayerNormalization:
    every layer reading the stream (the packed QKV, gate, up, the LM head) or writing it (o_proj,
    down_proj) rotated, the five gains folded; the rotated float graph gives the fp32 model's logits
    within 1e-4 of their scale, tied (the head a copy of the table) and with online rotations too."""
    from finetune.quantize import quantize_model

    path = GENAI / ("fp32_tied" if tied else "fp32") / "model.onnx"
    result = quantize_model(str(path), {"preset": "MXFP4", "rotation": {"online": online}}, None)
    entry = result.summary["rotation"]
    assert (entry["layers_reading"], entry["layers_writing"], entry["gains_folded"]) == (7, 4, 5)
    check = list(CalibrationData(tokens["check"], onnx.load(path, load_external_data=False)))
    expected, rotated = run(path, check), run(result.float_model, check)
    np.testing.assert_allclose(rotated, expected, rtol=0, atol=1e-4 * float(np.abs(expected).max()))


@pytest.mark.parametrize("case", ["fp32 at A8W8", "int4_tied"])
def test_the_lifted_genai_decoder_runs_forward_on_the_meta_device(tokens: dict[str, Path], case: str) -> None:
    """The GPU path on the CPU: the lifted decoder (GroupQueryAttention with its cache and row lengths,
    rotary, RMS norms, the int4 tied table's GatherBlockQuantized) runs forward on the meta device,
    reading no device value (a host read there raises)."""
    import torch

    from finetune.lift import lift_model
    from finetune.quantize import quantize_model

    if case == "int4_tied":
        model = onnx.load(GENAI / "int4_tied" / "model.onnx")
        matmul_nbits_to_qdq(model)
    else:
        model = quantize_model(str(FP32), "A8W8", str(tokens["calibration"])).model
    feed = next(iter(CalibrationData(tokens["check"], model)))
    meta = torch.device("meta")
    module = lift_model(model).to(meta)
    outputs = module(*(torch.empty(v.shape, dtype=torch.from_numpy(v).dtype, device=meta) for v in feed.values()))
    assert len(outputs) == 5 and all(o.device == meta for o in outputs) and outputs[0].shape == (4, 16, VOCABULARY)
