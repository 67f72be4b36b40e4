"""Hydra entry point: ``python -m lightning_shard.train [overrides]`` (a shim over ``lightning_shard.app``).

Composes ``conf/train.yaml`` (strategy x topology x recipe x trainer x logger x callbacks), checks it before
any rank is launched (``lightning_shard.app.checks``), derives ``accumulate_grad_batches`` from the recipe's
global and micro batch sizes and the world size the topology gives, fits, prints a summary table on rank 0
and writes ``summary.json`` in the run folder. In ``-m`` sweeps a job whose strategy uses the default
``popen`` launcher runs in a fresh process (Lightning's subprocess launcher re-runs ``sys.argv``, which in a
sweep would start the whole sweep again, in the wrong folder); with ``strategy.launch.start_method=fork`` (or spawn)
the ranks are workers of the sweep process and jobs run in it, which saves a start-up per job. A sweep ends
with ``report.md`` / ``report.png`` in the sweep folder (:class:`SweepReport`).

Errors in the config (unknown group option, unknown key, wrong type, impossible batch) are reported by
:func:`main` in one line naming the key and the fix, with exit status 2, before Hydra or Lightning start.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lightning_shard.app import job
from lightning_shard.app.config import (
    REQUIRED_KEYS,
    build_callbacks,
    build_loggers,
    build_trainer_kwargs,
    check_config,
    register,
)
from lightning_shard.app.preflight import explain, preflight, sweep_combinations
from lightning_shard.app.run import SweepReport, fit, run_isolated
from lightning_shard.shipped import CONF_DIR

__all__ = ["CONF_DIR", "REQUIRED_KEYS", "SweepReport", "build_callbacks", "build_loggers", "build_trainer_kwargs",
           "check_config", "explain", "fit", "main", "preflight", "register", "run_isolated", "sweep_combinations"]


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> dict[str, Any]:
    accumulate = check_config(cfg)  # before any rank is launched
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        if OmegaConf.select(cfg, "strategy.launch.start_method", default="popen") == "popen":
            return run_isolated()
        # fork/spawn: ranks are workers of this process, which itself never joins a process group, so the
        # next job starts clean; only the rendezvous port is dropped so that each job picks a fresh one
        try:
            return fit(cfg, accumulate)
        finally:
            os.environ.pop("MASTER_PORT", None)
    return fit(cfg, accumulate)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_shard.train`` / ``lightning-shard train``: preflight, then Hydra."""
    argv = list(sys.argv[1:] if argv is None else argv)
    job.decide()  # the run folder's name, one for every rank, node and restart of this job
    if os.environ.get("LOCAL_RANK") in (None, "0") and os.environ.get("LIGHTNING_SHARD_PREFLIGHT", "1") != "0":
        error = preflight(argv)
        if error is not None:
            print(f"lightning_shard.train: error: {error}", file=sys.stderr)
            return 2
    sys.argv = [sys.argv[0], *argv]
    _hydra_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
