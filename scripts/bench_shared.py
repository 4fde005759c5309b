"""Tuning on a shared machine (JSON on stdout, progress on stderr): a fine-tuning step's time alone
and with other CPU-bound jobs beside it, for several thread counts and OpenMP wait settings, so
the README can say what to set. Each measurement is `scripts/profile_step.py --bare` in a fresh
process (OpenMP reads its environment once, at start); the competing jobs are torch matrix
products of two threads each (as other tuning jobs would be). Settings alternate, alone and
loaded, over --rounds, and each figure is the median over rounds of the median step.

    python scripts/bench_shared.py                         # digits:MX4, two competing jobs
    python scripts/bench_shared.py --cases digits:XINT8 --load 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROFILE = Path(__file__).with_name("profile_step.py")
# name -> (fast_finetune.threads, extra environment); the first is the default, which the others are compared with
SETTINGS: dict[str, tuple[int | str, dict[str, str]]] = {
    "auto (the default)": ("auto", {}),
    "2 threads": (2, {}),
    "2 threads, OMP_WAIT_POLICY=PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 threads, GOMP_SPINCOUNT=10000": (2, {"GOMP_SPINCOUNT": "10000"}),
    "2 threads, GOMP_SPINCOUNT=100000": (2, {"GOMP_SPINCOUNT": "100000"}),
    "1 thread": (1, {}),
}
LOAD = ("import torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\n"
        "while True:\n    a = torch.tanh(a @ a * 1e-3)\n")


def step_ms(case: str, iterations: int, threads: int | str, environment: dict[str, str], compile_kernels: str) -> float:
    """The median step time (ms) of one bare profile_step run in a fresh process."""
    command = [sys.executable, str(PROFILE), "--bare", "--cases", case, "--iterations", str(iterations),
               "--threads", str(threads), "--compile", compile_kernels]
    done = subprocess.run(command, env={**os.environ, **environment}, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)[0]["ms_per_step_median"])


def competing(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` CPU-bound jobs of two threads each, running until killed."""
    jobs = [subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(count)]
    time.sleep(2)  # let them reach their loop
    return jobs


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every setting alone and loaded, alternating, over the rounds."""
    alone: dict[str, list[float]] = {name: [] for name in SETTINGS}
    loaded: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for round_index in range(args.rounds):
        for name, (threads, environment) in SETTINGS.items():
            print(f"round {round_index + 1}: {name}", file=sys.stderr, flush=True)
            alone[name].append(step_ms(args.cases, args.iterations, threads, environment, args.compile))
            jobs = competing(args.load)
            try:
                loaded[name].append(step_ms(args.cases, args.iterations, threads, environment, args.compile))
            finally:
                for job in jobs:
                    job.kill()
                    job.wait()
    baseline = statistics.median(alone[next(iter(SETTINGS))])
    rows = []
    for name in SETTINGS:
        quiet, busy = statistics.median(alone[name]), statistics.median(loaded[name])
        rows.append({"setting": name, "ms_per_step_alone": quiet, "ms_per_step_loaded": busy,
                     "loaded_over_alone": round(busy / quiet, 3), "alone_over_default_alone": round(quiet / baseline, 3),
                     "loaded_over_default_alone": round(busy / baseline, 3), "rounds": args.rounds})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="digits:MX4", help="one profile_step case (default digits:MX4)")
    parser.add_argument("--iterations", type=int, default=100, help="steps per unit (default 100)")
    parser.add_argument("--load", type=int, default=2, help="competing jobs of two threads each (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per setting (default 3)")
    parser.add_argument("--compile", choices=["auto", "true", "false"], default="false",
                        help="fast_finetune.compile of the measured runs (default false: no compile time in the steps)")
    args = parser.parse_args(argv)
    json.dump({"case": args.cases, "competing_jobs": args.load, "cpus": os.cpu_count(), "settings": measure(args)},
              sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
