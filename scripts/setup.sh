#!/usr/bin/env bash
# Creates ./.venv (once) and installs lightning_shard with its test extra. Idempotent: re-runs only when
# pyproject.toml changed. torch is pinned to the 2.13.0 CPU build on purpose: an unpinned `torch` lets pip
# pick a multi-GB CUDA build (override with TORCH_SPEC, e.g. TORCH_SPEC="torch==2.13.0" on a GPU node).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.lightning_shard-installed
want="$(sha256sum pyproject.toml | cut -c1-16) $TORCH_SPEC"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q "$TORCH_SPEC" -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, lightning, hydra, lightning_shard" # fail loudly if the install failed
  echo "$want" > "$stamp"
fi
