"""The optimiser of a unit's optimisation on the CPU: Adam without a per-step CUDA-graph check."""

from __future__ import annotations

import torch


class HostAdam(torch.optim.Adam):
    """Adam for parameters on the CPU, without the check for a CUDA graph being captured that
    torch's Adam makes at every step: on a CUDA build of torch without a GPU it asks the driver
    library for its devices each time (0.5 ms a step, 4 % of a small digits unit's step). The
    arithmetic is Adam's own."""

    def _accelerator_graph_capture_health_check(self) -> None:
        """Nothing to check: CPU tensors are never captured in a CUDA graph."""
