"""Loading of the reference vectors (tests/data/vectors/public, the repository's own copy, and
tests/data/vectors/scalars, AMD Quark's outputs on one-element inputs) and exact comparison."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VECTOR_DIR = Path(__file__).resolve().parent / "data" / "vectors" / "public"
SCALAR_VECTORS = VECTOR_DIR.parent / "scalars" / "scalars.json"


@dataclass(frozen=True)
class VectorSet:
    """One configuration: op type, attributes and the (x, y) pairs an independent kernel produced."""

    name: str
    op_type: str
    attributes: dict
    pairs: list[tuple[np.ndarray, np.ndarray]]


def load_vector_sets() -> list[VectorSet]:
    """Every configuration in the vector folder; fails loudly if the folder is missing."""
    files = sorted(VECTOR_DIR.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no reference vectors in {VECTOR_DIR}; the repository keeps them in tests/data/vectors")
    sets = []
    for path in files:
        meta = json.loads(path.read_text())
        arrays = np.load(path.with_suffix(".npz"))
        pairs = [(arrays[f"x_{i}"], arrays[f"y_{i}"]) for i in range(meta["n_inputs"])]
        sets.append(VectorSet(meta["name"], meta["op_type"], meta["attributes"], pairs))
    return sets


def load_scalar_vector_sets() -> list[VectorSet]:
    """Every configuration of the scalar vectors, one (x, y) pair per shape (rank 0, [1], ...) and value."""
    meta = json.loads(SCALAR_VECTORS.read_text())
    arrays = np.load(SCALAR_VECTORS.with_suffix(".npz"))
    shapes = [tuple(shape) for shape in meta["shapes"]]
    sets = []
    for config in meta["configurations"]:
        y = arrays[f"y.{config['name']}"]
        pairs = [(np.full(shape, x, np.float32), np.full(shape, y[i, j], np.float32))
                 for i, shape in enumerate(shapes) for j, x in enumerate(arrays["x"])]
        sets.append(VectorSet(config["name"], config["op_type"], config["attributes"], pairs))
    return sets


def mismatches(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Indices where actual and expected differ by value (NaN equals NaN, -0 equals +0)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    same = (actual == expected) | (np.isnan(actual) & np.isnan(expected))
    return np.argwhere(~same)


def assert_same_values(actual: np.ndarray, expected: np.ndarray, context: str = "") -> None:
    """Exact float comparison as the vectors define it, naming the first differing elements."""
    bad = mismatches(np.asarray(actual), np.asarray(expected))
    if len(bad):
        shown = [(tuple(int(i) for i in k), float(actual[tuple(k)]), float(expected[tuple(k)])) for k in bad[:5]]
        raise AssertionError(f"{context}: {len(bad)} elements differ (index, got, expected): {shown}")
