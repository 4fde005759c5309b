"""Calibration: every form of calibration data gives the same checked feeds on every pass; the
observers on known distributions against values computed independently here; streaming and
per-channel results; collect_statistics against the model computed op by op in torch."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader
from torch.utils.data import DataLoader, Dataset, TensorDataset

from finetune.calibrate import (
    CalibrationData,
    MSEObserver,
    collect_statistics,
    make_observer,
    model_inputs,
    qparams,
    random_data,
)
from finetune.formats import FP8_E4M3FN, IntSpec, float_quantize_dequantize, int_quantize_dequantize
from finetune.quantize import quantize_model

INT8 = IntSpec("int8")
XINT8 = IntSpec("int8", power_of_two=True)
UINT8_ASYM = IntSpec("uint8", symmetric=False)
BINS = 4096
HALF = BINS // 2
METHODS = ["minmax", "percentile", "mse", "entropy"]

# --- models -------------------------------------------------------------------------------------


def conv_matmul_model() -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv(4, 3x3, pad 1) + bias -> Relu -> Flatten -> MatMul(256x5) -> y[N,5]."""
    rng = np.random.default_rng(7)
    weights = {
        "w_conv": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "b_conv": rng.standard_normal(4).astype(np.float32),
        "w_fc": (rng.standard_normal((256, 5)) * 0.1).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w_conv", "b_conv"], ["conv_out"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["conv_out"], ["relu_out"], name="relu"),
        helper.make_node("Flatten", ["relu_out"], ["flat"], axis=1, name="flatten"),
        helper.make_node("MatMul", ["flat", "w_fc"], ["y"], name="fc"),
    ]
    graph = helper.make_graph(
        nodes, "conv_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def two_input_model() -> onnx.ModelProto:
    """a[N,4] float + Cast(ids[N,4] int64) -> y: a float and an integer input, batch dynamic."""
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["a", "ids_f"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "two_inputs",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


# --- calibration data ---------------------------------------------------------------------------


@pytest.fixture
def batches() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((2, 3, 8, 8)).astype(np.float32) for _ in range(6)]


class Reader(CalibrationDataReader):
    """A user's reader as onnxruntime's examples write them, optionally with rewind()."""

    def __init__(self, batches: list[np.ndarray]) -> None:
        self.batches = batches
        self.position = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.position == len(self.batches):
            return None
        self.position += 1
        return {"x": self.batches[self.position - 1]}


class RewindingReader(Reader):
    def rewind(self) -> None:
        self.position = 0


class DictDataset(Dataset):
    def __init__(self, samples: np.ndarray) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.from_numpy(self.samples[index])}


def _write_files(folder: Path, arrays: list[np.ndarray], suffix: str) -> Path:
    folder.mkdir()
    for index, array in enumerate(arrays):
        if suffix == ".npy":
            np.save(folder / f"batch_{index:02d}.npy", array)
        else:
            np.savez(folder / f"batch_{index:02d}.npz", x=array)
    return folder


SOURCES = {
    "reader": lambda b, tmp: RewindingReader(b),
    "dicts": lambda b, tmp: [{"x": a} for a in b],
    "float64 dicts": lambda b, tmp: [{"x": a.astype(np.float64)} for a in b],
    "tensor list": lambda b, tmp: [torch.from_numpy(a) for a in b],
    "dataloader": lambda b, tmp: DataLoader(TensorDataset(torch.from_numpy(np.concatenate(b))), batch_size=2),
    "dict dataloader": lambda b, tmp: DataLoader(DictDataset(np.concatenate(b)), batch_size=2),
    "npy folder": lambda b, tmp: _write_files(tmp / "npy", b, ".npy"),
    "npz folder": lambda b, tmp: str(_write_files(tmp / "npz", b, ".npz")),
    "npy samples": lambda b, tmp: _write_files(tmp / "samples", [s for a in b for s in a], ".npy"),
}


def _assert_feeds_equal(feeds: list[dict[str, np.ndarray]], expected: list[dict[str, np.ndarray]]) -> None:
    assert len(feeds) == len(expected)
    for feed, want in zip(feeds, expected):
        assert feed.keys() == want.keys()
        for name in want:
            assert feed[name].dtype == want[name].dtype
            np.testing.assert_array_equal(feed[name], want[name])


