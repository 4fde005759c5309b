"""The bundled models: the digits CNN trains to the same weights whatever the caller's thread count."""

from __future__ import annotations

import torch

from finetune.zoo import train_digits_cnn


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
