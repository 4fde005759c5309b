"""fast_finetune.threads: auto takes one thread for small steps (few FLOPs, small outputs) whatever
the load (so their bytes never follow it), the CPUs other jobs leave free for large ones, never more than torch had; a number
or OMP_NUM_THREADS pins it; the cgroup quota and the load are read from the system."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.config import ConfigError, FastFinetune
from finetune.recon import finetune_model
from finetune.recon.threads import (LARGE_OUTPUT_ELEMENTS, SMALL_STEP_FLOPS, LoadMeter, StepWork, ThreadPolicy, cgroup_quota,
                                    cpu_allowance, step_work)

from .recon_helpers import one_thread, quantized  # noqa: F401  (fixtures)

SMALL = StepWork(SMALL_STEP_FLOPS - 1, LARGE_OUTPUT_ELEMENTS - 1)
LARGE = StepWork(10 * SMALL_STEP_FLOPS)


class Busy:
    """A load meter that reads a fixed number of CPUs kept busy by other jobs."""

    def __init__(self, cpus: float | None) -> None:
        self.cpus = cpus

    def others_busy(self) -> float | None:
        return self.cpus


def policy(setting: object = "auto", cpus: int = 4, most: int = 4, busy: float | None = 0.0, processes: int = 1) -> ThreadPolicy:
    """A policy over `cpus` CPUs, torch at `most` threads, other jobs busy on `busy` CPUs."""
    return ThreadPolicy(setting, processes, most, (cpus, f"{cpus} CPUs"), meter=Busy(busy))  # type: ignore[arg-type]


@pytest.mark.parametrize("busy", [0.0, 3.9, None])
def test_a_small_step_takes_one_thread_whatever_the_load(busy: float | None) -> None:
    chosen = policy(busy=busy)
    assert chosen.choose("unit", SMALL) == 1
    assert chosen.summary()["bytes_may_follow_load"] is False


@pytest.mark.parametrize("work", [StepWork(SMALL_STEP_FLOPS), StepWork(0.0, LARGE_OUTPUT_ELEMENTS)])
def test_many_operations_or_a_large_output_take_a_second_thread(work: StepWork) -> None:
    assert policy(cpus=2, most=2).choose("unit", work) == 2


def test_a_units_work_counts_its_operations_and_its_largest_output() -> None:
    torch.manual_seed(0)
    float_model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                      torch.nn.Linear(8 * 6 * 6, 10))
    module = torch.fx.symbolic_trace(float_model)
    names = {node.target: node.name for node in module.graph.nodes if node.op == "call_module"}
    units = [SimpleNamespace(nodes=(names["0"], names["1"])), SimpleNamespace(nodes=(names["3"],))]
    whole, (convolution, linear) = step_work(module, units, [torch.randn(2, 3, 6, 6)], rows=16)  # type: ignore[arg-type]
    scale = 16 // 2  # counted on a batch of 2, for steps of 16 rows
    assert convolution == StepWork(scale * 2 * (2 * 8 * 36 * 27), scale * 2 * 8 * 36)  # 2 FLOPs a multiply-add
    assert linear == StepWork(scale * 2 * (2 * 288 * 10), scale * 2 * 10)
    assert whole == StepWork(convolution.flops + linear.flops, convolution.largest_output)


@pytest.mark.parametrize(("busy", "expected"), [(0.0, 4), (0.4, 4), (0.5, 3), (1.6, 2), (3.5, 1), (8.0, 1)])
def test_a_large_step_takes_the_cpus_other_jobs_leave_free(busy: float, expected: int) -> None:
    chosen = policy(busy=busy)
    assert chosen.choose("unit", LARGE) == expected
    assert torch.get_num_threads() == expected
    summary = chosen.summary()
    assert summary["counts"] == [expected] and summary["bytes_may_follow_load"] is True
    assert f"busy on {busy:.1f}" in summary["stretches"][0]["reason"]


def test_processes_share_the_free_cpus_and_torchs_count_caps_them() -> None:
    assert policy(busy=0.0, processes=2).choose("unit", LARGE) == 2
    assert policy(busy=0.0, processes=8).choose("unit", LARGE) == 1
    assert policy(busy=0.0, most=2).choose("unit", LARGE) == 2
    assert policy(busy=0.0, most=1).choose("unit", None) == 1
    assert policy(busy=None, cpus=3).choose("unit", LARGE) == 3  # load unreadable: the allowance


def test_a_number_or_the_environment_pins_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    assert policy(setting=3, busy=4.0).choose("unit", SMALL) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    pinned_by_environment = policy(most=2, busy=4.0)
    assert pinned_by_environment.choose("unit", 1.0) == 2
    assert pinned_by_environment.summary()["stretches"][0]["reason"] == "OMP_NUM_THREADS=2"
    assert pinned_by_environment.fingerprint() == 2 and policy(setting=3).fingerprint() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert policy(most=1).fingerprint() == 1  # auto at most one thread is one thread
    assert policy(most=4).fingerprint() == "auto, at most 4"


@pytest.mark.parametrize(("files", "expected"), [
    ({"cpu.max": "150000 100000\n"}, 2), ({"cpu.max": "max 100000\n"}, None), ({"cpu.max": "50000 100000"}, 1),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None), ({}, None)])
def test_the_cgroup_quota_is_read_in_whole_cpus(tmp_path: Path, files: dict[str, str], expected: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_quota(tmp_path) == expected
    cpus, source = cpu_allowance(tmp_path)
    assert cpus >= 1 and (expected is None or cpus <= expected)
    assert ("cgroup" in source) == (expected is not None and expected < len(__import__("os").sched_getaffinity(0)))


def test_the_load_meter_sees_another_process_and_not_this_one() -> None:
    meter = LoadMeter()
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    try:
        time.sleep(1.0)
        busy = meter.others_busy()
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy >= 0.5


def test_auto_tunes_small_units_on_one_thread_with_one_threads_bytes(quantized) -> None:  # noqa: F811
    model, feeds = quantized
    torch.set_num_threads(2)  # torch's default on a 2-core machine: auto may use two, and must not here
    auto, report = finetune_model(model, feeds, FastFinetune(iterations=3))
    assert torch.get_num_threads() == 2  # restored after the run
    one, _ = finetune_model(model, feeds, FastFinetune(iterations=3, threads=1))
    assert auto.SerializeToString() == one.SerializeToString()
    threads = report["threads"]
    assert threads["setting"] == "auto" and threads["bytes_may_follow_load"] is False
    assert [entry["threads"] for entry in threads["stretches"][1:]] == [1] * (1 + len(report["units"]))  # the checks: any
    stretches = [entry["stretch"] for entry in threads["stretches"]]
    assert stretches == ["checks before any work", "set-up and streams", *[unit["name"] for unit in report["units"]]]


@pytest.mark.parametrize("value", [0, -1, "many"])
def test_a_thread_count_must_be_a_positive_number_or_auto(value: object) -> None:
    with pytest.raises(ConfigError, match="^threads"):
        FastFinetune(threads=value)  # type: ignore[arg-type]
