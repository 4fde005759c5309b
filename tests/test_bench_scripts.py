"""The benchmark scripts run end to end on a small tensor and report every format."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_bench_formats_reports_every_format_as_json() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_formats.py"), "--shape", "2", "64", "5", "7", "--repeats", "1"],
        capture_output=True, text=True, check=True,
    )
    (report,) = json.loads(result.stdout)
    assert report["shape"] == [2, 64, 5, 7]
    names = [row["format"] for row in report["formats"]]
    assert {"BFP16", "MX9", "MX6", "MX4", "MXINT8", "MXFP8_E4M3", "MXFP8_E5M2", "MXFP6_E3M2", "MXFP6_E2M3",
            "MXFP4", "BF16", "FP16", "FP8_E4M3FN", "INT8 per channel", "INT4 block 32", "INT32 per tensor"} <= set(names)
    for row in report["formats"]:
        assert row["torch_s"] > 0 and row["onnxruntime_s"] > 0 and row["torch_vs_clone"] > 0


def test_bench_formats_compares_eager_and_compiled_forward_backward() -> None:
    """Two shapes in one run, each with its own clone; without the onnxruntime column."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_formats.py"), "--shape", "2", "40", "3", "--shape", "3", "40",
         "--repeats", "1", "--compile", "--threads", "1", "--formats", "MX4", "BF16", "--no-onnx"],
        capture_output=True, text=True, check=True,
    )
    reports = json.loads(result.stdout)
    assert [report["shape"] for report in reports] == [[2, 40, 3], [3, 40]]
    for report in reports:
        assert [row["format"] for row in report["formats"]] == ["MX4", "BF16"] and report["torch_threads"] == 1
        for row in report["formats"]:
            assert row["eager_fb_s"] > 0 and row["compiled_fb_s"] > 0 and row["compile_s"] > 0 and row["same_bits"] is True
            assert row["eager_fb_vs_clone"] > 0 and row["compiled_fb_vs_clone"] > 0 and "onnxruntime_s" not in row
        assert report["all_same_bits"] is True and report["max_compiled_fb_vs_clone"] > 0


def script(name: str) -> Any:
    """A script of scripts/ imported as a module, to test its functions."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_finetune_change_error_is_that_of_paired_differences() -> None:
    bench = script("bench_finetune")
    before = np.array([True, False, False, True, True])
    after = np.array([True, True, False, False, True])
    # differences 0, 1, 0, -1, 0: sample variance 2/4, over 5 items
    assert bench.change_standard_error(before, after) == pytest.approx(100 * (0.5 / 5) ** 0.5)
    assert bench.change_standard_error(before, before) == 0  # same hits: the change is exact
    outputs = np.array([[0.1, 0.9], [0.8, 0.2]])
    assert bench.hits(outputs, np.array([[0.0, 1.0], [0.0, 1.0]]), None).tolist() == [True, False]
    assert bench.hits(outputs, outputs, np.array([0, 0])).tolist() == [False, True]


def test_bench_finetune_takes_every_bundled_preset_with_its_weight_formats_algorithm() -> None:
    """`--presets bundled` (the never-worse sweep) is every bundled preset that does not tune by
    itself; integer weights get AdaRound, the others AdaQuant, as the script's own table says."""
    bench = script("bench_finetune")
    assert "MX4" in bench.BUNDLED and "A16W8" in bench.BUNDLED
    assert "MX4_ADAQUANT" not in bench.BUNDLED and "XINT8_ADAROUND" not in bench.BUNDLED
    algorithms = {name: bench.preset_algorithm(name) for name in bench.BUNDLED}
    assert algorithms["INT4_BLOCK32"] == algorithms["A16W8"] == "adaround"
    assert algorithms["MXFP4"] == algorithms["BF16"] == algorithms["BFP16"] == "adaquant"
    assert bench.preset_algorithm("INT4W_INT8A") == "adaround" and bench.preset_config("INT4W_INT8A")["cross_layer_equalization"]


