"""The optimiser pieces of a unit's optimisation: Adam without a per-step CUDA-graph check on the
host, and the cosine tail that ends AdaQuant's learning rate after an early stop."""

from __future__ import annotations

import math

import torch


class HostAdam(torch.optim.Adam):
    """Adam for parameters on the CPU, without the check for a CUDA graph being captured that
    torch's Adam makes at every step: on a CUDA build of torch without a GPU it asks the driver
    library for its devices each time (0.5 ms a step, 4 % of a small digits unit's step). The
    arithmetic is Adam's own."""

    def _accelerator_graph_capture_health_check(self) -> None:
        """Nothing to check: CPU tensors are never captured in a CUDA graph."""


class CosineTail:
    """AdaQuant's learning rate after an early stop: a half cosine from the rate reached down to
    zero over the tail's `steps`, as the full schedule would have ended."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        self.optimizer, self.steps, self.done = optimizer, steps, 0
        self.start = [group["lr"] for group in optimizer.param_groups]

    def step(self) -> None:
        """Set the rate of the next step."""
        self.done += 1
        for group, lr in zip(self.optimizer.param_groups, self.start):
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * self.done / self.steps))
