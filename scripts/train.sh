#!/usr/bin/env bash
# The main job: set up (first run only), then train the tiny GPT recipe with zero2 on 2 CPU processes.
# Extra arguments are Hydra overrides, e.g. `bash scripts/train.sh strategy=zero1 trainer.max_steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m lightning_shard.train "$@"
