"""The device a fine-tuning run uses: cpu, cuda, cuda:N, or hip:N on ROCm builds of torch (which
expose HIP devices through the cuda API); an unavailable device is an error naming what exists."""

from __future__ import annotations

import re

import torch

from finetune.config import DEVICE_HELP, DEVICE_PATTERN


def resolve_device(name: str) -> torch.device:
    """The torch device for a config's device string, checked against this machine."""
    match = re.fullmatch(DEVICE_PATTERN, name)
    if match is None:
        raise ValueError(f"device {name!r} is not one of {DEVICE_HELP}")
    if match["kind"] is None:
        return torch.device("cpu")
    kind, index = match["kind"], int(match["index"] or 0)
    if kind == "hip" and torch.version.hip is None:
        raise ValueError(f"device {name!r} is not available: this torch {torch.__version__} is not a ROCm build; "
                         f"available: {', '.join(available_devices())}")
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} is not available (torch {torch.__version__}); available: {', '.join(available_devices())}")
    return torch.device("cuda", index)


def available_devices() -> list[str]:
    """The devices this machine offers, as config strings."""
    kind = "hip" if torch.version.hip is not None else "cuda"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu", *(f"{kind}:{i}" for i in range(count))]
