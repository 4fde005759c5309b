"""The defaults against the best explicit setting (JSON on stdout, progress on stderr): each
bench_finetune case tuned at the defaults (`threads: auto`, `compile: auto`) and at every explicit
pair of {1 thread, all threads} x {compile on, off}, each in a fresh process, side by side in one run;
`--repeats R` takes every setting's median over R rounds that visit the settings in turn (a few
seconds' run varies by ~10 % on a shared machine). `--cache cold` gives every run an empty inductor
cache (a user's first run), `warm` one that an earlier run of the same setting filled. `--load N`
also runs the defaults beside N CPU-bound jobs of two threads each round (a shared machine) and
reports that time over the quiet one. What issue 43 asks: default_over_best at most 1.1 quiet, cold
and warm; loaded_over_quiet at most 3 beside two jobs.

    python scripts/bench_defaults.py --models digits --presets XINT8 --iterations 20
    python scripts/bench_defaults.py --models digits,transformer,textcls --presets MX4 --repeats 3 --cache warm --load 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_finetune import parse_args as finetune_args  # a script beside this one, on sys.path when run as one
from bench_finetune import prepare, run_child
from bench_shared import competing

# name -> (threads: None for auto, compile)
SETTINGS: dict[str, tuple[int | None, str]] = {
    "defaults": (None, "auto"),
    "1 thread, compiled": (1, "true"), "1 thread, eager": (1, "false"),
    "all threads, compiled": (os.cpu_count() or 1, "true"), "all threads, eager": (os.cpu_count() or 1, "false"),
}


def tune(model: str, preset: str, directory: Path, args: argparse.Namespace, setting: str, cache: Path) -> dict[str, Any]:
    """Quantize-and-tune wall seconds of one case at one setting, in a fresh process using `cache`,
    and what the run chose (thread counts, compiled kernels)."""
    threads, compile_kernels = SETTINGS[setting]
    child_args = finetune_args(["--iterations", str(args.iterations), "--no-ort-rerun", "--compile", compile_kernels,
                                *(["--threads", str(threads)] if threads else [])])
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    case = run_child(model, preset, directory, child_args)
    return {"seconds": case["quantize_seconds"] + case["finetune_wall_seconds"],
            "thread_counts": case["thread_counts"], "kernels": case["kernels"]}


def measure_case(model: str, preset: str, directory: Path, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Every setting of one case, medians over the rounds; with a warm cache, each compiling setting's
    cache is filled by a run first; with `--load`, the defaults also run beside the competing jobs each round."""
    runs: dict[str, list[float]] = {name: [] for name in (*SETTINGS, *(["defaults, loaded"] if args.load else []))}
    chosen: dict[str, dict[str, Any]] = {}
    caches = {setting: scratch / f"inductor-{model}-{preset}-{number}" for number, setting in enumerate(SETTINGS)}
    if args.cache == "warm":  # an eager setting reads no kernel cache: nothing to fill
        for setting, cache in caches.items():
            if SETTINGS[setting][1] != "false":
                tune(model, preset, directory, args, setting, cache)
    for round_number in range(args.repeats):
        for setting in runs:
            base = setting.removesuffix(", loaded")
            cache = caches[base] if args.cache == "warm" else Path(tempfile.mkdtemp(prefix="cold-", dir=scratch))
            jobs = competing(args.load) if setting != base else []
            try:
                run = tune(model, preset, directory, args, base, cache)
                runs[setting].append(run["seconds"])
                chosen[setting] = {key: run[key] for key in ("thread_counts", "kernels")}
            finally:
                for job in jobs:
                    job.kill()
                    job.wait()
            print(f"{model} {preset} round {round_number + 1} {setting}: {runs[setting][-1]:.1f} s", file=sys.stderr, flush=True)
    seconds = {setting: statistics.median(times) for setting, times in runs.items()}
    best = min((name for name in SETTINGS if name != "defaults"), key=seconds.__getitem__)
    return {"model": model, "preset": preset, "seconds": seconds, "runs": runs, "best_explicit": best,
            "defaults_chose": chosen["defaults"],
            "default_over_best": round(seconds["defaults"] / seconds[best], 3),
            **({"loaded_over_quiet": round(seconds["defaults, loaded"] / seconds["defaults"], 3)} if args.load else {})}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="digits,transformer", help="bench_finetune models (default digits,transformer)")
    parser.add_argument("--presets", default="MX4,XINT8", help="bench_finetune presets (default MX4,XINT8)")
    parser.add_argument("--iterations", type=int, default=100, help="iterations per unit (default 100)")
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold", help="inductor cache of each run (default cold)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the settings; medians reported (default 1)")
    parser.add_argument("--load", type=int, default=0, help="CPU-bound jobs of two threads beside an extra defaults run (default 0)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        scratch, cases = Path(folder), []
        for model in args.models.split(","):
            prepare(model, scratch / model, None)
            cases += [measure_case(model, preset, scratch / model, args, scratch) for preset in args.presets.split(",")]
    json.dump({"cpus": os.cpu_count(), "cache": args.cache, "competing_jobs": args.load, "iterations": args.iterations,
               "repeats": args.repeats,
               "load_average_after": os.getloadavg(), "cases": cases}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
