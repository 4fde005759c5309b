"""The bundled models and data: the digits models the README, benchmarks and tests use are the
shipped weights on every machine, and training repeats whatever the caller's thread count; text lines
render the same for a seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from finetune.zoo import (DigitsCNN, DigitsTransformer, shipped_weights_path, text_angle_lines, text_lines,
                          train_digits_cnn, train_digits_transformer)


def test_the_digits_cnn_trains_the_same_on_any_thread_count() -> None:
    """Torch splits sums across intra-op threads and each split rounds differently; training pins
    the count, so the README's, benchmark's and tests' numbers repeat on any machine, and the
    caller's setting is restored."""
    threads = torch.get_num_threads()
    weights = []
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            weights.append([p.detach().clone() for p in train_digits_cnn(epochs=2).parameters()])
            assert torch.get_num_threads() == count
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*weights))


@pytest.mark.parametrize(("factory", "train", "epochs"), [(DigitsCNN, train_digits_cnn, 10),
                                                       (DigitsTransformer, train_digits_transformer, 40)])
def test_the_default_digits_models_are_the_shipped_weights(factory: type, train: object, epochs: int) -> None:
    """Seed 0 at the default epochs loads the weights the package ships (training would give other last
    bits on another CPU, so the figures built on these models would not repeat there)."""
    shipped = np.load(shipped_weights_path(factory, 0, epochs))
    loaded = train().state_dict()
    assert sorted(loaded) == sorted(shipped.files)
    assert all(np.array_equal(loaded[name].numpy(), shipped[name]) for name in shipped.files)


def test_text_lines_are_the_recognisers_input_and_repeat_for_a_seed() -> None:
    """(count, 3, 48, 320) in [-1, 1], dark ink on light paper, the same for a seed, other for another."""
    lines = text_lines(4, seed=3)
    assert lines.shape == (4, 3, 48, 320) and lines.dtype == np.float32
    assert -1 <= lines.min() < 0 < lines.max() <= 1
    assert (np.median(lines, axis=(1, 2, 3)) > 0.5).all()  # mostly paper
    assert np.array_equal(lines, text_lines(4, seed=3)) and not np.array_equal(lines, text_lines(4, seed=4))


def test_text_angle_lines_are_the_classifiers_input_with_both_classes() -> None:
    """48x192 lines, those drawn upside down the same renderings turned by 180 degrees, repeatably."""
    lines, upright = text_angle_lines(8, seed=5), text_lines(8, seed=5, width=192)
    assert lines.shape == (8, 3, 48, 192) and lines.dtype == np.float32
    flipped = [not np.array_equal(a, b) for a, b in zip(lines, upright, strict=True)]
    assert 0 < sum(flipped) < 8
    for line, original, turned in zip(lines, upright, flipped, strict=True):
        assert np.array_equal(line, original[:, ::-1, ::-1] if turned else original)
    assert np.array_equal(lines, text_angle_lines(8, seed=5))
