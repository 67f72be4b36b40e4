#!/usr/bin/env bash
# Creates ./.venv (once) and installs lightning_shard with its test extra. Idempotent: re-runs only when
# pyproject.toml or this script changed. torch is pinned to the 2.13.0 CPU build on purpose: an unpinned `torch`
# lets pip pick a multi-GB CUDA build (override with TORCH_SPEC, e.g. TORCH_SPEC="torch==2.13.0" on a GPU node).
# A failed install stops here with pip's output: a missing test dependency must never become a silent skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
LITGPT_SPEC=${LITGPT_SPEC:-litgpt==0.5.13}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.lightning_shard-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
pip_quiet() {  # pip, its output kept in a log; shown (and the script stopped) if it fails
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2
    rm -f "$log"
    echo "setup.sh: pip $* failed" >&2
    exit 1
  fi
  rm -f "$log"
}
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip_quiet install -q --upgrade pip
  pip_quiet install -q "$TORCH_SPEC" -e ".[test]"
  # litgpt's own pins (huggingface-hub<1.4, psutil==7.2.2) conflict with transformers 5; the tests use only its
  # model code, which needs torch and lightning: installed without its dependencies
  pip_quiet install -q --no-deps "$LITGPT_SPEC"
  .venv/bin/python -c "import torch, lightning, hydra, lightning_shard, peft, transformers, litgpt.model" # fail loudly
  echo "$want" > "$stamp"
fi
