"""What happened to each unit: its row of the report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class UnitResult:
    """What happened to one unit (a row of the report)."""

    name: str
    op_type: str
    loss_before: float
    loss_after: float
    status: str  # kept | reverted | reverted: <reason> | skipped: <reason>
    iterations: int
    seconds: float
    rejected_loss: float | None = None  # the tuned loss (held-out, where batches are) of a unit reverted for getting worse
    held_out_before: float | None = None  # the loss on the held-out batches (None: none held out)
    held_out_after: float | None = None
    best_iteration: int | None = None  # the step of the held-out evaluation the kept unit ended at (None: none held out)
    lr: float | None = None  # the learning rate it was tuned with (None: GPTQ, or not tuned)
    bias_correction: dict[str, Any] | None = None  # layers corrected or not (why), and each correction's losses (methods.bias)
    equalization: list[dict[str, Any]] | None = None  # learn_equalization: each layer pair's learned scales (methods.equalization)
