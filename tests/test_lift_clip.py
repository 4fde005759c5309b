"""Clip with each bound present, omitted (an empty name, or left off the end) or computed, in every
opset that has it (bounds as attributes in Clip-6, as inputs from Clip-11), and the pooling and
normalisation heads whose exports write such Clips (`clamp(min=)`, `clamp(max=)`, F.normalize,
masked mean, from both torch exporters): lifted equal to onnxruntime, and a sentence-embedding
model ending in them quantized and tuned."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from torch import nn

from finetune.config import FastFinetune
from finetune.lift import lift_model
from finetune.lift.kinds import is_activation
from finetune.quantize import quantize_model
from finetune.recon import finetune_model
from finetune.recon.units import find_units

from .lift_helpers import assert_same, onnx_model, run_ort, run_torch, tensor

LOW, HIGH = -0.5, 0.75
# ±inf: onnxruntime clamps them to the dtype's finite extremes where a bound is omitted (ONNX
# defaults it to the type's lowest and max); NaN passes through; -0.0 and values on the bounds too.
SPECIALS = np.array([np.nan, -np.inf, np.inf, -0.0, 0.0, LOW, HIGH, 1e38, -1e38], np.float32)
EPS = float(np.finfo(np.float32).eps)


def _x(spread: float = 2.0) -> np.ndarray:
    """Random values within ±spread, then every special value."""
    x = np.random.default_rng(0).uniform(-spread, spread, (3, 9)).astype(np.float32)
    x[0] = SPECIALS
    return x


def _bound_inputs(low: str, high: str) -> tuple[list[str], dict[str, np.ndarray], list[str]]:
    """The Clip's input names, its constant bounds and its computed ones (graph inputs `lo`, 0-d,
    and `hi`, shape [1], which onnxruntime takes as a scalar too) for each kind of bound."""
    names: list[str] = ["x"]
    constants: dict[str, np.ndarray] = {}
    computed: list[str] = []
    for kind, name, value, shape in ((low, "lo", LOW, ()), (high, "hi", HIGH, (1,))):
        if kind == "left_off":
            continue
        names.append("" if kind == "empty" else name)
        if kind == "constant":
            constants[name] = np.full(shape, value, np.float32)
        elif kind == "computed":
            computed.append(name)
    return names, constants, computed


CLIP_BOUNDS = [(low, high) for low in ("constant", "empty", "computed") for high in ("constant", "empty", "left_off", "computed")]


@pytest.mark.parametrize("opset", [11, 12, 13])
@pytest.mark.parametrize(("low", "high"), CLIP_BOUNDS + [("left_off", "left_off")])
def test_clip_bounds_present_omitted_or_computed(low: str, high: str, opset: int) -> None:
    """Clip-11/12/13 with every combination of bound kinds equals onnxruntime exactly (a clamp sums
    nothing), infinities and NaN included; with constant bounds it is an activation that joins
    its layer's unit, with a computed one a module reading them per call, which is not."""
    names, constants, computed = _bound_inputs(low, high)
    shapes = {"lo": [], "hi": [1]}
    node = helper.make_node("Clip", names, ["y"], name="clip")
    graph_inputs = [tensor("x", ["n", 9])] + [tensor(name, shapes[name]) for name in computed]
    model = onnx_model([node], graph_inputs, [tensor("y", None)], constants, opset)
    lifted = lift_model(model)
    assert_same(model, lifted, [_x()] + [np.full(shapes[name], {"lo": LOW, "hi": HIGH}[name], np.float32) for name in computed])
    assert is_activation(lifted.get_submodule("clip")) == (not computed)


@pytest.mark.parametrize("attributes", [{}, {"min": LOW}, {"max": HIGH}, {"min": LOW, "max": HIGH}, {"min": 0.0},
                                        {"min": 0.0, "max": 6.0}])
def test_clip_6_bounds_as_attributes(attributes: dict[str, float]) -> None:
    """Clip-6 takes its bounds as attributes, each optional: equal to onnxruntime, an activation."""
    model = onnx_model([helper.make_node("Clip", ["x"], ["y"], name="clip", **attributes)], [tensor("x", ["n", 9])],
                       [tensor("y", None)], opset=6)
    lifted = lift_model(model)
    assert_same(model, lifted, [_x(spread=8.0)])
    assert is_activation(lifted.get_submodule("clip"))


