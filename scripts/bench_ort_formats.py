"""Benchmark: a MiniLM-style sentence-embedding transformer (BERT-like encoder: 6 layers, hidden
384, 12 heads, intermediate 1536, 128-token sequences; seeded random weights of all-MiniLM-L6-v2's
shapes, no registry weights are installed) exported to ONNX, quantized with this library at INT8 QDQ
(A8W8) and at every block-format preset, each evaluated in onnxruntime through
`finetune.onnx.session.inference_session` (its exact default level) on the same batch, side by side
in one run, the repeats going round the formats in turn. Per format: the median seconds of the
repeats, the ratio to INT8 and a SHA-256 of the output bits, so a run before and after a change of
the function bodies shows whether the bits moved (`--compare earlier.json`). With --profile,
onnxruntime's per-op-type totals for each format.

    OMP_NUM_THREADS=1 python scripts/bench_ort_formats.py --batch 4 --repeats 3 > after.json
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from finetune.onnx.session import inference_session, session_options
from finetune.quantize import quantize_model
from finetune.zoo import export_onnx

INT8 = "A8W8"
BLOCK_PRESETS = ["BFP16", "MX4", "MX6", "MX9", "MXINT8", "MXFP8_E4M3", "MXFP8_E5M2", "MXFP6_E3M2", "MXFP6_E2M3",
                 "MXFP4"]
VOCABULARY, HIDDEN, HEADS, INTERMEDIATE, LAYERS, SEQUENCE = 30522, 384, 12, 1536, 6, 128


class EncoderLayer(nn.Module):
    """One post-norm BERT layer: self-attention and a GELU feed-forward, each with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, INTERMEDIATE), nn.Linear(INTERMEDIATE, HIDDEN)
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [batch, tokens, hidden] through attention and feed-forward."""
        batch, tokens, _ = h.shape
        q, k, v = (t.reshape(batch, tokens, HEADS, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
        attention = torch.softmax(q @ k.transpose(-1, -2) / (HIDDEN // HEADS) ** 0.5, dim=-1) @ v
        h = self.norm1(h + self.out(attention.transpose(1, 2).reshape(batch, tokens, HIDDEN)))
        return self.norm2(h + self.down(nn.functional.gelu(self.up(h))))


class MiniLM(nn.Module):
    """Token and position embeddings, LAYERS encoder layers, mean pooling: a sentence embedding."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCABULARY, HIDDEN), nn.Embedding(SEQUENCE, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [batch, tokens] -> [batch, hidden]."""
        h = self.norm(self.tokens(ids) + self.positions.weight[: ids.shape[1]])
        for layer in self.layers:
            h = layer(h)
        return h.mean(dim=1)


def token_batch(count: int, seed: int) -> np.ndarray:
    """`count` sequences of random token ids."""
    return np.random.default_rng(seed).integers(1000, VOCABULARY, (count, SEQUENCE), dtype=np.int64)


def op_totals(session: ort.InferenceSession) -> dict[str, float]:
    """Seconds per op type from the profile of a session that has run (the ten largest); the
    profile file is removed once read."""
    totals: collections.Counter[str] = collections.Counter()
    profile = Path(session.end_profiling())
    events = json.loads(profile.read_text())
    profile.unlink()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"] / 1e6
    return {op: round(seconds, 3) for op, seconds in totals.most_common(10)}


def profiled_op_seconds(model, feed: dict) -> dict[str, float]:
    """onnxruntime's per-op-type totals of one profiled run of the model."""
    options = session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.gettempdir()) / "bench_ort_formats")
    profiled = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    profiled.run(None, feed)
    return op_totals(profiled)


def evaluate(models: dict, feed: dict, repeats: int) -> dict[str, dict]:
    """Per model: the median seconds of `repeats` timed runs and the output digest. The repeats go
    round the models in turn, so a change in the machine's load reaches every model alike and their
    ratios stay comparable; each turn opens its model's session and warms it up first, so one
    session's memory is held at a time (eleven at once exhausted 8 GB at batch 16)."""
    rows: dict[str, dict] = {name: {} for name in models}
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            session = inference_session(model)
            rows[name]["sha256"] = hashlib.sha256(session.run(None, feed)[0].tobytes()).hexdigest()[:16]
            start = time.perf_counter()
            session.run(None, feed)
            times[name].append(time.perf_counter() - start)
            del session
    for name, row in rows.items():
        row["seconds"] = float(np.median(times[name]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4, help="sequences per evaluation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=LAYERS, help="encoder layers (fewer for a quick check)")
    parser.add_argument("--formats", nargs="*", default=BLOCK_PRESETS, help="block-format presets to measure")
    parser.add_argument("--profile", action="store_true", help="per-op-type seconds of one profiled run")
    parser.add_argument("--compare", type=Path, help="an earlier run's JSON: report whether each output is identical")
    args = parser.parse_args()
    torch.manual_seed(0)
    feed = {"x": token_batch(args.batch, 1)}
    with tempfile.TemporaryDirectory() as folder:
        path = export_onnx(MiniLM(args.layers), torch.from_numpy(token_batch(2, 0)), Path(folder) / "minilm.onnx")
        calibration = [{"x": token_batch(2, 2)}]
        models = {}
        for preset in [INT8, *args.formats]:
            print(f"{preset} ...", file=sys.stderr, flush=True)
            models[preset] = quantize_model(str(path), preset, calibration).model
    print("timing ...", file=sys.stderr, flush=True)
    rows = evaluate(models, feed, args.repeats)
    if args.profile:
        for name, model in models.items():
            rows[name]["op_seconds"] = profiled_op_seconds(model, feed)
    for row in rows.values():
        row["vs_int8"] = round(row["seconds"] / rows[INT8]["seconds"], 2)
        row["seconds"] = round(row["seconds"], 3)
    if args.compare:
        earlier = json.loads(args.compare.read_text())["formats"]
        for name, row in rows.items():
            row["same_bits_as_compared"] = name in earlier and earlier[name]["sha256"] == row["sha256"]
    print(json.dumps({"benchmark": "bench_ort_formats", "weights": "seeded random (all-MiniLM-L6-v2 shapes)",
                      "layers": args.layers, "batch": args.batch, "sequence": SEQUENCE, "repeats": args.repeats,
                      "onnxruntime": ort.__version__, "formats": rows,
                      "max_vs_int8": max(r["vs_int8"] for name, r in rows.items() if name != INT8)}, indent=1))


if __name__ == "__main__":
    main()
