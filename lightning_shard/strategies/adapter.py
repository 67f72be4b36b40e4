"""What the Trainer strategies (``zero.py``, ``zero3.py``) and the Fabric strategies (``fabric.py``) share: the
options, the process group and device groups, the accumulation rule and the construction of the engine. The core
(``lightning_shard.engine``) knows no Lightning; this mixin knows no Trainer and no Fabric.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import socket
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Optional

import torch
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.rank_zero import rank_zero_info

from ..engine.comm import collectives as C
from ..engine.comm.choices import CommChoices
from ..engine.comm.groups import Groups
from ..engine.engine import ShardEngine
from ..options import ZeroOptions
from ..topology.agree import disagreement, node_summary
from ..topology.model import Topology
from ..topology.resolve import resolve
from .process_groups import check_job_placement, make_groups


class EngineAdapter:
    """Mixed into a Lightning ``ParallelStrategy`` (Trainer's or Fabric's): ``OPTIONS`` names the options class
    (``lightning_shard/options``), ``DEFAULT_STAGE`` the stage. ``self.options`` holds the validated options:
    the one place the strategy reads them."""

    OPTIONS: type[ZeroOptions] = ZeroOptions
    DEFAULT_STAGE = 2
    LIGHTNING_ARGS: tuple[str, ...] = ()  # the host Strategy's own constructor arguments
    # how collectives run on this backend (engine/comm/choices.py); None: the engine's per-backend choice. Not an
    # option: the benchmarks and the tests set it on an instance to compare the forms (``strategy.comm = ...``)
    comm: Optional[CommChoices] = None

    def _take_options(self, given: dict[str, Any]) -> dict[str, Any]:
        """Validate the options ``given``; returns the host Strategy's own arguments (popped)."""
        lightning = {k: given.pop(k) for k in self.LIGHTNING_ARGS if k in given}
        valid = self.OPTIONS.names() + self.LIGHTNING_ARGS
        unknown = [k for k in given if k not in valid]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, valid, n=1)
                group = next((g.name for g in self.OPTIONS.knobs() if "group" in g.metadata and
                              k in g.metadata["group"].names()), None)
                hints.append(f"{k!r}" + (f" (an option of the {group} group: {group}={{{k!r}: ...}})" if group else
                                         f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"{type(self).__name__} got unknown option(s) {', '.join(hints)}; valid: "
                            f"{', '.join(valid)}")
        options = self.OPTIONS(**given)
        if options.stage is None:
            options.stage = self.DEFAULT_STAGE
        self.options = options.validate(type(self).__name__)
        self._groups = Groups()
        self.placement_warning: Optional[str] = None
        self.engine: Optional[ShardEngine] = None
        self.accumulation_policy: Optional[str] = None
        self.accumulation_reason: str = ""
        self._policy_inputs: Optional[tuple] = None  # what accumulation="auto" weighs, measured once per fit
        return {k: lightning.get(k) for k in self.LIGHTNING_ARGS}

    @property
    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.options.safety.timeout_s)

    # ------------------------------------------------------------------ the devices (both hosts' ParallelStrategy)
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    # ------------------------------------------------------------------ process group and device groups
    def _connect(self) -> None:
        """Join the process group (or check the one that exists), then form the shard/replicate groups."""
        if C.is_initialized():  # e.g. a second fit in the same process, or a harness that made the group
            if C.get_world_size() != self.world_size:
                raise ValueError(
                    f"a process group of {C.get_world_size()} ranks already exists but this job asks for "
                    f"{self.num_nodes} node(s) x {self.num_processes} device(s) = {self.world_size} ranks; set "
                    f"devices=... and num_nodes=... to match the launched processes."
                )
        else:
            launch = self.options.launch
            backend = launch.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
            # the rendezvous; the collectives below wait at most safety.timeout_s
            kwargs: dict[str, Any] = {"timeout": timedelta(seconds=launch.startup_timeout_s)}
            if self.root_device.type == "cuda":
                kwargs["device_id"] = self.root_device
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun: a rendezvous per restart
                env = self.cluster_environment
                rank_zero_info(f"Initializing distributed (torchrun, attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}"
                               f"): {env.world_size()} ranks")
                C.init_process_group_in_launcher_store(backend, env.global_rank(), env.world_size(), env.main_address,
                                                       env.main_port, int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                                                       **kwargs)
            else:
                _init_dist_connection(self.cluster_environment, backend, **kwargs)
            C.set_timeout(self._timeout)  # from now on a collective waits at most timeout_s
        C.install_exit_guard()  # gloo's worker threads and the interpreter's exit (collectives.py)
        self._check_nodes_agree()
        self._make_groups()
        opts = self.options
        shard = self._groups.axes["shard"] if self._groups.axes else None
        self.placement_warning = check_job_placement(self._topology(), self.num_processes, opts.stage, shard,
                                                     opts.safety.strict_placement)

    def _topology(self) -> Optional[Topology]:
        """The machine the ``topology`` option names (None: not given, so no placement check, and
        ``shard_size="auto"`` cannot be resolved)."""
        spec = self.options.topology
        return None if spec is None else resolve(spec, self.num_processes)

    def _check_nodes_agree(self) -> None:
        """Each node resolved ``topology`` on its own (a capture file or ``"detect"`` describes the node it is read
        on): gather every node's summary (collective) and stop on every rank, naming the nodes whose machine
        differs from node 0's, before any group is built from it."""
        if self.options.topology is None or self.num_nodes <= 1:
            return
        mine = (self.node_rank, socket.gethostname(), node_summary(self._topology()))
        message = disagreement(C.all_gather_object(mine, tag="the topology of each node"))
        if message is not None:
            raise ValueError(message)

    def _make_groups(self) -> None:
        """The shard / replicate / island process groups the options ask for (collective: every rank)."""
        opts = self.options
        self._groups = make_groups(opts.shard_size, self._topology(), self.world_size, self.num_nodes, self.global_rank,
                                   opts.stage, self._timeout, getattr(opts, "secondary_shard", None))

    # ------------------------------------------------------------------ full weights on demand
    @contextmanager
    def gathered_params(self) -> Generator[None, None, None]:
        """Stage 3: all parameters materialized on every rank inside the block (generation, export); resharded
        after. Collective: every rank must enter it. Changes made to parameters inside are discarded. Below stage
        3 the module holds full parameters anyway: nothing to do."""
        controller = self.engine.controller if self.engine is not None else None
        if controller is None:
            yield
            return
        with controller.full_params():
            yield

    # ------------------------------------------------------------------ the backward
    @contextmanager
    def explained_backward(self) -> Generator[None, None, None]:
        """torch's error for a backward through a graph whose parameters were changed in place, with what it means
        here: an optimizer step ran between the forward and this backward (``ShardEngine.finish_step`` marks the
        stepped parameters as modified, as torch's own in-place update does under DDP)."""
        try:
            yield
        except RuntimeError as err:
            if "modified by an inplace operation" not in str(err):
                raise
            raise RuntimeError(
                f"rank {C.get_rank()}: this backward runs through a graph built before an optimizer step updated "
                "parameters it uses (manual optimization: manual_backward(..., retain_graph=True), opt.step(), then "
                "another backward through the same graph); torch and DDP refuse it too, since the gradient would be "
                "taken at the old weights with the new values. Run the forward again after opt.step(), or step "
                f"after the last backward through that graph. torch: {err}") from err

    # ------------------------------------------------------------------ the engine
    def _accumulation(self, module: torch.nn.Module, accumulate: int) -> tuple[str, str]:
        """``accumulation="auto"``: the planner's rule (memory budget first, then link speed). What it weighs (the
        gradient bytes, free device memory, the ring) is measured once per fit, before the engine shards the module,
        so that a later call for another accumulation (``GradientAccumulationScheduler``) decides as a run started
        with it would have."""
        opts = self.options
        if opts.accumulation != "auto":
            return opts.accumulation, "set explicitly"
        from ..planner import auto_policy

        if getattr(self, "_policy_inputs", None) is None:
            grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
            free = torch.cuda.mem_get_info(self.root_device)[0] if self.root_device.type == "cuda" else None
            ring = None
            topology = self._topology()
            if topology is not None:
                if topology.devices_per_node >= self.num_processes > 1:  # the ring this job's ranks form
                    ring = topology.ring(list(range(self.num_processes)))[0]
            self._policy_inputs = (grad_bytes, free, ring)
        return auto_policy(opts.stage, accumulate, *self._policy_inputs)

    def _param_dtype(self, precision: str, host: str) -> Optional[str]:
        """``param_dtype``, checked against the host's precision (``host``: "Trainer" or "Fabric"): the policy is for
        fp32 parameters, and fp16 compute needs the loss scaling of ``"16-mixed"``."""
        dtype = self.options.param_dtype
        if dtype in (None, "fp32"):
            return None
        if precision not in ("32-true", "32", "bf16-mixed", "16-mixed"):
            raise ValueError(f"param_dtype={dtype!r} is a mixed-precision policy for fp32 parameters, but "
                             f"{host}(precision={precision!r}) already sets the parameters' dtype; use "
                             "precision='32-true' (or 'bf16-mixed'/'16-mixed') with param_dtype, or drop param_dtype.")
        if dtype == "fp16" and precision != "16-mixed":
            raise ValueError(f"param_dtype='fp16' needs loss scaling against fp16 gradient underflow: use "
                             f"{host}(precision='16-mixed') with it, or param_dtype='bf16'.")
        return dtype

    def _new_engine(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], policy: str,
                    deferred: Any, param_dtype: Optional[str]) -> ShardEngine:
        opts = self.options
        if getattr(opts, "secondary_shard", None) is not None and self._groups.island is None and \
                opts.stage == 3 and self.world_size > 1:
            raise RuntimeError(f"secondary_shard={opts.secondary_shard!r} is set but no island process groups were "
                               "made (a bug: the groups are made in setup_environment, or by strategy=auto when its "
                               "planned row asks for them); refusing to train without the islands silently")
        return ShardEngine(module, optimizers, dataclasses.replace(opts, accumulation=policy, param_dtype=param_dtype),
                           self._groups, deferred=deferred, comm=self.comm)


__all__ = ["EngineAdapter"]