@pytest.mark.parametrize("computed", [False, True])
def test_integer_clip_keeps_its_dtype(computed: bool) -> None:
    """An int32 Clip (Clip-12 and later) with a constant or computed min and no max stays int32 and
    exact (an omitted integer bound is the type's extreme, which clips nothing)."""
    lo = np.array(-3, np.int32)
    inputs = [tensor("x", ["n", 5], TensorProto.INT32)] + ([tensor("lo", [], TensorProto.INT32)] if computed else [])
    node = helper.make_node("Clip", ["x", "lo", ""], ["y"], name="clip")
    model = onnx_model([node], inputs, [tensor("y", None, TensorProto.INT32)], {} if computed else {"lo": lo}, 13)
    x = np.array([[np.iinfo(np.int32).min, -4, -3, 0, np.iinfo(np.int32).max]], np.int32)
    assert_same(model, lift_model(model), [x, lo] if computed else [x])


@pytest.mark.parametrize("computed", [False, True])
def test_a_clip_with_a_computed_bound_stays_out_of_its_layers_unit(computed: bool) -> None:
    """A MatMul whose sole reader is a constant-bounded Clip ends its unit with it (the loss sees
    what the activation keeps); one whose Clip reads a computed bound ends at the MatMul, since the
    unit does not compute that bound; block units are found either way."""
    rng = np.random.default_rng(0)
    weights = {"w1": rng.standard_normal((8, 8), np.float32), "w2": rng.standard_normal((8, 8), np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="matmul1"),
             helper.make_node("ReduceMin", ["x"], ["lo"], name="lowest", keepdims=0),
             helper.make_node("Clip", ["h", "lo" if computed else "zero", ""], ["c"], name="clip"),
             helper.make_node("MatMul", ["c", "w2"], ["y"], name="matmul2")]
    constants = weights if computed else {**weights, "zero": np.array(0.1, np.float32)}
    model = onnx_model(nodes, [tensor("x", ["n", 8])], [tensor("y", None)], constants, 13)
    lifted = lift_model(model)
    assert_same(model, lifted, [rng.standard_normal((4, 8), np.float32)], atol=1e-5, rtol=1e-5)
    first = find_units(lifted, ("MatMul",))[0]
    assert first.target_module == ("matmul1" if computed else "clip")
    assert find_units(lifted, ("MatMul",), unit="block")


# --- heads as torch exports them ----------------------------------------------------------------------


class Head(nn.Module):
    """One pooling or normalisation head over token states `h` [batch, tokens, width] and an
    attention `mask` [batch, tokens] (int64, as tokenizers give it)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.kind == "clamp_min":
            return torch.clamp(h, min=LOW) * mask.unsqueeze(-1)
        if self.kind == "clamp_max":
            return torch.clamp(h, max=HIGH) * mask.unsqueeze(-1)
        if self.kind == "clamp_computed":  # a bound from an integer sum and one division: exact in any library
            return torch.clamp(h, min=-mask.sum() / 10)
        if self.kind == "normalize":
            return F.normalize(h, p=2, dim=-1) * mask.unsqueeze(-1)
        return mean_pooling(h, mask)


def mean_pooling(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over the tokens, as sentence-transformers computes it."""
    weights = mask.unsqueeze(-1).to(h.dtype)
    return torch.sum(h * weights, 1) / torch.clamp(weights.sum(1), min=1e-9)


