#!/usr/bin/env bash
# Proof on a GPU: every strategy on CUDA + NCCL, measured, in one command (bench/gpu_check.py).
#   bash scripts/gpu_check.sh --out-dir "$OUT"     # the GPU run (~6 minutes on one H200): gpu_check_<gpu>_<date>.{json,md}
#   bash scripts/gpu_check.sh --cpu                # the same phases at tiny sizes on CPU: gpu_check_cpu<cores>_<date>.*
# The interpreter: $PYTHON if set, else the repository's .venv (the development machine), else python3 (a GPU machine,
# where lightning_shard is not installed: it runs from the repository root with PYTHONPATH=.).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" bench/gpu_check.py "$@"
