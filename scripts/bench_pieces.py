"""What per-calibration-batch gradient pieces cost a one-process run (JSON on stdout, progress on
stderr): the seconds per tuning step of this tree against another revision's (default: the one
before the pieces came in), each case in a fresh process, the two trees alternating case by case
so both see the same machine load, the median of the repeats reported with their ratio.

A step computes its gradient once per calibration batch its rows come from (recon.data.shards),
so the cost grows with the pieces per step: `--rows-per-batch` sets how many rows each calibration
batch holds (16-row training batches draw from about min(16, batches) of them).

    python scripts/bench_pieces.py --before 89c4099 --repeats 3
    python scripts/bench_pieces.py --cases digits-adaquant --rows-per-batch 1,32 --iterations 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # model, algorithm, unit
    "digits-adaquant": ("cnn", "adaquant", "layer"),
    "digits-adaround": ("cnn", "adaround", "layer"),
    "transformer-blocks": ("transformer", "adaquant", "block"),
}


def child(case: str, rows_per_batch: int, samples: int, iterations: int) -> dict:
    """Tune one case with the `finetune` on sys.path; its seconds per step (Optimisation._step alone,
    timed around each call) over the tuned units."""
    import time

    import torch

    from finetune.config import FastFinetune
    from finetune.recon.optimisation import Optimisation
    from finetune.quantize import quantize_model
    from finetune.recon import finetune_model
    from finetune.zoo import digits_split, export_onnx, train_digits_cnn, train_digits_transformer

    torch.set_num_threads(1)
    model, algorithm, unit = CASES[case]
    x_train = digits_split()[0][:samples]
    module = train_digits_cnn() if model == "cnn" else train_digits_transformer()
    with tempfile.TemporaryDirectory() as folder:
        path = export_onnx(module, x_train[:1], Path(folder) / "m.onnx")
        calibration = [{"x": x_train[i: i + rows_per_batch].numpy()} for i in range(0, samples, rows_per_batch)]
        quantized = quantize_model(path, "XINT8", calibration).model
    settings = FastFinetune(algorithm=algorithm, unit=unit, iterations=iterations, batch_size=16, seed=1, threads=1,
                            validation_share=0)
    step, spent = Optimisation._step, []

    def timed(*args: object, **kwargs: object) -> object:
        begin = time.perf_counter()
        result = step(*args, **kwargs)
        spent.append(time.perf_counter() - begin)
        return result

    Optimisation._step = timed  # type: ignore[method-assign]
    finetune_model(quantized, calibration, settings)
    return {"seconds_per_step": sum(spent) / len(spent), "steps": len(spent), "batches": len(calibration)}


def run_case(tree: Path, case: str, rows_per_batch: int, args: argparse.Namespace) -> dict:
    """One case in a fresh process importing `finetune` from `tree`."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", case, "--rows-per-batch", str(rows_per_batch),
               "--samples", str(args.samples), "--iterations", str(args.iterations)]
    env = {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD~1", help="the revision to compare with (a git revision of this repository)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rows-per-batch", default="1,4,32", help="rows per calibration batch, comma-separated")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, int(args.rows_per_batch), args.samples, args.iterations)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-pieces-") as folder:
        before = Path(folder) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True,
                       capture_output=True)
        try:
            rows = []
            for case in args.cases.split(","):
                for rows_per_batch in (int(n) for n in args.rows_per_batch.split(",")):
                    times: dict[str, list[float]] = {"before": [], "pieces": []}
                    for repeat in range(args.repeats):
                        for name, tree in (("before", before), ("pieces", ROOT)):
                            result = run_case(tree, case, rows_per_batch, args)
                            times[name].append(result["seconds_per_step"])
                            print(f"{case} rows/batch {rows_per_batch} #{repeat} {name}: "
                                  f"{1000 * result['seconds_per_step']:.2f} ms/step", file=sys.stderr)
                    medians = {name: statistics.median(values) for name, values in times.items()}
                    rows.append({"case": case, "rows_per_batch": rows_per_batch, "calibration_batches": result["batches"],
                                 "ms_per_step_before": 1000 * medians["before"], "ms_per_step_pieces": 1000 * medians["pieces"],
                                 "ratio": medians["pieces"] / medians["before"]})
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=True)
    print(json.dumps({"before": args.before, "iterations": args.iterations, "samples": args.samples, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
