"""Intra-op threads of a tuning run on the CPU (`fast_finetune.threads`). torch's default takes every
core, and its OpenMP threads spin at each barrier: beside other busy jobs a 2-thread step waits on a
descheduled thread and runs 5-40x slower than on one thread. So `auto` runs a step on one thread
where a second gains little (few FLOPs and small outputs: StepWork.small) and otherwise on the CPUs of this process
(affinity, cgroup quota) that other jobs leave free, judged from /proc/stat since the last choice,
never more than torch had before the run (OMP_NUM_THREADS, torch.set_num_threads).
Float sums split by thread, so a count chosen from the load can change the last bits: the report
says which counts ran, and a run that must repeat byte for byte pins `threads`."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.flop_counter import FlopCounterMode

from finetune.lift import LiftedModule
from finetune.lift.fake_quant import quantizers_disabled

from .units import Unit

ThreadSetting = Literal["auto"] | int

# Forward floating-point operations of one step (at its batch) below which auto takes one thread. Measured
# on this project's 2-core CPU, quiet, forward + backward of conv blocks at batch 16, 1 against 2 threads
# side by side: 3.7 MFLOP forward 0.99x, 8 MFLOP 1.12x, 15 MFLOP 1.06x, 33 MFLOP 1.27-1.36x, 59 MFLOP
# 1.52x, 180 MFLOP 1.65-2.0x; a tuning step adds quantizers' elementwise work that gains less still.
SMALL_STEP_FLOPS = 3 * 10**7

# Elements of a unit's largest module output (at its batch) from which a step takes a second thread
# even under SMALL_STEP_FLOPS: its elementwise work (quantizers, activations, their backward) splits
# well. Measured unit by unit (AdaQuant, MX4, 100 iterations, quiet, 1 against 2 threads): PP-OCR's
# angle classifier units of 2.4-25 MFLOP with outputs of 0.15-0.48 M elements 1.26-1.63x, the text
# detector's of 7-20 MFLOP and 0.2-0.8 M elements 1.1-1.37x; outputs of a few thousand elements
# 0.71-0.89x, the digits CNN block (14.5 MFLOP, 33 k elements) 0.95x; at 147 k elements 0.90-1.26x.
LARGE_OUTPUT_ELEMENTS = 2**17

# A CPU counts as taken by other jobs from this share of its time busy (not by this process) on.
BUSY_SHARE = 0.5

# The first reading of the load samples /proc/stat for this long; later ones read what passed since.
FIRST_SAMPLE_SECONDS = 0.2

# Environment variables that set the thread count before torch starts: auto leaves their count alone.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_allowance(cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[int, str]:
    """How many CPUs this process may run on, and from what: its affinity, and a cgroup CPU quota
    (v2 cpu.max or v1 cfs_quota_us) where one is lower."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_quota(cgroup)
    if quota is not None and quota < cpus:
        return quota, f"cgroup CPU quota {quota}"
    return cpus, f"{cpus} CPUs in the affinity mask"


def cgroup_quota(cgroup: Path) -> int | None:
    """The CPU quota of the cgroup mounted at `cgroup`, rounded up to whole CPUs (None: no quota)."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            fields = (cgroup / quota_file).read_text().split()
            if period_file is not None:
                fields.append((cgroup / period_file).read_text().strip())
        except OSError:
            continue
        if len(fields) >= 2 and fields[0] not in ("max", "-1"):
            return max(1, math.ceil(int(fields[0]) / int(fields[1])))
        return None
    return None


class LoadMeter:
    """The CPUs that other processes kept busy since the last reading, from /proc/stat's per-CPU
    counters (of the CPUs this process may use) less this process's own CPU time."""

    def __init__(self) -> None:
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self._last = self._sample()

    def others_busy(self) -> float | None:
        """CPUs' worth of other processes' work since the last reading (None: /proc/stat unreadable)."""
        if self._last is None:
            return None
        if time.monotonic() - self._last[0] < FIRST_SAMPLE_SECONDS:
            time.sleep(FIRST_SAMPLE_SECONDS)
        now = self._sample()
        if now is None:
            return None
        (_, busy0, total0, own0), (_, busy1, total1, own1) = self._last, now
        self._last = now
        ticks_per_second = os.sysconf("SC_CLK_TCK")
        elapsed_ticks = (total1 - total0) / (len(self._cpus) if self._cpus else os.cpu_count() or 1)
        if elapsed_ticks <= 0:
            return 0.0
        others = (busy1 - busy0) - (own1 - own0) * ticks_per_second
        return max(0.0, others / elapsed_ticks)

    def _sample(self) -> tuple[float, int, int, float] | None:
        """(time, busy ticks, all ticks) over this process's CPUs, and its own CPU seconds."""
        try:
            lines = Path("/proc/stat").read_text().splitlines()
        except OSError:
            return None
        wanted = {f"cpu{index}" for index in self._cpus} if self._cpus is not None else None
        busy = total = 0
        for line in lines:
            name, *counters = line.split()
            if not name.startswith("cpu") or name == "cpu" or (wanted is not None and name not in wanted):
                continue
            ticks = [int(value) for value in counters[:8]]
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
        times = os.times()
        return time.monotonic(), busy, total, times.user + times.system


