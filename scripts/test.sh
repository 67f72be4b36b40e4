#!/usr/bin/env bash
# The test suite: set up (first run only), the linter (ruff, configured in pyproject.toml), the documentation site
# (mkdocs.yml, strict: a broken link or anchor, or a page missing from the nav, fails it), then pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/ruff check .
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
echo "test.sh: mkdocs build --strict (docs/, mkdocs.yml) into a temporary folder" >&2
.venv/bin/mkdocs build --strict --site-dir "$site"
.venv/bin/python -m pytest -q "$@"