@pytest.mark.parametrize("form", list(SOURCES))
def test_every_form_gives_the_same_feeds_on_every_pass(form: str, batches: list[np.ndarray], tmp_path: Path) -> None:
    """Same float32 feeds from every form (samples without a batch dimension get one; 12 samples
    regrouped in pairs by a limit-free pass are compared sample by sample), twice in a row."""
    data = CalibrationData(SOURCES[form](batches, tmp_path), conv_matmul_model())
    samples = [{"x": s[None]} for a in batches for s in a]
    expected = samples if form == "npy samples" else [{"x": a} for a in batches]
    _assert_feeds_equal(list(data), expected)
    _assert_feeds_equal(list(data), expected)


def test_limit_counts_samples_and_cuts_the_last_batch(batches: list[np.ndarray]) -> None:
    data = CalibrationData([{"x": a} for a in batches], conv_matmul_model(), limit=5)
    assert [feed["x"].shape[0] for feed in data] == [2, 2, 1]
    np.testing.assert_array_equal(list(data)[-1]["x"], batches[2][:1])


def test_random_data_is_explicit_reproducible_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        data = random_data(two_input_model(), n=3, seed=5, batch=2)
    assert any("random" in record.message for record in caplog.records if record.levelno == logging.WARNING)
    first, second = list(data), list(data)
    _assert_feeds_equal(first, second)
    assert first[0]["a"].shape == (2, 4) and first[0]["a"].dtype == np.float32
    assert first[0]["ids"].dtype == np.int64 and first[0]["ids"].min() >= 0
    assert not np.array_equal(first[0]["a"], first[1]["a"])


