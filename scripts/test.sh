#!/usr/bin/env bash
# The test suite: set up (first run only), the linter (ruff, configured in pyproject.toml), then pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
