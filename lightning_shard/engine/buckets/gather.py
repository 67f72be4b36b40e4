"""A bucket's parameter gathers: stage 3's unshard/reshard (with hpZ's island copies and quantized gathers) and the
post-step all-gather of stages 1/2. The buffers are the storage's (buckets/storage.py); how an all-gather runs on
this backend is comm/gather.py's form, chosen once for this bucket's size."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..comm import collectives as C
from ..comm import quant as Q
from ..labels import label
from ..states import ParamState, param_transition
from .context import BucketContext, BucketName
from .storage import BucketStorage, nbytes


class Gauge:
    """Bytes of full (gathered) stage-3 parameters alive now, and the most ever: kept by the buckets as they
    allocate and free, so that reading it costs nothing."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


class ParamGather:
    def __init__(self, ctx: BucketContext, name: BucketName, store: BucketStorage) -> None:
        spec = self.spec = ctx.spec
        self.name, self.store = name, store
        self.world = spec.world
        self.group = ctx.group if ctx.gather_group is None else ctx.gather_group
        self.solo = C.get_world_size(self.group) == 1  # a gather group of one rank: nothing to gather
        # how this bucket's all-gathers run (comm/gather.py: by backend and size)
        self.all_gather = ctx.comm.all_gather_form(ctx.group, store.full_bytes)
        # stage 3: only the padded shard persists; the full buffer exists while the unit is unsharded
        self.param_state = ParamState.SHARDED if spec.shards_params else ParamState.UNSHARDED
        self.gauge = Gauge()  # stage 3: the controller hands every bucket the same one
        self.work: Any = None  # stage 3: the unit's all-gather in flight
        self.step_work: Any = None  # stages 1/2: the post-step all-gather, waited on by a forward pre-hook
        self.exact = False  # the gather in flight is an exact one (export, end of fit)
        # ``gather_quant`` (comm/quant.py): the stage-3 gathers of forward and backward move block-quantized shards
        # (the masters stay exact); only where a collective runs (more than one rank)
        self.quant: Optional[Q.QuantLayout] = None
        if ctx.gather_quant != "none" and spec.shards_params and spec.num_shards > 1:
            self.quant = Q.QuantLayout.of(ctx.gather_quant, ctx.quant_block, store.layout.shard_numel)
        self.recv: Optional[torch.Tensor] = None  # gather_quant: every rank's quantized shard, in flight
        # hpZ (``secondary_shard``): after the first gather of an optimizer window this rank keeps its island's
        # share of the gathered buffer (1/I of it); the bucket's other gathers until the step run in the island
        self.island = ctx.secondary_group if spec.shards_params else None
        self.secondary: Optional[torch.Tensor] = None
        if self.island is not None:
            self.island_world, self.island_rank = C.get_world_size(self.island), C.get_rank(self.island)
            if store.layout.padded_numel % self.island_world:
                raise ValueError(f"bucket {name.index}: {store.layout.padded_numel} padded elements do not split "
                                 f"over islands of {self.island_world} ranks")

    # ------------------------------------------------------------------ stage 3: unshard and reshard
    def unshard(self, async_op: bool, exact: bool = False) -> None:
        """Start the all-gather of the full parameters (stage 3); :meth:`wait_unshard` makes them usable. With
        ``gather_quant`` the shards travel quantized unless ``exact`` (gathers for export and the end of fit)."""
        if self.param_state is not ParamState.SHARDED:
            return
        self.param_state = param_transition(self.param_state, ParamState.GATHERING, f"bucket {self.name.index}")
        store = self.store
        if self._aliases_shard():  # a gather group of one rank: the shard is the whole buffer, used as it is
            store.flat_param = store.shard
            self.gauge.add(store.full_bytes)
            self.exact = exact
            self.work = None
            return
        full = store.grow_full()
        self.gauge.add(store.full_bytes)
        self.exact = exact
        tag = self.name.unshard_tag
        if self.secondary is not None and not (exact and self.quant is not None):
            with label("gather_launch"):  # hpZ: inside the island, from the copies kept at the window's first gather
                self.work = C.all_gather(full, self.secondary, group=self.island, async_op=async_op, tag=tag)
            return
        src = store.shard
        if store.offload_params:  # host shard: to the device first (a fresh staging buffer, freed after the gather)
            src = torch.empty(src.numel(), dtype=store.dtype, device=store.device).copy_(src, non_blocking=True)
        if self.solo:  # a gather group of one rank: the shard is the whole buffer
            full.copy_(src)
            self.work = None
            return
        with label("gather_launch"):
            if self.quant is not None and not exact:
                self.work = self._launch_quantized(src, async_op, tag)
                return
            self.work = self.all_gather(full, src, self.group, async_op, tag)

    def _aliases_shard(self) -> bool:
        """Stage 3 with a gather group of one rank (world 1, or hybrid islands of one): the persistent shard is the
        whole padded buffer, so the module's parameters are views of it while the unit is gathered, with no copy
        into a fresh buffer at every gather. Not with the shard in host memory (``offload_params``: the module
        computes on the device) nor with hpZ island copies."""
        shard = self.store.shard
        return (self.solo and not self.store.offload_params and self.island is None
                and shard is not None and shard.numel() == self.store.layout.padded_numel)

    def _launch_quantized(self, src: torch.Tensor, async_op: bool, tag: str) -> Any:
        """Quantize this rank's shard (from the fp32 master where there is one: the values the optimizer keeps) and
        all-gather every rank's quantized shard; :meth:`wait_unshard` dequantizes them into the full buffer."""
        q, store = self.quant, self.store
        if store.master is not None:
            values = torch.zeros(q.numel, dtype=torch.float32, device=store.device)
            values[: store.owned_numel].copy_(store.master)
        else:
            values = src
        send = torch.empty(1, q.piece_bytes, dtype=torch.uint8, device=store.device)
        Q.quantize(values.view(1, -1), q, send)
        self.recv = torch.empty(self.world * q.piece_bytes, dtype=torch.uint8, device=store.device)
        return C.all_gather(self.recv, send.view(-1), group=self.group, async_op=async_op, tag=tag)

    def wait_unshard(self) -> None:
        if self.param_state is ParamState.SHARDED:
            self.unshard(async_op=False)
        if self.param_state is ParamState.UNSHARDED:
            return
        store = self.store
        if self.work is not None:
            work, self.work = self.work, None
            with label("gather_wait"):
                C.wait(work, f"the parameter all-gather of {self.name.label}")
        if self.recv is not None:
            recv, self.recv = self.recv, None
            Q.dequantize(recv.view(self.world, -1), self.quant, store.flat_param.view(self.world, -1))
        if self.island is not None and self.secondary is None and not self.exact:
            n = store.layout.padded_numel // self.island_world
            self.secondary = store.flat_param[self.island_rank * n:(self.island_rank + 1) * n].clone()
        store.show(store.flat_param)
        self.param_state = param_transition(self.param_state, ParamState.UNSHARDED, f"bucket {self.name.index}")

    def drop_secondary(self) -> None:
        """The shards are about to change (the optimizer step, a checkpoint load): the island copies are stale."""
        self.secondary = None

    def reshard(self) -> None:
        """Free the full parameters; module parameters become empty placeholders (gradients stay in grad_buf)."""
        if self.param_state is not ParamState.UNSHARDED:
            return
        self.store.free_full()
        self.gauge.add(-self.store.full_bytes)
        self.param_state = param_transition(self.param_state, ParamState.SHARDED, f"bucket {self.name.index}")

    def detach_full(self) -> None:
        """Leave the gathered parameters with the module for good (the engine is being torn down)."""
        if self.store.flat_param is not None:
            self.gauge.add(-self.store.full_bytes)
        self.param_state = ParamState.SHARDED
        self.store.hand_over()
        self.secondary = None

    # ------------------------------------------------------------------ stages 1/2: the post-step all-gather
    @property
    def gathering(self) -> bool:
        """Stages 1/2: the post-step all-gather is in flight (not waited yet)."""
        return self.step_work is not None

    def launch_after_step(self, async_op: bool) -> Any:
        """Write the updated shard back into ``flat_param`` and all-gather it (stages 1/2); the work is kept
        in ``step_work`` until :meth:`wait_after_step`. Stage 3: the master into the shard only (its units gather
        on use)."""
        store = self.store
        store.write_back_master()
        if not self.spec.gathers_after_step:
            return None
        with label("param_gather_launch"):
            self.step_work = self.all_gather(store.flat_param, store.flat_param[store.shard_start:store.shard_end],
                                             self.group, async_op, self.name.param_tag)
        return self.step_work

    def wait_after_step(self) -> None:
        work, self.step_work = self.step_work, None
        if work is not None:
            with label("param_gather_wait"):
                C.wait(work, f"the post-step parameter all-gather of {self.name.label}")

    def tensor_bytes(self) -> dict[str, int]:
        return {"secondary_params": nbytes(self.secondary)}
