"""One job, one run folder: the name of the run folder every rank, node and restart of a job shares.

``conf/train.yaml`` names the run folder ``outputs/<recipe>/<strategy>-<topology>/${ls.run_name:<time>}``. The
name is, in this order:

* the launcher's job id: ``slurm-<SLURM_JOB_ID>`` (an array task: ``slurm-<array job>_<task>``), the same after a
  requeue; ``torchrun-<TORCHELASTIC_RUN_ID>`` when torchrun was given ``--rdzv-id`` (or ``--standalone``), the same
  after ``--max-restarts`` restarts;
* under torchrun without a job id: the start time of the process that asked first, agreed through torchrun's own
  store (see :func:`lightning_shard.engine.comm.collectives.agree_in_launcher_store`), which lives as long as the job,
  restarts included;
* otherwise the time of the start (one process: Lightning's own launcher hands its folder to the ranks it starts).

:func:`decide` runs once per process before Hydra composes (``train.main``) and leaves the name in
``LIGHTNING_SHARD_RUN_NAME``; the ``ls.run_name`` resolver reads it, so the preflight and Hydra see one name. Set
``hydra.run.dir`` to choose a folder yourself.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Mapping, Optional

from lightning_shard.requeue import slurm_job_id

ENV = "LIGHTNING_SHARD_RUN_NAME"
STORE_KEY = "lightning_shard/run_name"
TIME_FORMAT = "%Y-%m-%d_%H-%M-%S"  # the same as the ${now:...} of conf/train.yaml
STORE_TIMEOUT_S = 300  # the slowest node's start-up, not a collective


def launcher_job_id(env: Mapping[str, str]) -> Optional[str]:
    """The job id the launcher gives every process of a job, restarts and requeues included; None without one."""
    slurm = slurm_job_id(env)  # what scontrol requeue takes: the same job after a requeue
    if slurm:
        return f"slurm-{slurm}"
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    return None


def decide(env: Optional[dict] = None) -> str:
    """The run name of this job (see the module's docstring), also written into ``env[ENV]``."""
    env = os.environ if env is None else env
    if env.get(ENV):
        return env[ENV]  # decided already (a process this one started, or the user)
    name = launcher_job_id(env)
    if name is None and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR"):
        from lightning_shard.engine.comm.collectives import agree_in_launcher_store

        name = agree_in_launcher_store(STORE_KEY, time.strftime(TIME_FORMAT), env["MASTER_ADDR"],
                                       int(env["MASTER_PORT"]), timedelta(seconds=STORE_TIMEOUT_S))
    if name is not None:
        env[ENV] = name
    return name or time.strftime(TIME_FORMAT)


def run_name(default: str) -> str:
    """The ``ls.run_name`` resolver: the decided name, or ``default`` (the start time) for a job without one."""
    return os.environ.get(ENV) or default