@dataclass
class ThreadPolicy:
    """Chooses the intra-op thread count of each stretch of a run (the streams, each unit's steps)
    on the CPU, sets it, and records what ran; `setting` an int pins every stretch to it."""

    setting: ThreadSetting
    processes: int = 1
    most: int = field(default_factory=torch.get_num_threads)  # torch's count before the run: auto never exceeds it
    allowance: tuple[int, str] = field(default_factory=cpu_allowance)
    chosen: list[dict[str, Any]] = field(default_factory=list)
    meter: LoadMeter | None = None  # made at the first choice the load decides
    _unit_work: list[StepWork] = field(default_factory=list)

    def begin(self, module: LiftedModule, units: list[Unit], sample: list[torch.Tensor], rows: int) -> None:
        """Count the work of a step of `rows` rows (model and units) and choose the count of the
        set-up and the streams' passes by the whole model's."""
        model_work, self._unit_work = step_work(module, units, sample, rows)
        self.choose("set-up and streams", model_work)

    def fingerprint(self) -> int | str:
        """What a checkpoint records of the counts (float sums follow them): the count where every
        stretch takes it (a number, OMP_NUM_THREADS, or torch at one thread before the run), else
        auto with its most."""
        if self.setting != "auto":
            return int(self.setting)
        if self.most == 1 or any(os.environ.get(name) for name in THREAD_VARIABLES):
            return self.most
        return f"auto, at most {self.most}"

    def unit(self, k: int, unit: Unit) -> None:
        """Choose the count of unit k's stream passes and steps."""
        self.choose(unit.name, self._unit_work[k])

    def choose(self, stretch: str, work: StepWork | None, sets_bytes: bool = True) -> int:
        """Set and return the thread count for `stretch`, each of whose steps does `work` (None:
        unknown, counted as large); `sets_bytes` False for a stretch whose sums reach no output (the
        checks before any work)."""
        count, reason, by_load = self._decide(work)
        torch.set_num_threads(count)
        self.chosen.append({"stretch": stretch, "threads": count, "reason": reason, "by_load": by_load and sets_bytes})
        return count

    def _decide(self, work: StepWork | None) -> tuple[int, str, bool]:
        """The count, why, and whether the load decided it."""
        if self.setting != "auto":
            return int(self.setting), "fast_finetune.threads", False
        given = next((name for name in THREAD_VARIABLES if os.environ.get(name)), None)
        if given is not None:
            return self.most, f"{given}={os.environ[given]}", False
        if work is not None and work.small():
            return 1, (f"{work.flops / 1e6:.1f} MFLOP a step, under {SMALL_STEP_FLOPS / 1e6:.0f}, outputs of at most "
                       f"{work.largest_output / 1e3:.0f} k elements, under {LARGE_OUTPUT_ELEMENTS / 1e3:.0f}: one thread"), False
        if self.most == 1:
            return 1, "torch's thread count was 1 before the run", False
        cpus, source = min(self.allowance[0], self.most), self.allowance[1]
        if self.meter is None:
            self.meter = LoadMeter()
        busy = self.meter.others_busy()
        if busy is None:
            return max(1, cpus // self.processes), f"{source}; the load is unknown", False
        taken = math.floor(busy + 1 - BUSY_SHARE)
        free = max(1, min(cpus, cpus - taken) // self.processes)
        return free, f"{source}; other jobs busy on {busy:.1f} of them; {self.processes} process(es)", True

    def summary(self) -> dict[str, Any]:
        """The report's entry: the setting, the counts that ran and why, and whether another load
        could have chosen other counts (and so other last bits)."""
        return {"setting": self.setting, "allowance": self.allowance[1],
                "counts": sorted({entry["threads"] for entry in self.chosen}), "stretches": self.chosen,
                "bytes_may_follow_load": any(entry["by_load"] for entry in self.chosen)}


@dataclass(frozen=True)
class StepWork:
    """What one step of a stretch computes: its forward floating-point operations and the elements of
    its largest module output."""

    flops: float
    largest_output: float = 0.0

    def small(self) -> bool:
        """Whether a second thread gains little: few operations and no large output."""
        return self.flops < SMALL_STEP_FLOPS and self.largest_output < LARGE_OUTPUT_ELEMENTS


def step_work(module: LiftedModule, units: list[Unit], sample: list[torch.Tensor], rows: int) -> tuple[StepWork, list[StepWork]]:
    """The work of one step of `rows` rows: the whole model's and each unit's (the sum of its modules'
    operations, the largest of their outputs), counted by torch's FlopCounterMode and forward hooks on
    the first calibration batch and scaled by rows. Shapes alone decide the counts, so the choice they
    drive is the same on every run."""
    root = type(module).__name__
    targets = {node.name: node.target for node in module.graph.nodes if node.op == "call_module"}
    largest: dict[str, int] = {}

    def record(target: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            sizes = [value.numel() for value in outputs if isinstance(value, torch.Tensor)]
            largest[target] = max([largest.get(target, 0), *sizes])
        return hook

    hooks = [module.get_submodule(target).register_forward_hook(record(target)) for target in set(targets.values())]
    try:
        with torch.no_grad(), quantizers_disabled(module), FlopCounterMode(display=False) as counter:
            module(*sample)
    finally:
        for hook in hooks:
            hook.remove()
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    batch = sample[0].shape[0] if sample and sample[0].dim() else 1
    scale = rows / max(1, batch)
    per_unit = [StepWork(scale * sum(counts.get(f"{root}.{targets[name]}", 0) for name in unit.nodes if name in targets),
                         scale * max([largest.get(targets[name], 0) for name in unit.nodes if name in targets] or [0]))
                for unit in units]
    return StepWork(scale * counts.get("Global", 0), scale * max(largest.values() or [0])), per_unit


@contextmanager
def thread_policy(setting: ThreadSetting, device: torch.device, processes: int) -> Iterator[ThreadPolicy | None]:
    """A policy for a run on the CPU (None elsewhere: an accelerator's host threads stay torch's),
    restoring torch's thread count when the run ends."""
    if device.type != "cpu":
        yield None
        return
    before = torch.get_num_threads()
    try:
        policy = ThreadPolicy(setting, processes, before)
        policy.choose("checks before any work", None, sets_bytes=False)
        yield policy
    finally:
        torch.set_num_threads(before)
