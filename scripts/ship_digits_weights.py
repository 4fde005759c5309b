"""Write the digits models' trained weights into finetune/weights/ (seed 0, the default epochs), which
finetune.zoo then loads on every machine instead of training: training repeats on one CPU but not on
another, whose kernels add in other orders. Run it only to change what ships (the README's, the
benchmarks' and the tests' figures follow these weights).

    python scripts/ship_digits_weights.py
"""

from __future__ import annotations

import inspect

import numpy as np

from finetune import zoo


def main() -> None:
    for factory, train in ((zoo.DigitsCNN, zoo.train_digits_cnn), (zoo.DigitsTransformer, zoo.train_digits_transformer)):
        epochs = inspect.signature(train).parameters["epochs"].default
        model = zoo.train_fresh(factory, 0, epochs)
        path = zoo.shipped_weights_path(factory, 0, epochs)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **{name: value.detach().numpy() for name, value in model.state_dict().items()})
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