def test_bench_finetune_reads_sequence_scores_as_greedy_ctc() -> None:
    """Repeats merge, blanks (class 0) split them and drop out; two readings agree only when whole."""
    bench = script("bench_finetune")
    steps = np.eye(4)[[[1, 1, 0, 1, 2, 2, 0, 0], [3, 0, 3, 3, 1, 0, 0, 2]]]  # one-hot (2 lines, 8 steps, 4 classes)
    assert bench.ctc_reading(steps) == [(1, 1, 2), (3, 3, 1, 2)]
    other = steps.copy()
    other[1, 7] = np.eye(4)[1]  # the second line's last character read as 1
    assert bench.hits(other, steps, None).tolist() == [True, False]


def test_bench_finetune_scores_probability_maps_by_mask_iou() -> None:
    """Text masks are probabilities above 0.3: IoU pooled over pages for the metric, per page for
    the paired change; pages where neither model finds text agree."""
    bench = script("bench_finetune")
    reference = np.zeros((2, 1, 2, 4))
    reference[0, 0, 0, :2] = 0.9  # two text pixels on the first page, none on the second
    outputs = reference.copy()
    outputs[0, 0, 1, 0] = 0.31  # one more
    assert bench.mask_iou(outputs, reference) == pytest.approx(2 / 3)
    assert bench.hits(outputs, reference, None).tolist() == [pytest.approx(2 / 3), 1.0]
    assert bench.scores(outputs, reference, None)["metric"] == pytest.approx(100 * 2 / 3)
    outputs[0, 0, 1, 0] = 0.3  # at the threshold: not text
    assert bench.mask_iou(outputs, reference) == 1.0


@pytest.mark.slow
def test_demo_quantizes_tunes_and_scores_both_cases(tmp_path: Path) -> None:
    """The README's main job at a few iterations: each case writes its models, config and report,
    and scores the quantized and tuned models in onnxruntime below and against the float one."""
    result = subprocess.run([sys.executable, str(SCRIPTS / "demo.py"), "--json", "--iterations", "20", "--out", str(tmp_path)],
                            capture_output=True, text=True, check=True)
    cases = json.loads(result.stdout)["cases"]
    assert [c["case"] for c in cases] == ["transformer_mx4", "cnn_int4w_int8a"]
    for case in cases:
        # no order between the three: the trained CNN depends on the CPU's float kernels, and its quantized
        # form scored below float on one CPU, the same on another, above on a third
        assert case["float"] > 80 and case["quantized"] > 80 and case["recovered"] > 80
        assert case["iterations_per_unit"] == 20 and case["kept"] >= 1
        for suffix in ("float.onnx", "quantized.onnx", "tuned.onnx", "config.yaml", "finetune.json", "finetune.png"):
            assert (tmp_path / f"{case['case']}.{suffix}").stat().st_size > 0


