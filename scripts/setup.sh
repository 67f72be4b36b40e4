#!/usr/bin/env bash
# Creates ./.venv (once) and installs lightning_shard with its test and docs extras. Idempotent: re-runs only when
# pyproject.toml or this script changed. torch is pinned to 2.13.0 on purpose: an unpinned `torch` lets pip pick
# a multi-GB CUDA build (override with TORCH_SPEC, e.g. TORCH_SPEC="torch==2.13.0" on a GPU node).
# Each step says what it does and how long it took (on stderr, prefixed "setup.sh:"); pip's own output is kept
# in a log. A failed install stops here with pip's output: a missing test dependency must never become a
# silent skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
LITGPT_SPEC=${LITGPT_SPEC:-litgpt==0.5.13}
say() { echo "setup.sh: $*" >&2; }
step_start=$SECONDS
step() {  # announce a step; done_step says how long it took
  say "$*"
  step_start=$SECONDS
}
done_step() { say "  done in $((SECONDS - step_start)) s"; }
if [ ! -x .venv/bin/python ]; then
  step "creating the virtual environment .venv with $("$PY" --version 2>&1) ($PY)"
  "$PY" -m venv .venv
  done_step
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
  started=$SECONDS
  if [ -f "$stamp" ]; then
    say "updating .venv (pyproject.toml, scripts/setup.sh or TORCH_SPEC changed)"
  else
    say "installing into .venv (first run only: a few minutes)"
  fi
  step "upgrading pip"
  pip_quiet install -q --upgrade pip
  done_step
  step "installing $TORCH_SPEC (the largest download; TORCH_SPEC overrides it)"
  pip_quiet install -q "$TORCH_SPEC"
  say "  torch $(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))') installed"
  done_step
  # torch is named again so that pip keeps that build while it resolves the rest
  step "installing lightning-shard (editable) with its test and docs extras: lightning, hydra-core, transformers, peft, pytest, mkdocs ..."
  pip_quiet install -q "$TORCH_SPEC" -e ".[test,docs]"
  done_step
  # litgpt's own pins (huggingface-hub<1.4, psutil==7.2.2) conflict with transformers 5; the tests use only its
  # model code, which needs torch and lightning: installed without its dependencies
  step "installing $LITGPT_SPEC without its dependencies (the tests use only its model code)"
  pip_quiet install -q --no-deps "$LITGPT_SPEC"
  done_step
  step "checking that everything imports"
  .venv/bin/python -c "import torch, lightning, hydra, lightning_shard, peft, transformers, litgpt.model, mkdocs, mkdocstrings_handlers.python" # fail loudly
  done_step
  echo "$want" > "$stamp"
  say "ready: .venv set up in $((SECONDS - started)) s"
fi
