"""What gradient pieces cost a one-process run (JSON on stdout, progress on stderr): the
milliseconds per tuning step (drawing the batch and the step) of this tree at each number of
`gradient_pieces` against another revision's (default: main), each case in a fresh process, the
variants alternating case by case so all see the same machine load, the median of the repeats
reported with its ratio to the other revision's.

A step computes its gradient once per piece its rows fall in (recon.data.shards: calibration
batch c in piece c modulo gradient_pieces), so the cost grows with the pieces; `--rows-per-batch`
sets how many rows each calibration batch holds.

    python scripts/bench_pieces.py --before main --pieces 1,2,4 --repeats 3
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


def child(case: str, rows_per_batch: int, samples: int, iterations: int, pieces: int) -> dict:
    """Tune one case with the `finetune` on sys.path (`pieces` 0: a tree without gradient_pieces); its
    seconds per step (Batches.next and Optimisation._step, timed around each call) over the tuned units."""
    import time

    import torch

    from finetune.config import FastFinetune
    from finetune.quantize import quantize_model
    from finetune.recon import finetune_model
    from finetune.recon.data.batches import Batches
    from finetune.recon.optimisation import Optimisation
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
                            validation_share=0, **({"gradient_pieces": pieces} if pieces else {}))
    spent: dict[str, list[float]] = {"next": [], "_step": []}

    def timed(owner: type, name: str) -> None:
        call = getattr(owner, name)

        def timed_call(*args: object, **kwargs: object) -> object:
            begin = time.perf_counter()
            result = call(*args, **kwargs)
            spent[name].append(time.perf_counter() - begin)
            return result

        setattr(owner, name, timed_call)

    timed(Batches, "next")
    timed(Optimisation, "_step")
    finetune_model(quantized, calibration, settings)
    steps = len(spent["_step"])
    return {"seconds_per_step": (sum(spent["next"]) + sum(spent["_step"])) / steps, "steps": steps, "batches": len(calibration)}


def run_case(tree: Path, case: str, rows_per_batch: int, pieces: int, args: argparse.Namespace) -> dict:
    """One case in a fresh process importing `finetune` from `tree`."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", case, "--rows-per-batch", str(rows_per_batch),
               "--samples", str(args.samples), "--iterations", str(args.iterations), "--gradient-pieces", str(pieces)]
    env = {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="main", help="the revision to compare with (a git revision of this repository)")
    parser.add_argument("--pieces", default="1,2,4", help="gradient_pieces of this tree to time, comma-separated")
    parser.add_argument("--gradient-pieces", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rows-per-batch", default="1,4,32", help="rows per calibration batch, comma-separated")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, int(args.rows_per_batch), args.samples, args.iterations, args.gradient_pieces)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-pieces-") as folder:
        before = Path(folder) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True,
                       capture_output=True)
        try:
            rows = []
            variants = [("before", before, 0), *((f"pieces_{n}", ROOT, int(n)) for n in args.pieces.split(","))]
            for case in args.cases.split(","):
                for rows_per_batch in (int(n) for n in args.rows_per_batch.split(",")):
                    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
                    for repeat in range(args.repeats):
                        for name, tree, pieces in variants:
                            result = run_case(tree, case, rows_per_batch, pieces, args)
                            times[name].append(result["seconds_per_step"])
                            print(f"{case} rows/batch {rows_per_batch} #{repeat} {name}: "
                                  f"{1000 * result['seconds_per_step']:.2f} ms/step", file=sys.stderr)
                    medians = {name: statistics.median(values) for name, values in times.items()}
                    rows.append({"case": case, "rows_per_batch": rows_per_batch, "calibration_batches": result["batches"],
                                 **{f"ms_per_step_{name}": 1000 * median for name, median in medians.items()},
                                 **{f"ratio_{name}": median / medians["before"] for name, median in medians.items() if name != "before"}})
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=True)
    print(json.dumps({"before": args.before, "iterations": args.iterations, "samples": args.samples, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
