"""What the Trainer strategies (``zero.py``, ``zero3.py``) and the Fabric strategies (``fabric.py``) share: the
knobs, the process group and device groups, the accumulation rule and the construction of the engine. The core
(``lightning_shard.engine``) knows no Lightning; this mixin knows no Trainer and no Fabric.
"""

from __future__ import annotations

import dataclasses
import difflib
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Optional

import torch
from lightning.fabric.utilities.distributed import _init_dist_connection

from ..engine.comm import collectives as C
from ..engine.engine import ShardEngine
from ..engine.settings import UnitConfig
from .config import ZeroConfig
from .layout import Groups, check_job_placement, make_groups, resolve_topology

# knob -> attribute name where it is not the knob's own
ATTRIBUTE_OF = {"topology": "topology_spec", "start_method": "_start_method",
                "process_group_backend": "_process_group_backend"}


class EngineAdapter:
    """Mixed into a Lightning ``ParallelStrategy`` (Trainer's or Fabric's): ``CONFIG`` names the knobs,
    ``DEFAULT_STAGE`` the stage, ``GRANULARITY`` how stage-3 units are formed (None below stage 3)."""

    CONFIG: type[ZeroConfig] = ZeroConfig
    DEFAULT_STAGE = 2
    GRANULARITY: Optional[str] = None
    LIGHTNING_ARGS: tuple[str, ...] = ()  # the host Strategy's own constructor arguments

    def _take_knobs(self, knobs: dict[str, Any]) -> dict[str, Any]:
        """Validate ``knobs``, set each as an attribute; returns the host Strategy's own arguments (popped)."""
        lightning = {k: knobs.pop(k) for k in self.LIGHTNING_ARGS if k in knobs}
        valid = self.CONFIG.names() + self.LIGHTNING_ARGS
        unknown = [k for k in knobs if k not in valid]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, valid, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"{type(self).__name__} got unknown knob(s) {', '.join(hints)}; valid knobs: "
                            f"{', '.join(valid)}")
        cfg = self.CONFIG(**knobs)
        if cfg.stage is None:
            cfg.stage = self.DEFAULT_STAGE
        cfg.validate(type(self).__name__)
        self.config = cfg  # as constructed (strategy=auto's apply() changes the attributes, not this)
        for f in dataclasses.fields(cfg):  # every knob an attribute (three under other names)
            setattr(self, ATTRIBUTE_OF.get(f.name, f.name), getattr(cfg, f.name))
        self._groups = Groups()
        self.placement_warning: Optional[str] = None
        self._timeout = timedelta(seconds=cfg.timeout_s)
        self._startup_timeout = timedelta(seconds=cfg.startup_timeout_s)
        self.engine: Optional[ShardEngine] = None
        self.accumulation_policy: Optional[str] = None
        self.accumulation_reason: str = ""
        self._policy_inputs: Optional[tuple] = None  # what accumulation="auto" weighs, measured once per fit
        return {k: lightning.get(k) for k in self.LIGHTNING_ARGS}

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
            backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
            kwargs: dict[str, Any] = {"timeout": self._startup_timeout}  # the rendezvous; collectives below
            if self.root_device.type == "cuda":
                kwargs["device_id"] = self.root_device
            _init_dist_connection(self.cluster_environment, backend, **kwargs)
            C.set_timeout(self._timeout)  # from now on a collective waits at most timeout_s
        C.install_exit_guard()  # gloo's worker threads and the interpreter's exit (collectives.py)
        topology = resolve_topology(self.topology_spec, self.num_processes)
        self._groups = make_groups(self.shard_size, topology, self.world_size, self.num_nodes, self.global_rank,
                                   self.stage, self._timeout, getattr(self, "secondary_shard", None))
        shard = self._groups.axes["shard"] if self._groups.axes else None
        self.placement_warning = check_job_placement(topology, self.num_processes, self.stage, shard,
                                                     self.strict_placement)

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
        if self.accumulation != "auto":
            return self.accumulation, "set explicitly"
        from ..planner import auto_policy

        if getattr(self, "_policy_inputs", None) is None:
            grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
            free = torch.cuda.mem_get_info(self.root_device)[0] if self.root_device.type == "cuda" else None
            ring = None
            if self.topology_spec is not None:
                topology = resolve_topology(self.topology_spec, self.num_processes)
                if topology.devices_per_node >= self.num_processes > 1:  # the ring this job's ranks form
                    ring = topology.ring(list(range(self.num_processes)))[0]
            self._policy_inputs = (grad_bytes, free, ring)
        return auto_policy(self.stage, accumulate, *self._policy_inputs)

    def _unit_config(self) -> Optional[UnitConfig]:
        granularity = getattr(self, "granularity", self.GRANULARITY)  # strategy=auto sets its own
        if granularity is None:
            return None
        cfg = UnitConfig(granularity, reshard_after_forward=self.reshard_after_forward,
                         prefetch_depth=self.prefetch_depth, leaf_modules=self.leaf_modules,
                         min_unit_mb=self.min_unit_mb)
        if granularity == "fsdp":  # the wrap policy (FSDPConfig's knobs)
            wrap = self.wrap_classes
            cfg.wrap_classes = list(wrap) if isinstance(wrap, (list, tuple)) else wrap
            cfg.min_params = self.min_params
        return cfg

    def _new_engine(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], policy: str,
                    deferred: Any, param_dtype: Optional[str]) -> ShardEngine:
        if getattr(self, "secondary_shard", None) is not None and self._groups.island is None and \
                self.stage == 3 and self.world_size > 1:
            raise RuntimeError(f"secondary_shard={self.secondary_shard!r} is set but no island process groups were "
                               "made (a bug: the groups are made in setup_environment, or by strategy=auto when its "
                               "planned row asks for them); refusing to train without the islands silently")
        return ShardEngine(module, optimizers, stage=self.stage, bucket_mb=self.bucket_mb,
                           reduce_dtype=self.reduce_dtype, accumulation=policy, overlap=self.overlap,
                           broadcast_buffers=self.broadcast_buffers,
                           allow_custom_optimizer=self.allow_custom_optimizer,
                           find_unused_parameters=self.find_unused_parameters,
                           units=self._unit_config(), deferred=deferred,
                           group=self._groups.shard, replicate_group=self._groups.replicate,
                           optim_chunk_mb=self.optim_chunk_mb, skip_nonfinite=self.skip_nonfinite,
                           debug_collectives=self.debug_collectives,
                           overlap_param_gather=self.overlap_param_gather,
                           gather_group=self._groups.gather, param_dtype=param_dtype,
                           offload_optimizer=self.offload_optimizer,
                           offload_params=getattr(self, "offload_params", False),
                           reduce_scatter_via=self.reduce_scatter_via, gather_quant=self.gather_quant,
                           reduce_quant=self.reduce_quant, quant_block=self.quant_block,
                           quant_error_feedback=self.quant_error_feedback, secondary_group=self._groups.island,
                           all_gather_via=self.all_gather_via, huge_pages=self.huge_pages)


__all__ = ["ATTRIBUTE_OF", "EngineAdapter"]
