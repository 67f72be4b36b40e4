"""Optional test dependencies: the ``test`` extra's transformers, peft, scikit-learn and tensorboard, and the console
script an installed package brings. Outside CI a missing one skips its test, with the command that installs it. In
CI (the ``CI`` environment variable set, as ``.ci/run`` does) it fails: ``scripts/setup.sh`` installs the whole extra
there, so a missing dependency is a broken set-up, never a silent skip."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(what: str, install: str) -> None:
    """Skip (outside CI) or fail (in CI) the running test because ``what`` is not installed."""
    message = f"{what} is not installed ({install})"
    if in_ci():
        pytest.fail(f"{message}; CI installs the test extra (scripts/setup.sh), so this is a broken set-up, not a "
                    "skip", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require(module: str, extra: str = "test") -> ModuleType:
    """``module`` imported, or the test skipped/failed as :func:`missing` says."""
    try:
        return importlib.import_module(module)
    except ImportError:
        missing(f"the optional dependency {module!r}", f"pip install -e '.[{extra}]'")
        raise  # (missing() raised already)