def export(module: nn.Module, example: tuple[torch.Tensor, ...], dynamo: bool, path: Path) -> onnx.ModelProto:
    """`module` exported by TorchScript (opset 17) or torch.export (opset 18), inputs `h` and `mask`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, example, dynamo=True, opset_version=18, verbose=False).save(str(path))
        else:
            torch.onnx.export(module, example, str(path), dynamo=False, opset_version=17, input_names=["h", "mask"])
    return onnx.load(str(path))


def _feeds(batch: int = 3, tokens: int = 6, width: int = 16, seed: int = 0) -> list[np.ndarray]:
    """Token states and a mask with padded tokens and one row all padding (a zero count: the
    clamp's min is what keeps the mean finite)."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(tokens)[None, :] < rng.integers(1, tokens, (batch, 1))).astype(np.int64)
    mask[-1] = 0
    return [rng.standard_normal((batch, tokens, width)).astype(np.float32), mask]


def _within_sum_bound(model: onnx.ModelProto, lifted: nn.Module, feeds: list[np.ndarray],
                      bound: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
    """Lifted and onnxruntime agree within `bound(h, expected)` element-wise: where a head sums, the
    two libraries may add in other orders (onnxruntime picks kernels by CPU features), so only the
    float32 error bound of that sum is portable, not this machine's difference."""
    expected, actual = run_ort(model, feeds)[0], run_torch(lifted, feeds)[0]
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert np.all(np.abs(actual.astype(np.float64) - expected) <= bound(feeds[0], expected))


def _mean_bound(h: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Two summation orders of n terms each err by at most n·eps·Σ|terms| (the count is exact), and
    the division adds half an ulp to each: 2·n·eps·Σ|h| / count + eps·|y|, per output."""
    tokens = h.shape[1]
    return 2 * tokens * EPS * np.abs(h).sum(1) + EPS * np.abs(expected)


def _normalize_bound(h: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """The norm's sum of n squares errs relatively by n·eps in either order, its square root halves
    that, the division adds an ulp: (n + 4)·eps·|y| covers both sides."""
    return (h.shape[-1] + 4) * EPS * np.abs(expected)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", ["clamp_min", "clamp_max", "clamp_computed", "normalize", "mean"])
def test_pooling_and_normalisation_heads_of_both_exporters(kind: str, dynamo: bool, tmp_path: Path) -> None:
    """The heads' Clips (min from a constant or computed, max omitted, or the reverse) lift: the
    clamps equal onnxruntime exactly, infinities included; F.normalize and the masked mean within
    the error bound of their sums."""
    feeds = _feeds()
    model = export(Head(kind), tuple(torch.from_numpy(f) for f in feeds), dynamo, tmp_path / "head.onnx")
    assert "Clip" in {n.op_type for n in model.graph.node} or (dynamo and kind == "clamp_computed")  # dynamo: Max
    lifted = lift_model(model)
    if kind.startswith("clamp"):
        feeds[0][0, 0, : len(SPECIALS)] = SPECIALS
        assert_same(model, lifted, feeds)  # the computed bound: an integer sum (exact) and one division
    else:
        _within_sum_bound(model, lifted, feeds, _mean_bound if kind == "mean" else _normalize_bound)


class SentenceEncoder(nn.Module):
    """A residual token MLP, mean pooling and F.normalize: a sentence-embedding model's shape
    (MiniLM's head) at test size."""

    def __init__(self, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        states = h + self.down(F.gelu(self.up(h)))
        return F.normalize(mean_pooling(states, mask), p=2, dim=1)


@pytest.mark.parametrize(("preset", "algorithm"), [("A8W8", "adaquant"), ("XINT8", "adaround")])
def test_a_sentence_embedding_model_is_quantized_and_tuned(preset: str, algorithm: str, tmp_path: Path) -> None:
    """The issue's model shape, exported as torch writes it (`clamp(min=1e-9)` with an omitted max),
    quantizes and tunes without edits: both layers are units."""
    feeds = [_feeds(batch=4, seed=seed) for seed in range(4)]
    path = tmp_path / "encoder.onnx"
    export(SentenceEncoder().eval(), tuple(torch.from_numpy(f) for f in feeds[0]), False, path)
    data = [{"h": h, "mask": mask} for h, mask in feeds]
    quantized = quantize_model(path, preset, data).model
    _, report = finetune_model(quantized, data, FastFinetune(algorithm=algorithm, iterations=2), float_model=str(path))
    assert [unit["name"] for unit in report["units"]] == ["/up/MatMul", "/down/MatMul"]
