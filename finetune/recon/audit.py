"""The ops a tuning step would run that have no deterministic CUDA kernel, found on any device before
any work: each unit's module runs forward and backward once, on one calibration sample, while torch's
dispatcher names every op it calls. Under `deterministic: true` torch raises on them on CUDA from
inside backward, after the earlier units were tuned; found first, a CUDA run stops at once with one
line (`warn`: a warning), and a CPU run, which has deterministic kernels for all of them, says at INFO
that the same run on CUDA would stop."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.lift import LiftedModule
from finetune.lift.graph import Segment

from .device import accelerator_kind
from .units import Plan, Unit

logger = logging.getLogger(__name__)

# The GPU platform a build of torch drives, as users know it (a ROCm build's HIP kernels come from the same
# sources as CUDA's, with the same deterministic ones).
PLATFORMS = {"cuda": "CUDA", "hip": "ROCm"}

# aten ops (by schema name) that torch.use_deterministic_algorithms(True) refuses on CUDA, as torch's
# documentation lists them, with the module or function users know them as.
NONDETERMINISTIC_ON_CUDA: dict[str, str] = {
    "aten::avg_pool3d_backward": "AvgPool3d's gradient",
    "aten::_adaptive_avg_pool2d_backward": "adaptive average pooling's gradient (GlobalAveragePool as adaptive)",
    "aten::_adaptive_avg_pool3d_backward": "3-D adaptive average pooling's gradient",
    "aten::adaptive_max_pool2d_backward": "adaptive max pooling's gradient",
    "aten::fractional_max_pool2d_backward": "fractional max pooling's gradient",
    "aten::fractional_max_pool3d_backward": "fractional max pooling's gradient",
    "aten::max_unpool2d": "MaxUnpool", "aten::max_unpool3d": "MaxUnpool",
    "aten::upsample_linear1d_backward": "linear Resize's gradient",
    "aten::upsample_bilinear2d_backward": "linear Resize's gradient (bilinear)",
    "aten::upsample_bicubic2d_backward": "cubic Resize's gradient",
    "aten::upsample_trilinear3d_backward": "linear Resize's gradient (trilinear)",
    "aten::reflection_pad1d_backward": "reflect Pad's gradient", "aten::reflection_pad2d_backward": "reflect Pad's gradient",
    "aten::reflection_pad3d_backward": "reflect Pad's gradient",
    "aten::grid_sampler_2d_backward": "GridSample's gradient", "aten::grid_sampler_3d_backward": "GridSample's gradient",
    "aten::nll_loss_forward": "NLLLoss", "aten::nll_loss2d_forward": "NLLLoss",
    "aten::histc": "histc", "aten::bincount": "bincount", "aten::put_": "put_", "aten::scatter_reduce": "ScatterElements(mul)",
}


class _OpNames(TorchDispatchMode):
    """Notes the schema name of every aten op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


def nondeterministic_on_cuda(module: LiftedModule, units: list[Unit], plan: Plan, sample: list[torch.Tensor],
                             backward: bool = True) -> dict[str, list[str]]:
    """For each unit whose step would call an op without a deterministic CUDA kernel, those ops (as
    users know them), by unit name. The quantized values of one sample are pushed through the plan's
    segments as the streams push the calibration set, each unit's module runs forward and (`backward`:
    where the run optimises; GPTQ never does) backward on them, and the gradients it leaves are cleared
    before the next unit runs (one unit's at a time: all of them were a copy of every weight, 2.3 GiB at
    2.5 GB of weights)."""
    placeholders = [n.name for n in module.graph.nodes if n.op == "placeholder"]
    values = dict(zip(placeholders, sample))
    found: dict[str, list[str]] = {}
    for k, unit in enumerate(units):
        _run(plan.gaps[k], values)
        names = _step_ops(plan.train[k], [values[unit.input], *(values[side.name] for side in unit.side_inputs)], backward)
        ops = sorted({NONDETERMINISTIC_ON_CUDA[name] for name in names if name in NONDETERMINISTIC_ON_CUDA})
        if ops:
            found[unit.name] = ops
        module.zero_grad(set_to_none=True)
        _run(plan.units[k], values)
        for name in [name for name in values if plan.last_use.get(name, -1) <= 2 * k + 1]:
            del values[name]  # nothing later reads it
    return found


def _run(segment: Segment, values: dict[str, Any]) -> None:
    """One segment on the values it reads, its outputs added to them."""
    with torch.no_grad():
        values.update(zip(segment.outputs, segment.module(*(values[name] for name in segment.inputs))))


def _step_ops(train: torch.nn.Module, inputs: list[Any], backward: bool) -> set[str]:
    """The aten ops one forward (and `backward`, one backward) of a unit's module call."""
    with _OpNames() as seen, torch.set_grad_enabled(backward):
        outputs = train(*inputs)
        floats = [o for o in outputs if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]
        if floats:
            sum(o.float().sum() for o in floats).backward()
    return seen.names


def refuse_nondeterministic(found: dict[str, list[str]], device: torch.device, mode: bool | str, warn: Any) -> None:
    """On a GPU with deterministic algorithms, a one-line error naming the first unit's ops and the switch
    (`warn` mode: a warning per unit, through `warn(unit, reason)`); elsewhere an INFO line."""
    if not found:
        return
    platform = PLATFORMS[accelerator_kind()]
    if device.type != "cuda":
        logger.info("on %s with deterministic: true this run would stop: %s", platform,
                    "; ".join(f"{unit}: {', '.join(ops)}" for unit, ops in found.items()))
        return
    if mode == "warn":
        for unit, ops in found.items():
            warn(unit, f"{', '.join(ops)} has no deterministic {platform} kernel: it runs anyway (deterministic: warn), so "
                       "runs may differ")
        return
    unit, ops = next(iter(found.items()))
    raise ValueError(f"unit {unit} runs {', '.join(ops)}, which has no deterministic {platform} kernel ({len(found)} unit(s) "
                     "in all): set fast_finetune.deterministic: warn to run it anyway (results may then differ from run to "
                     "run), or tune on the CPU")