def test_multi_input_dicts_tuples_and_npz_agree(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    feeds = [{"a": rng.standard_normal((3, 4)).astype(np.float32), "ids": rng.integers(0, 9, (3, 4))} for _ in range(3)]
    folder = tmp_path / "npz"
    folder.mkdir()
    for index, feed in enumerate(feeds):
        np.savez(folder / f"{index}.npz", **feed)
    model = two_input_model()
    for source in (feeds, [(f["a"], f["ids"]) for f in feeds], folder):
        _assert_feeds_equal(list(CalibrationData(source, model)), feeds)


def test_a_scalar_input_stays_a_scalar(tmp_path: Path) -> None:
    """A rank-0 input (a voice-activity model's sample rate) is fed as a 0-d array from an .npz
    file or a dict; it was made 1-d, which the model refused."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Cast", ["rate"], ["rate_float"], to=TensorProto.FLOAT), helper.make_node("Mul", ["x", "rate_float"], ["y"])],
        "scalar_input", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
                         helper.make_tensor_value_info("rate", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])]), opset_imports=[helper.make_opsetid("", 17)])
    feed = {"x": np.ones((2, 4), np.float32), "rate": np.array(16000, np.int64)}
    np.savez(tmp_path / "0.npz", **feed)
    for source in ([feed], tmp_path):
        (read,) = list(CalibrationData(source, model))
        assert read["rate"].shape == () and int(read["rate"]) == 16000


def test_extra_tuple_items_are_ignored_with_one_warning(
    batches: list[np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    labelled = [(a, np.zeros(2, np.int64)) for a in batches]
    with caplog.at_level(logging.WARNING):
        feeds = list(CalibrationData(labelled, conv_matmul_model()))
    _assert_feeds_equal(feeds, [{"x": a} for a in batches])
    assert sum("ignoring the rest" in record.message for record in caplog.records) == 1


def test_single_pass_sources_say_what_a_second_pass_needs(batches: list[np.ndarray]) -> None:
    reader = CalibrationData(Reader(batches), conv_matmul_model())
    assert len(list(reader)) == 6
    with pytest.raises(RuntimeError, match=r"Reader has no rewind\(\)"):
        list(reader)
    generator = CalibrationData(({"x": a} for a in batches), conv_matmul_model())
    assert len(list(generator)) == 6
    with pytest.raises(RuntimeError, match="one-shot iterator"):
        list(generator)


@pytest.mark.parametrize("preset", ["XINT8", "A8W8"])
def test_quantize_makes_its_one_pass_over_a_reader_without_rewind_and_a_generator(batches: list[np.ndarray], preset: str) -> None:
    """INT presets need one pass over the data: a reader with only get_next() and a generator give
    the same model as a list (a progress bar's iter() before iterating must not count as a pass)."""
    expected = quantize_model(conv_matmul_model(), preset, [{"x": a} for a in batches]).model
    for source in (Reader(batches), ({"x": a} for a in batches)):
        assert quantize_model(conv_matmul_model(), preset, source).model == expected


def _two_inputs(a: np.ndarray | None = None, ids: np.ndarray | None = None, **extra: np.ndarray) -> dict:
    """A feed for two_input_model, with valid defaults for what is not given."""
    a = np.zeros((1, 4), np.float32) if a is None else a
    return {"a": a, "ids": np.zeros((1, 4), np.int64) if ids is None else ids, **extra}


@pytest.mark.parametrize(
    ("feed", "message"),
    [
        ({"a": np.zeros((1, 4), np.float32)}, r"missing inputs \['ids'\]"),
        (_two_inputs(b=np.zeros(1)), r"unknown input names \['b'\]"),
        (_two_inputs(a=np.zeros((1, 4), np.int64)), "input 'a' is int64 but the model expects float32"),
        (_two_inputs(ids=np.zeros((1, 4), np.float32)), "input 'ids' is float32"),
        (_two_inputs(a=np.zeros((1, 1, 4), np.float32)), "input 'a' has rank 3"),
        (_two_inputs(a=np.zeros((1, 5), np.float32)), r"input 'a' has shape \[1, 5\] but the model expects \[\?, 4\]"),
        (_two_inputs(ids=np.full((1, 4), 2**63, np.uint64)), "do not fit"),
    ],
)
def test_bad_feeds_name_the_item_and_input(feed: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        list(CalibrationData([feed], two_input_model()))
    assert "calibration item 0" in str(error.value)


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no .npy or .npz files"):
        CalibrationData(tmp_path, conv_matmul_model())
    np.save(tmp_path / "a.npy", np.zeros((1, 3, 8, 8), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((8, 8), np.float32))
    data = CalibrationData(tmp_path, conv_matmul_model())
    with pytest.raises(ValueError, match=r"b\.npy: input 'x' has rank 2"):
        list(data)
    with pytest.raises(ValueError, match=r"a\.npy holds one array but the model has inputs \['a', 'ids'\]"):
        list(CalibrationData(tmp_path, two_input_model()))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CalibrationData(tmp_path / "missing", conv_matmul_model())


def test_model_inputs_skip_initializers_and_keep_dynamic_dims() -> None:
    model = conv_matmul_model()
    model.graph.input.append(helper.make_tensor_value_info("w_fc", TensorProto.FLOAT, [256, 5]))
    (info,) = model_inputs(model)
    assert (info.name, info.dtype, info.shape) == ("x", np.dtype(np.float32), (None, 3, 8, 8))


# --- observers: known distributions -------------------------------------------------------------


def _mse(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, spec: IntSpec) -> float:
    y = int_quantize_dequantize(torch.from_numpy(x), torch.as_tensor(scale), torch.as_tensor(zero_point), spec)
    return float(np.mean((x - y.numpy()) ** 2))


def _qdq_mse(x: np.ndarray, spec, scale: np.ndarray, zero_point: np.ndarray) -> float:
    if isinstance(spec, IntSpec):
        return _mse(x, scale, zero_point, spec)
    return float(np.mean((x - float_quantize_dequantize(torch.from_numpy(x), spec, float(scale)).numpy()) ** 2))


def _observe(method: str, spec, x: np.ndarray, batches: int = 1, **options):
    observer = make_observer(method, spec, **options)
    for part in np.array_split(x, batches):
        observer.update(part)
    return observer


def _gaussian_with_outliers(n: int = 200_000, outliers: int = 3, at: float = 40.0, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    x[np.linspace(0, n - 1, outliers).astype(int)] = at
    return x


def test_minmax_is_exact() -> None:
    x = np.random.default_rng(0).uniform(-3, 5, 10_000).astype(np.float32)
    lo, hi = _observe("minmax", UINT8_ASYM, x, batches=7).clip_range()
    assert (lo, hi) == (x.min(), x.max())
    scale, zero_point = _observe("minmax", UINT8_ASYM, x).scale_zero_point()
    np.testing.assert_array_equal(scale, np.float32((x.max() - x.min()) / 255))
    assert scale.shape == () and scale.dtype == np.float32 and zero_point.dtype == np.float32


@pytest.mark.parametrize("distribution", ["uniform", "normal"])
@pytest.mark.parametrize("percentile", [99.0, 99.99])
def test_percentile_matches_numpy_within_a_bin(distribution: str, percentile: float) -> None:
    rng = np.random.default_rng(3)
    x = (rng.uniform(-2, 6, 300_000) if distribution == "uniform" else rng.normal(1, 2, 300_000)).astype(np.float32)
    width = np.abs(x).max() / HALF
    symmetric = _observe("percentile", INT8, x, percentile=percentile)
    _, t = symmetric.clip_range()
    assert abs(t - np.percentile(np.abs(x), percentile)) <= 2 * width
    tail = (100 - percentile) / 2
    lo, hi = _observe("percentile", UINT8_ASYM, x, percentile=percentile).clip_range()
    assert abs(lo - min(np.percentile(x, tail), 0)) <= 2 * width
    assert abs(hi - np.percentile(x, 100 - tail)) <= 2 * width


def test_mse_clips_outliers_and_beats_minmax() -> None:
    """One outlier at 40 among 200,000 N(0, 1) values: the optimum balances clipping (40 - t)^2 / n
    against rounding (t / 127)^2 / 12, near t = 20, at half MinMax's error."""
    x = _gaussian_with_outliers(outliers=1)
    mse = _observe("mse", INT8, x)
    _, t = mse.clip_range()
    assert 15 < t < 25
    best = _mse(x, *mse.scale_zero_point(), INT8)
    minmax = _mse(x, *_observe("minmax", INT8, x).scale_zero_point(), INT8)
    assert best < 0.6 * minmax
    # Exhaustive search on the data itself, thresholds 0.1 apart: the histogram search is within 1 %.
    exhaustive = min(_mse(x, *qparams(np.float32(-a), np.float32(a), INT8), INT8) for a in np.arange(10, 30, 0.1))
    assert best <= 1.01 * exhaustive


@pytest.mark.parametrize("spec", [UINT8_ASYM, FP8_E4M3FN], ids=["uint8", "fp8"])
def test_mse_predicted_error_matches_the_real_error(spec) -> None:
    """The histogram integral is the real quantization MSE up to the bin resolution."""
    x = _gaussian_with_outliers()
    observer = _observe("mse", spec, x)
    alphas = np.exp2(-np.arange(0, 80, 8) / 8)[:, None]
    predicted = observer.expected_errors(alphas)[:, 0]
    real = [_qdq_mse(x, spec, *qparams(np.float32(a * x.min()), np.float32(a * x.max()), spec)) for a in alphas[:, 0]]
    np.testing.assert_allclose(predicted, real, rtol=0.02)


def test_mse_for_fp8_keeps_minmax_when_clipping_does_not_pay() -> None:
    """FP8's relative precision makes the error nearly scale-free: clipping 40 only adds error."""
    x = _gaussian_with_outliers()
    scale, zero_point = _observe("mse", FP8_E4M3FN, x).scale_zero_point()
    assert zero_point == 0
    assert _qdq_mse(x, FP8_E4M3FN, scale, zero_point) <= _qdq_mse(x, FP8_E4M3FN, np.float32(40 / 448), 0)


@pytest.mark.parametrize(
    "distribution", ["outliers", "uniform", "laplace", "small"],
)
def test_power_of_two_minmse_picks_the_exhaustive_k(distribution: str) -> None:
    rng = np.random.default_rng(11)
    x = {
        "outliers": _gaussian_with_outliers(outliers=20),
        "uniform": rng.uniform(-3, 3, 200_000).astype(np.float32),
        "laplace": rng.laplace(0, 1, 200_000).astype(np.float32),
        "small": (rng.standard_normal(200_000) * 1e-3).astype(np.float32),
    }[distribution]
    scale, zero_point = _observe("minmse", XINT8, x, batches=4).scale_zero_point()
    k = np.log2(scale)
    assert k == np.round(k) and zero_point == 0
    errors = {j: _mse(x, np.float32(2.0**j), np.float32(0), XINT8) for j in range(int(k) - 6, int(k) + 7)}
    assert int(k) == min(errors, key=errors.get)


def test_power_of_two_minmse_edge_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    """All zeros give 2^0; NaN and Inf are ignored; ties go to the widest range (the largest k)."""
    zeros = _observe("minmse", XINT8, np.zeros(100, np.float32))
    assert zeros.scale_zero_point()[0] == 1.0
    x = np.random.default_rng(2).standard_normal(10_000).astype(np.float32)
    dirty = np.concatenate([x, [np.nan, np.inf, -np.inf]]).astype(np.float32)
    assert _observe("minmse", XINT8, dirty).scale_zero_point()[0] == _observe("minmse", XINT8, x).scale_zero_point()[0]
    monkeypatch.setattr(MSEObserver, "expected_errors", lambda self, alphas: np.zeros(alphas.shape))
    widest = _observe("minmse", XINT8, x).scale_zero_point()[0]
    assert widest == 2.0 ** np.ceil(np.log2(np.abs(x).max() / 127))


def test_entropy_threshold_lies_well_below_an_outlier() -> None:
    x = _gaussian_with_outliers(outliers=1, at=100.0)
    _, t = _observe("entropy", INT8, x).clip_range()
    assert 2.0 < t < 10.0
    _, t_clean = _observe("entropy", INT8, x[x < 50]).clip_range()
    assert 2.5 < t_clean <= np.abs(x[x < 50]).max()


def test_unsupported_specs_and_methods_are_errors() -> None:
    with pytest.raises(ValueError, match="must be one of"):
        make_observer("kl", INT8)
    with pytest.raises(ValueError, match="needs an integer spec"):
        make_observer("entropy", FP8_E4M3FN)
    with pytest.raises(ValueError, match="no per-block mode"):
        make_observer("mse", IntSpec("int4", axis=0, block_size=32))
    with pytest.raises(RuntimeError, match="no data observed"):
        make_observer("minmax", INT8).scale_zero_point()


# --- observers: granularity and streaming -------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_per_channel_equals_per_tensor_on_each_channel(method: str) -> None:
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((16, 3, 12, 12)) * np.array([0.1, 1.0, 30.0])[:, None, None]).astype(np.float32)
    scale, zero_point = _observe(method, INT8, x, batches=4, axis=1).scale_zero_point()
    assert scale.shape == zero_point.shape == (3,)
    for c in range(3):
        expected = _observe(method, INT8, x[:, c], batches=4).scale_zero_point()
        np.testing.assert_allclose(scale[c], expected[0], rtol=1e-6)


def test_blocked_minmax_matches_numpy() -> None:
    w = np.random.default_rng(5).standard_normal((6, 70)).astype(np.float32)
    spec = IntSpec("int4", axis=1, block_size=32)
    scale, _ = _observe("minmax", spec, w).scale_zero_point()
    assert scale.shape == (6, 3)
    blocks = [w[:, i:i + 32] for i in range(0, 70, 32)]
    expected = np.stack([np.abs(b).max(axis=1) / 7 for b in blocks], axis=1)
    np.testing.assert_allclose(scale, expected, rtol=1e-6)


def test_histogram_growth_is_exact() -> None:
    """Batches of growing range give the same histogram as one pass over the final range."""
    rng = np.random.default_rng(6)
    parts = [rng.standard_normal(5_000).astype(np.float32) * 3.0**b for b in range(6)]
    observer = _observe("percentile", INT8, parts[0])
    for part in parts[1:]:
        observer.update(part)
    width = observer._radius[0] / HALF
    assert observer._radius[0] >= max(np.abs(p).max() for p in parts)
    x = np.concatenate(parts)
    expected = np.bincount(np.clip(np.floor(x / width), -HALF, HALF - 1).astype(np.int64) + HALF, minlength=BINS)
    np.testing.assert_array_equal(observer._counts[0], expected)


@pytest.mark.parametrize("method", METHODS)
def test_ten_batches_equal_one_concatenated_batch(method: str) -> None:
    rng = np.random.default_rng(8)
    x = np.concatenate([rng.standard_normal(20_000) * (1 + b) for b in range(10)]).astype(np.float32)
    streamed = _observe(method, INT8, x, batches=10)
    whole = _observe(method, INT8, x)
    if method == "minmax":
        assert streamed.clip_range() == whole.clip_range()
        return
    t_streamed, t_whole = streamed.clip_range()[1], whole.clip_range()[1]
    resolution = 2 * streamed._radius[0] / HALF
    if method == "mse":  # a flat optimum: compare the quantization error reached
        assert _mse(x, *streamed.scale_zero_point(), INT8) <= 1.01 * _mse(x, *whole.scale_zero_point(), INT8)
    else:
        assert abs(t_streamed - t_whole) <= max(resolution, 0.03 * t_whole)


# --- collect_statistics -------------------------------------------------------------------------


def _torch_activations(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    """The model computed op by op in torch, independently of onnxruntime."""
    w = {t.name: torch.tensor(numpy_helper.to_array(t)) for t in model.graph.initializer}
    conv = F.conv2d(torch.from_numpy(x), w["w_conv"], w["b_conv"], padding=1)
    relu = torch.relu(conv)
    y = relu.flatten(1) @ w["w_fc"]
    return {"x": x, "conv_out": conv.numpy(), "relu_out": relu.numpy(), "y": y.numpy()}


@pytest.mark.parametrize("external", [False, True])
def test_collect_statistics_matches_the_model_op_by_op(
    external: bool, batches: list[np.ndarray], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if external:
        monkeypatch.setattr("finetune.onnx.io.EXTERNAL_DATA_THRESHOLD", 0)  # as if the model were over 2 GB
    model = conv_matmul_model()
    before = model.SerializeToString()
    names = ["x", "w_conv", "conv_out", "relu_out", "y"]
    observers = {name: make_observer("minmax", INT8) for name in names}
    observers["conv_hist"] = make_observer("percentile", INT8, percentile=99.0)
    with caplog.at_level(logging.INFO):
        with pytest.raises(ValueError, match=r"\['conv_hist'\]"):
            collect_statistics(model, CalibrationData(batches, model), observers, progress=False)
        del observers["conv_hist"]
        collect_statistics(model, CalibrationData(batches, model), observers, progress=False, log_every=2)
    assert model.SerializeToString() == before
    assert sum("calibration: " in record.message for record in caplog.records) == 3
    per_batch = [_torch_activations(model, b) for b in batches]
    for name in ("x", "conv_out", "relu_out", "y"):
        values = np.concatenate([a[name].ravel() for a in per_batch])
        lo, hi = observers[name].clip_range()
        np.testing.assert_allclose([lo, hi], [values.min(), values.max()], rtol=1e-5, atol=1e-6)
    w_conv = numpy_helper.to_array(model.graph.initializer[0])
    assert observers["w_conv"].clip_range() == (w_conv.min(), w_conv.max())


def test_collect_statistics_streams_into_per_channel_histograms(batches: list[np.ndarray]) -> None:
    """Observers fed by collect_statistics equal the same observers updated with torch's values."""
    model = conv_matmul_model()
    observers = {"conv_out": make_observer("mse", INT8, axis=1), "y": make_observer("entropy", INT8)}
    collect_statistics(model, CalibrationData(batches, model), observers, progress=False)
    direct = {"conv_out": make_observer("mse", INT8, axis=1), "y": make_observer("entropy", INT8)}
    for batch in batches:
        activations = _torch_activations(model, batch)
        for name, observer in direct.items():
            observer.update(activations[name])
    for name in direct:
        np.testing.assert_allclose(observers[name].scale_zero_point()[0], direct[name].scale_zero_point()[0], rtol=1e-3)
    assert observers["conv_out"].scale_zero_point()[0].shape == (4,)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_calibration_data_is_an_error_naming_the_item_and_input(batches: list[np.ndarray], bad: float) -> None:
    poisoned = [a.copy() for a in batches]
    poisoned[3][0, 1, 2, 2] = bad
    with pytest.raises(ValueError, match=r"calibration item 3: input 'x' holds 1 NaN or Inf values"):
        list(CalibrationData([{"x": a} for a in poisoned], conv_matmul_model()))