def test_bench_automp_reports_the_search_beside_the_uniform_rungs(tmp_path: Path) -> None:
    """The MX ladder by layer and by tensor (activation and weight apart), each beside its uniform rungs."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_automp.py"), "--models", "digits", "--ladders", "mx,mx-tensor", "--drops", "0.02",
         "--finetune-iterations", "20", "--json", str(tmp_path / "automp.json")],
        capture_output=True, text=True, check=True,
    )
    report = json.loads(result.stdout)
    assert report == json.loads((tmp_path / "automp.json").read_text())
    assert [ladder["ladder"] for ladder in report["results"]] == ["mx", "mx-tensor"]
    for ladder in report["results"]:
        (row,) = ladder["targets"]
        assert ladder["model"] == "digits" and row["met"] and row["onnxruntime_metric"] >= row["target"]
        assert [p["name"] for p in ladder["uniform"]] == ["MX4", "MX6", "MX9"]
        assert ladder["uniform"][0]["average_bits"] <= row["average_bits"] <= ladder["uniform"][-1]["average_bits"]
        assert set(ladder["seconds"]) == {"sensitivity_shared", "prepare"} and set(row["seconds"]) >= {"search", "finetune"}
        assert ladder["finetune"]["algorithm"] == "adaquant" and ladder["finetune"]["iterations"] == 20
        searched = ladder["seconds"]["sensitivity_shared"] + row["seconds"]["search"]
        assert row["search_over_finetune"] == pytest.approx(searched / ladder["finetune"]["seconds"])
        assert len(row["curve"]) >= 4 and isinstance(row["curve_above_uniform_line"], bool)


def test_bench_automp_records_a_target_the_search_refuses_and_goes_on() -> None:
    """A target even the top rung misses is the search's one-line error: the bench keeps it beside
    the goal, as that target's result, instead of losing the other targets' results."""
    refusal = "target top1_accuracy 0.9 is missed even with every searched layer at the top rung (top1_accuracy 0.8 there)"

    class Refusing:
        def choose(self, **goal: Any) -> Any:
            raise ValueError(refusal)

    assert script("bench_automp").choose_or_refusal(Refusing(), {"max_drop": 0.005}, 0) == {"max_drop": 0.005, "refused": refusal}


def test_profile_step_reports_where_a_cpu_step_goes() -> None:
    """One case, a few steps: the bare time per step, the quantization overhead (steps alternating with
    and without the quantizers) and both profiles' tables, as JSON."""
    result = subprocess.run([sys.executable, str(SCRIPTS / "profile_step.py"), "--cases", "digits:XINT8", "--iterations", "4",
                             "--threads", "1", "--overhead"], capture_output=True, text=True, check=True)
    (case,) = json.loads(result.stdout)
    assert case["case"] == "digits:XINT8" and case["steps"] == 4 * 5  # 5 layer units of the digits CNN
    overhead = case["quantization_overhead"]
    assert overhead["steps"] == 4 * 5 and overhead["overhead"] == pytest.approx(
        overhead["ms_per_step_quantized"] / overhead["ms_per_step_quantizers_off"], rel=0.01)
    assert case["ms_per_step"] > 0 and case["operators"] and case["python"]
    assert any("convolution" in row["op"] for row in case["operators"])


def test_conformance_reports_real_control_flow_and_recurrent_models() -> None:
    """Both silero detectors quantize, run in onnxruntime, lift equal to it and are scored against float."""
    result = subprocess.run([sys.executable, str(SCRIPTS / "conformance.py"), "--models", "silero_v5,silero_v6", "--presets", "MX6"],
                            capture_output=True, text=True, check=True)
    rows = {(row["model"], row["preset"]): row for row in json.loads(result.stdout)["rows"]}
    assert set(rows) == {("silero_v5", "float"), ("silero_v5", "MX6"), ("silero_v6", "float"), ("silero_v6", "MX6")}
    for model in ("silero_v5", "silero_v6"):
        assert rows[(model, "float")]["decision_agreement"] == 1.0
        quantized = rows[(model, "MX6")]
        # 0 here; a last-bit difference of another CPU's sums may move one MX6 element a step (< 1e-2 at these magnitudes)
        assert quantized["quantized_nodes"] > 0 and quantized["lifted_vs_onnxruntime_max_abs"] < 1e-2
        assert 0 < quantized["mean_probability_gap"] < 0.5


@pytest.mark.slow
def test_bench_ort_formats_reports_ratios_to_int8_and_output_digests(tmp_path: Path) -> None:
    """One encoder layer, two formats; a second run compared with the first finds the same bits."""
    command = [sys.executable, str(SCRIPTS / "bench_ort_formats.py"), "--layers", "1", "--batch", "1",
               "--repeats", "1", "--formats", "MXINT8", "MX4"]
    first = subprocess.run([*command, "--profile"], capture_output=True, text=True, check=True).stdout
    report = json.loads(first)
    assert set(report["formats"]) == {"A8W8", "MXINT8", "MX4"} and report["layers"] == 1
    for row in report["formats"].values():
        assert row["seconds"] > 0 and row["vs_int8"] > 0 and row["op_seconds"]
    assert report["formats"]["MXINT8"]["sha256"] != report["formats"]["MX4"]["sha256"]
    (tmp_path / "first.json").write_text(first)
    second = subprocess.run([*command, "--compare", str(tmp_path / "first.json")], capture_output=True, text=True, check=True)
    assert all(row["same_bits_as_compared"] for row in json.loads(second.stdout)["formats"].values())


def test_bench_llm_int4_reports_perplexity_and_both_weight_forms_timed() -> None:
    result = subprocess.run([sys.executable, str(SCRIPTS / "bench_llm_int4.py"), "--sequences", "2", "--length", "12",
                             "--repeats", "1"], capture_output=True, text=True, check=True)
    report = json.loads(result.stdout)
    perplexity = report["perplexity"]
    assert report["evaluation_tokens"] == 2 * 4 * 11 and all(value >= 1 for value in perplexity.values())
    assert perplexity["int4_g32_matmul_nbits"] == pytest.approx(perplexity["int4_g32"], rel=1e-4)  # same codes, other sums
    for optimized in ("unoptimized", "optimized"):
        assert set(report[f"seconds_per_pass_{optimized}"]) == {"float", "int4_g32_qdq", "int4_g32_matmul_nbits",
                                                                "int4_g128_qdq", "int4_g128_matmul_nbits"}


@pytest.mark.slow
def test_bench_smollm2_judges_each_setting_against_float_and_checks_the_lifted_exports() -> None:
    """SmolLM2's first two blocks (real weights, the whole vocabulary), 4 + 4 sequences of 16 tokens:
    float is judged first, RTN INT4 gets a perplexity and an agreement with float below 1, each step
    its peak RSS; the exports with and without a cache lift within the bound with equal greedy tokens."""
    command = [sys.executable, str(SCRIPTS / "bench_smollm2.py"), "--blocks", "2", "--sequences", "4", "--length", "16",
               "--settings", "int4_per_channel", "--lift"]
    report = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    results = report["results"]
    assert list(results) == ["prepare", "lift", "float", "int4_per_channel"] and report["blocks"] == 2
    assert results["float"]["perplexity"] > 1 and 0 < results["int4_per_channel"]["next_token_agreement"] < 1
    assert results["int4_per_channel"]["perplexity"] != results["float"]["perplexity"]
    assert all(step["peak_rss_mib"] > 0 for step in results.values())
    for cache in ("no_cache", "cache"):
        assert results["lift"][cache]["outputs_within_bound"] and results["lift"][cache]["greedy_equal"]


def test_bench_large_sizes_its_decoder_to_the_weights_asked_for() -> None:
    """The decoder's shape: Llama-like heads, as many blocks as make the size within half a block's
    weights (torch's own count of its parameters, the norms' gains aside)."""
    from finetune.zoo_decoder import TinyDecoder

    bench = script("bench_large")
    shape = bench.decoder_shape(0.077, 256)
    assert (shape.heads, shape.kv_heads, shape.mlp, shape.vocabulary) == (2, 1, 704, bench.VOCABULARY)
    weights = 4 * sum(p.numel() for name, p in TinyDecoder(shape, cache=False).named_parameters() if "norm" not in name)
    block = 4 * 256 * (2 * 256 + 2 * 128 + 3 * 704)
    assert abs(weights - 0.077e9) <= block / 2 and shape.blocks == 4


@pytest.mark.slow
def test_bench_large_tunes_a_decoder_block_by_block_with_its_activations_spilled() -> None:
    """A small decoder (external data forced by a low threshold), quantized and tuned by AdaQuant over
    its decoder blocks with a cache budget of 64 KiB: activations spill to disk, and the output loads
    and runs in onnxruntime."""
    command = [sys.executable, str(SCRIPTS / "bench_large.py"), "--model", "decoder", "--gigabytes", "0.077", "--width", "256",
               "--threshold", "10000000", "--finetune", "adaquant", "--iterations", "2", "--batches", "2", "--batch", "2",
               "--length", "16", "--cache-budget", "65536"]
    report = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    assert report["build"]["shape"]["blocks"] == 4 and report["quantize"]["units"] == 5  # four blocks, then the head
    cache = report["quantize"]["cache"]
    assert cache["spilled_arrays"] > 0 and cache["peak_bytes_in_memory"] <= 65536 < cache["peak_bytes_on_disk"]
    assert report["check"]["loads_in_onnxruntime"] and 0 < report["check"]["relative_error"] < 1
    assert len(report["output_files"]) == 2  # the model and one data file
