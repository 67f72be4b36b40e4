"""A bucket: a group of parameters flattened into one padded buffer, and the rank's shard of it.

The parameters become views into ``flat_param``; their gradients become views into ``grad_buf``, so
autograd accumulates straight into the buffer that is reduced. ``shard_param`` is the rank's owned elements:
the fp32 master copy when parameters are in half precision, otherwise a view onto ``flat_param`` itself.

The optimizer sees ``chunks``: views of ``shard_param`` (:mod:`.chunks`), split at parameter boundaries where
parameters are treated differently, so that a parameter that got no gradient in a window is left out of the
step (``grad=None``) with its own state and step count, exactly as torch does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from ..comm import collectives as C
from ..comm import hostmem
from ..comm import quant as Q
from ..settings import label
from ..spec import ShardSpec
from ..states import GradState, ParamState, param_transition, transition
from .chunks import OptimizerChunks
from .flat import FlatLayout, build_layout, flatten_into, slot_views

if TYPE_CHECKING:
    from ..zero3.unit import Unit


class Gauge:
    """Bytes of full (gathered) stage-3 parameters alive now, and the most ever: kept by the buckets as they
    allocate and free, so that reading it costs nothing."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


def host_buffer(numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A buffer in host memory for a bucket on ``device`` (pinned when ``device`` is a GPU, so copies to and from it
    are asynchronous)."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")


class Bucket:
    def __init__(self, index: int, params: list[nn.Parameter], names: list[str], opt_index: Optional[int],
                 param_groups: Optional[list[int]], *, spec: ShardSpec, rank: int, group: C.Group,
                 replicate_group: C.Group = None, chunk_numel: int = 1 << 20, gather_group: C.Group = None,
                 param_dtype: Optional[torch.dtype] = None, offload: bool = False,
                 offload_params: bool = False, reduce_scatter_path: str = "reduce_scatter",
                 gather_quant: str = "none", reduce_quant: str = "none", quant_block: int = Q.DEFAULT_BLOCK,
                 error_feedback: bool = True, secondary_group: C.Group = None,
                 all_gather_via: str = "all_gather", huge_pages: bool = True) -> None:
        self.index, self.params, self.names = index, params, names
        # the optimizer holding these parameters (None: frozen, stage 3) and each parameter's param group in it: a
        # bucket holds every group of its optimizer, each a contiguous run (engine/buckets/plan.py)
        self.opt_index = opt_index
        self.param_groups = list(param_groups) if param_groups is not None else [0] * len(params)
        self.spec, self.rank, self.world, self.group = spec, rank, spec.world, group
        self.replicate_group = replicate_group  # hybrid: the same shard on the other islands
        # the parameter all-gathers: stage 3's, and the post-step all-gather of stages 1/2
        self.gather_group = group if gather_group is None else gather_group
        self._solo_gather = C.get_world_size(self.gather_group) == 1
        self.total_world = spec.world * (C.get_world_size(replicate_group) if replicate_group is not None else 1)
        # how the gradient reduce-scatter runs (engine/comm/collectives.py ``reduce_scatter_path``): the backend's own,
        # an all-to-all and a sum of the pieces (gloo's default), or an in-place all-reduce of which this rank keeps
        # its slice
        self.rs_path = reduce_scatter_path
        self.rs_via_all_reduce = reduce_scatter_path == "all_reduce" and spec.reduce_scatters
        source = params[0].dtype  # the dtype the module's parameters came in with
        # mixed-precision policy (``param_dtype``): fp32 parameters are held as fp32 masters (the rank's owned
        # elements) and computed, gathered and stored in the module in ``param_dtype``
        self.cast = param_dtype is not None and source.is_floating_point and param_dtype != source
        self.dtype = param_dtype if self.cast else source
        self.device = params[0].device
        self.itemsize = self.dtype.itemsize
        self.unit: Optional[Unit] = None  # the ZeRO-3 unit this bucket belongs to (stage 3 only)
        self.gauge = Gauge()  # stage 3: the controller hands every bucket the same one
        self.layout: FlatLayout = build_layout([(n, tuple(p.shape)) for n, p in zip(names, params)], spec.num_shards)
        shard = 0 if spec.num_shards == 1 else rank
        self.shard_start, self.shard_end = self.layout.shard_range(shard)
        # how this bucket's parameter all-gathers run (collectives.py ``all_gather_path``: by backend and size)
        self.ag_path = C.all_gather_path(all_gather_via, group, self.layout.padded_numel * self.itemsize)
        # the buffers allocated every step (full gradients, reduction pieces and shards, gathered units) are advised
        # as transparent huge pages on CPU (engine/comm/hostmem.py): fewer page faults, the same values
        self.huge_pages = huge_pages
        self.own_lo, self.own_hi = self.layout.owned_range(shard)
        # compressed communication (comm/quant.py): the stage-3 parameter all-gathers of forward and backward move
        # block-quantized shards (the masters stay exact); the gradient reductions move every rank's quantized pieces
        # in an all-to-all, summed in fp32 on arrival, each rank carrying its own quantization error to its next
        # reduction (``residual``: error feedback). Both only where a collective runs (more than one rank).
        self.gather_q: Optional[Q.QuantLayout] = None
        if gather_quant != "none" and spec.shards_params and spec.num_shards > 1:
            self.gather_q = Q.QuantLayout.of(gather_quant, quant_block, self.layout.shard_numel)
        self.reduce_q: Optional[Q.QuantLayout] = None
        if reduce_quant != "none" and spec.reduce_scatters and spec.world > 1:
            self.reduce_q = Q.QuantLayout.of(reduce_quant, quant_block, self.layout.shard_numel)
        self.residual: Optional[torch.Tensor] = None  # reduce_quant: this rank's error not yet sent (fp32, full)
        self.error_feedback = error_feedback
        self._gather_recv: Optional[torch.Tensor] = None  # gather_quant: every rank's quantized shard, in flight
        self._qsend: Optional[torch.Tensor] = None  # reduce_quant: this rank's quantized pieces, in flight
        # hpZ (``secondary_shard``): after the first gather of an optimizer window this rank keeps its island's
        # share of the gathered buffer (1/I of it); the bucket's other gathers until the step run in the island
        self.secondary_group = secondary_group if spec.shards_params else None
        self.secondary: Optional[torch.Tensor] = None
        self._gather_exact = False  # the gather in flight is an exact one (export, end of fit)
        if self.secondary_group is not None:
            self._sec_world = C.get_world_size(self.secondary_group)
            self._sec_rank = C.get_rank(self.secondary_group)
            if self.layout.padded_numel % self._sec_world:
                raise ValueError(f"bucket {index}: {self.layout.padded_numel} padded elements do not split over "
                                 f"islands of {self._sec_world} ranks")

        self.flat_param: Optional[torch.Tensor] = None
        self._full: Optional[torch.Tensor] = None  # stage 3: the full buffer whose storage unshard/reshard resize
        own_source: Optional[torch.Tensor] = None  # the owned elements in the source dtype (cast buckets)
        if spec.shards_params:  # copy only this rank's range: no full flat buffer at setup (deferred init peak)
            shard_buf = torch.zeros(self.layout.shard_numel, dtype=source, device=self.device)
            by_name = dict(zip(names, params))
            with torch.no_grad():
                for slot, lo, hi in self.layout.slot_intersections(self.shard_start, self.shard_end):
                    p = by_name[slot.name]
                    shard_buf[lo - self.shard_start:hi - self.shard_start].copy_(
                        p.detach().reshape(-1)[lo - slot.offset:hi - slot.offset])
            if self.cast:
                own_source = shard_buf[: self.own_hi - self.own_lo].clone()
                shard_buf = shard_buf.to(self.dtype)
        else:
            full = torch.empty(self.layout.padded_numel, dtype=source, device=self.device)
            with torch.no_grad():
                flatten_into(self.layout, [p.detach() for p in params], full)
            if self.cast:
                own_source = full[self.own_lo:self.own_hi].clone()
                full = full.to(self.dtype)
            self.flat_param = full
        self.trainable = opt_index is not None  # stage 3 also shards frozen parameters, with no optimizer
        # stage 3: only the padded shard persists; the full buffer exists while the unit is unsharded
        self.shard: Optional[torch.Tensor] = None
        self.param_state = ParamState.UNSHARDED
        self._gather_work: Any = None
        self._param_work: Any = None  # stages 1/2: the post-step all-gather, waited on by a forward pre-hook
        # stage 3 ``offload_params``: the persistent shard lives in host memory (pinned on CUDA) and is copied to the
        # device just before its all-gather; only gathered units occupy the accelerator
        self.offload_params = offload_params and spec.shards_params
        if spec.shards_params:
            if self.offload_params:
                shard_buf = host_buffer(shard_buf.numel(), self.device, shard_buf.dtype).copy_(shard_buf)
            self.shard = shard_buf
            own = self.shard[: self.owned_numel]
            self.reshard()
        else:
            for p, view in zip(params, slot_views(self.layout, self.flat_param)):
                p.data = view
            own = self.flat_param[self.own_lo:self.own_hi]
        self.master: Optional[torch.Tensor] = None
        # ZeRO-Offload (``offload_optimizer``): the fp32 master shard, its gradient and (created by the optimizer
        # on the master's device) the optimizer state live in host memory, pinned on CUDA; the optimizer steps on
        # the CPU. On a CPU-only machine the same path runs with separate host buffers.
        self.offload = offload and self.trainable
        self.host_grad: Optional[torch.Tensor] = None  # offload: the averaged gradient shard, copied out
        self._offload_event: Any = None  # offload on CUDA: the device-to-host gradient copy
        if self.offload:
            if self.offload_params and own_source is None and own.dtype == torch.float32:
                self.master = own  # the host shard is the fp32 master already: one copy, not two
            else:
                self.master = host_buffer(self.owned_numel, self.device).copy_(
                    own_source if own_source is not None else own.detach())
            self.shard_param = nn.Parameter(self.master)
        elif own_source is not None:  # param_dtype: the fp32 values are the truth, frozen parameters' included
            self.master = own_source if not self.offload_params else host_buffer(own_source.numel(),
                                                                                 self.device).copy_(own_source)
            self.shard_param = nn.Parameter(self.master, requires_grad=self.trainable)
        elif self.dtype in (torch.float16, torch.bfloat16) and self.trainable:
            self.master = own.detach().float().clone()
            self.shard_param = nn.Parameter(self.master)
        else:
            self.shard_param = nn.Parameter(own, requires_grad=self.trainable)  # shares storage
        # The optimizer sees the shard in chunks (views): on CPU an update over a few MiB at a time stays in
        # cache (3x faster AdamW than one 50 MB tensor, measured); split per parameter only where needed
        self.slot_ranges: dict[int, tuple[int, int]] = {}  # slot -> owned coordinates of its piece here
        for i, slot in enumerate(self.layout.slots):
            a, e = max(slot.offset, self.own_lo) - self.own_lo, min(slot.end, self.own_hi) - self.own_lo
            if a < e:
                self.slot_ranges[i] = (a, e)
        self.optimizer_view = OptimizerChunks(self.shard_param, self.slot_ranges, chunk_numel, self.trainable,
                                              self.param_groups)
        self.grad_buf: Optional[torch.Tensor] = None
        self.grad_views: list[torch.Tensor] = []
        self.accum: Optional[torch.Tensor] = None  # fp32 shard accumulator (per_micro_batch policy)
        # the averaged gradient shard published earlier in this optimizer window, as the optimizer holds it now: a
        # backward after the boundary (manual optimization: several backwards before a step) adds to it
        self.carry: Optional[torch.Tensor] = None
        self.state = GradState.EMPTY
        self.pending = 0
        self.lazy = False  # the full gradient buffer is allocated when this backward's first gradient arrives
        # which parameters' ranges of ``grad_buf`` hold this window's gradient (stage 3: this backward's). A range
        # that does not is void (never zeroed in advance): the parameter's ``.grad`` is None, so autograd hands its
        # next gradient over whole and :meth:`adopt_grad` copies it in (a copy, where an add into a zeroed view would
        # read the range twice and the zeroing write it once more); a range still void at the reduction is zeroed then
        self._filled: list[bool] = []
        self.used = torch.zeros(len(params), dtype=torch.uint8)  # got a gradient in this window (hook fired)
        self._src: Optional[torch.Tensor] = None
        self._out: Optional[torch.Tensor] = None
        self._pieces: Optional[torch.Tensor] = None  # the all-to-all form: every rank's piece of this rank's range
        # the all-to-all form on two ranks (``C.exchange_pair``): where the other rank's piece of this rank's range
        # arrives (this rank's own piece stays in ``_src``)
        self._recv: Optional[torch.Tensor] = None
        self._work: Any = None

    # ------------------------------------------------------------------ sizes
    @property
    def owned_numel(self) -> int:
        return self.own_hi - self.own_lo

    def set_state(self, new: GradState) -> None:
        self.state = transition(self.state, new, f"bucket {self.index} ({self.names[0]}...)")

    def _step_buffer(self, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        """A buffer this bucket allocates every step, on its device: advised as huge pages on CPU (``huge_pages``,
        engine/comm/hostmem.py); ``zero``: zero-filled after the advice."""
        return (hostmem.zeros if zero else hostmem.empty)(numel, dtype, self.device, self.huge_pages)

    # ------------------------------------------------------------------ stage 3: parameter materialization
    def unshard(self, async_op: bool, exact: bool = False) -> None:
        """Start the all-gather of the full parameters (stage 3); :meth:`wait_unshard` makes them usable. With
        ``gather_quant`` the shards travel quantized unless ``exact`` (gathers for export and the end of fit)."""
        if self.param_state is not ParamState.SHARDED:
            return
        self.param_state = param_transition(self.param_state, ParamState.GATHERING, f"bucket {self.index}")
        if self._aliases_shard():  # a gather group of one rank: the shard is the whole buffer, used as it is
            self.flat_param = self.shard
            self.gauge.add(self.layout.padded_numel * self.itemsize)
            self._gather_exact = exact
            self._gather_work = None
            return
        # one full buffer per bucket, kept across reshards; its *storage* is freed at reshard and regrown here, so
        # every view of it (autograd's saved ``weight.t()`` of an ``F.linear`` included) loses its memory when the
        # unit is resharded and sees the gathered values again in backward
        if self._full is None:
            self._full = self._step_buffer(self.layout.padded_numel, self.dtype)
        else:
            self._full.untyped_storage().resize_(self.layout.padded_numel * self.itemsize)
            if self.huge_pages:  # a fresh allocation, not written yet
                hostmem.advise(self._full)
        self.flat_param = self._full
        self.gauge.add(self.layout.padded_numel * self.itemsize)
        self._gather_exact = exact
        if self.secondary is not None and not (exact and self.gather_q is not None):
            with label("gather_launch"):  # hpZ: inside the island, from the copies kept at the window's first gather
                self._gather_work = C.all_gather(self.flat_param, self.secondary, group=self.secondary_group,
                                                 async_op=async_op, tag=f"unshard_bucket{self.index}")
            return
        src = self.shard
        if self.offload_params:  # host shard: to the device first (a fresh staging buffer, freed after the gather)
            src = torch.empty(self.shard.numel(), dtype=self.dtype, device=self.device).copy_(self.shard,
                                                                                              non_blocking=True)
        if self._solo_gather:  # a gather group of one rank: the shard is the whole buffer
            self.flat_param.copy_(src)
            self._gather_work = None
            return
        with label("gather_launch"):
            if self.gather_q is not None and not exact:
                self._gather_work = self._launch_quantized_gather(src, async_op)
                return
            self._gather_work = C.all_gather(self.flat_param, src, group=self.gather_group, async_op=async_op,
                                             tag=f"unshard_bucket{self.index}", via=self.ag_path)

    def _aliases_shard(self) -> bool:
        """Stage 3 with a gather group of one rank (world 1, or hybrid islands of one): the persistent shard is the
        whole padded buffer, so the module's parameters are views of it while the unit is gathered, with no copy
        into a fresh buffer at every gather. Not with the shard in host memory (``offload_params``: the module
        computes on the device) nor with hpZ island copies."""
        return (self._solo_gather and not self.offload_params and self.secondary_group is None
                and self.shard is not None and self.shard.numel() == self.layout.padded_numel)

    def _launch_quantized_gather(self, src: torch.Tensor, async_op: bool) -> Any:
        """Quantize this rank's shard (from the fp32 master where there is one: the values the optimizer keeps) and
        all-gather every rank's quantized shard; :meth:`wait_unshard` dequantizes them into the full buffer."""
        q = self.gather_q
        if self.master is not None:
            values = torch.zeros(q.numel, dtype=torch.float32, device=self.device)
            values[: self.owned_numel].copy_(self.master)
        else:
            values = src
        send = torch.empty(1, q.piece_bytes, dtype=torch.uint8, device=self.device)
        Q.quantize(values.view(1, -1), q, send)
        self._gather_recv = torch.empty(self.world * q.piece_bytes, dtype=torch.uint8, device=self.device)
        return C.all_gather(self._gather_recv, send.view(-1), group=self.gather_group, async_op=async_op,
                            tag=f"unshard_bucket{self.index}")

    def _what(self) -> str:
        unit = getattr(self.unit, "name", None)
        return (f"unit {unit!r} (bucket {self.index}: {self.names[0]}...)" if unit else
                f"bucket {self.index} ({self.names[0]}...)")

    def wait_unshard(self) -> None:
        if self.param_state is ParamState.SHARDED:
            self.unshard(async_op=False)
        if self.param_state is ParamState.UNSHARDED:
            return
        if self._gather_work is not None:
            work, self._gather_work = self._gather_work, None
            with label("gather_wait"):
                C.wait(work, f"the parameter all-gather of {self._what()}")
        if self._gather_recv is not None:
            recv, self._gather_recv = self._gather_recv, None
            Q.dequantize(recv.view(self.world, -1), self.gather_q, self.flat_param.view(self.world, -1))
        if self.secondary_group is not None and self.secondary is None and not self._gather_exact:
            n = self.layout.padded_numel // self._sec_world
            self.secondary = self.flat_param[self._sec_rank * n:(self._sec_rank + 1) * n].clone()
        for p, view in zip(self.params, slot_views(self.layout, self.flat_param)):
            p.data = view
        self.param_state = param_transition(self.param_state, ParamState.UNSHARDED, f"bucket {self.index}")

    def drop_secondary(self) -> None:
        """The shards are about to change (the optimizer step, a checkpoint load): the island copies are stale."""
        self.secondary = None

    def reshard(self) -> None:
        """Free the full parameters; module parameters become empty placeholders (gradients stay in grad_buf)."""
        if self.param_state is not ParamState.UNSHARDED:
            return
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty
            p.grad = None
        self.flat_param = None
        if self._full is not None:  # the memory itself, not just our reference: views saved for backward too
            self._full.untyped_storage().resize_(0)
        self.gauge.add(-self.layout.padded_numel * self.itemsize)
        self.param_state = param_transition(self.param_state, ParamState.SHARDED, f"bucket {self.index}")

    def detach_full(self) -> None:
        """Leave the gathered parameters with the module for good (the engine is being torn down)."""
        if self.flat_param is not None:
            self.gauge.add(-self.layout.padded_numel * self.itemsize)
        self.param_state = ParamState.SHARDED
        self.flat_param = None
        self._full = None  # the module owns that storage now: never resized again
        self.shard = None
        self.secondary = None

    # ------------------------------------------------------------------ gradients
    def expect_grads(self) -> None:
        """A backward starts and no gradient is held (ZeRO-2, the start of a window): allocate the full buffer
        only when the first gradient arrives (:meth:`attach_grads` from the hook), so that the buckets whose
        gradients are not computed yet, or already reduce-scattered and freed, hold no full gradients."""
        self.lazy = True
        self.pending = len(self.params)

    def attach_grads(self) -> None:
        """Allocate ``grad_buf`` on first use (not zeroed: see ``_filled``) and take in what the parameters'
        ``.grad`` hold; a gradient the window already has stays a view (autograd adds into it)."""
        self.lazy = False
        if self.grad_buf is None:
            self.grad_buf = self._step_buffer(self.layout.padded_numel, self.dtype)
            self.grad_views = slot_views(self.layout, self.grad_buf)
            self._filled = [False] * len(self.params)
        self.pending = len(self.params)
        if self.spec.shards_params:
            if self.param_state is not ParamState.UNSHARDED:
                return  # no .grad views on empty placeholders; void ranges are zeroed at the reduction
            for i, (p, view) in enumerate(zip(self.params, self.grad_views)):
                if p.grad is None:  # stage 3 detaches .grad at every reshard: the buffer is the truth
                    if self._filled[i]:
                        p.grad = view
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
                    self._filled[i] = True
                elif not self._filled[i]:
                    p.grad = None
            return
        for i, (p, view) in enumerate(zip(self.params, self.grad_views)):
            g = p.grad
            if g is None:
                if self._filled[i]:  # the user dropped this window's gradient (zero_grad(set_to_none=True)): as
                    self._filled[i] = False  # in torch, the parameter has none unless a later backward brings one
                    self.used[i] = 0
            elif g.data_ptr() != view.data_ptr():  # a gradient set by hand: it is this window's
                view.copy_(g)
                p.grad = view
                self._filled[i] = True
            elif not self._filled[i]:  # a view of a void range: autograd must not add into it
                p.grad = None

    def adopt_grad(self, i: int) -> None:
        """Called from the post-accumulate hook: make sure parameter ``i``'s gradient lives in the buffer."""
        p, view = self.params[i], self.grad_views[i]
        if p.grad is not None:
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
            if self._filled:
                self._filled[i] = True
        self.used[i] = 1
        self.pending -= 1

    def _fill_void(self) -> None:
        """Before a reduction: zero the ranges no gradient reached in this window, and the padding (a quantized
        reduction into this buffer need not leave it zero)."""
        for i, done in enumerate(self._filled):
            if not done:
                self.grad_views[i].zero_()
                self._filled[i] = True
        self.grad_buf[self.layout.numel:].zero_()

    def release_grads(self) -> None:
        for p in self.params:
            if not self.spec.shards_params or self.param_state is ParamState.UNSHARDED:
                p.grad = None
        self.grad_buf, self.grad_views, self._filled = None, [], []

    # ------------------------------------------------------------------ communication
    def launch_reduce(self, reduce_dtype: torch.dtype, async_op: bool) -> None:
        """All-reduce (stage 0) or reduce-scatter (stages 1/2) the gradient buffer in ``reduce_dtype``."""
        with label("reduce_launch"):
            self._launch_reduce(reduce_dtype, async_op)

    def _launch_reduce(self, reduce_dtype: torch.dtype, async_op: bool) -> None:
        self.set_state(GradState.REDUCING)
        if self.grad_buf is None:  # boundary reached with no backward in this window: contribute zeros
            self.attach_grads()
        self._fill_void()
        tag = f"grad_bucket{self.index}"
        if self.reduce_q is not None:  # (world > 1 only: engine/comm/quant.py)
            self._launch_quantized_reduce(async_op, tag)
            return
        src = self.grad_buf if self.grad_buf.dtype == reduce_dtype else self.grad_buf.to(reduce_dtype)
        self._src = src
        if self.world == 1:  # a group of one rank: the sum is the buffer itself, no collective to wait for
            self._out = src[self.shard_start:self.shard_end] if self.spec.reduce_scatters else src
            self._work = None
            return
        if not self.spec.reduce_scatters:
            self._out = src
            self._work = C.all_reduce(src, group=self.group, async_op=async_op, tag=tag)
        else:
            if self.rs_via_all_reduce:  # the whole buffer is summed in place; this rank's range is its shard
                self._out = src[self.shard_start:self.shard_end]
                self._work = C.all_reduce(src, group=self.group, async_op=async_op, tag=tag)
            else:
                if src is self.grad_buf and not self.spec.frees_grads:
                    # stage 1 keeps its full buffer anyway: reduce-scatter in place, into this rank's own range of
                    # it (NCCL's in-place layout; gloo too), so the averaged shard costs no buffer of its own
                    self._out = self.grad_buf[self.shard_start:self.shard_end]
                else:
                    self._out = self._step_buffer(self.layout.shard_numel, reduce_dtype)
                if self.rs_path == "all_to_all" and self.world == 2:
                    # a pair: the other rank's piece of this rank's range arrives, and this rank's own piece (still
                    # in ``src``) is added to it on arrival; no full-size pieces buffer, no local copy
                    self._recv = self._out
                    if self._out.data_ptr() == src[self.shard_start:].data_ptr():
                        # stage 1 in place: its own piece must not be overwritten before it is added
                        self._recv = self._step_buffer(self._out.numel(), src.dtype)
                    self._work = C.exchange_pair(self._recv, src, group=self.group, async_op=async_op, tag=tag)
                elif self.rs_path == "all_to_all":  # every rank's piece of this rank's range, summed on arrival
                    self._pieces = self._step_buffer(src.numel(), src.dtype)
                    self._work = C.all_to_all(self._pieces, src, group=self.group, async_op=async_op, tag=tag)
                else:
                    self._work = C.reduce_scatter(self._out, src, group=self.group, async_op=async_op, tag=tag)

    def _launch_quantized_reduce(self, async_op: bool, tag: str) -> None:
        """``reduce_quant``: this rank's gradient plus the error it has not sent yet, quantized piece by piece (piece
        j is rank j's range); what quantization loses stays in ``residual`` for the next reduction, so over many
        steps the gradients applied sum to the gradients computed, within one step's quantization error."""
        q = self.reduce_q
        x = self._step_buffer(self.grad_buf.numel(), torch.float32).copy_(self.grad_buf)
        if self.residual is not None:
            x.add_(self.residual)
        nbytes = self.world * q.piece_bytes
        self._qsend = self._step_buffer(nbytes, torch.uint8).view(self.world, -1)
        sent = Q.quantize(x.view(self.world, -1), q, self._qsend)
        if self.error_feedback:
            # a non-finite gradient (an fp16 overflow, a step skip_nonfinite skips) leaves no error to carry: without
            # this a nan would stay in the residual and poison every later reduction
            self.residual = x.view(self.world, -1).sub_(sent).view(-1).nan_to_num_(0.0, 0.0, 0.0)
        self._pieces = self._step_buffer(nbytes, torch.uint8).view(self.world, -1)
        if self.grad_buf.dtype == torch.float32 and not self.spec.frees_grads:
            self._out = self.grad_buf[self.shard_start:self.shard_end]  # stage 1: into its own range, as unquantized
        else:
            self._out = self._step_buffer(self.layout.shard_numel, torch.float32)
        self._work = C.all_to_all(self._pieces.view(-1), self._qsend.view(-1), group=self.group, async_op=async_op,
                                  tag=tag)

    # ------------------------------------------------------------------ the window as the user's optimizer sees it
    def hold(self) -> None:
        """This window's gradients stay here, not (all) reduced, until a boundary or the step; the optimizer is shown
        placeholders, so that a ``zero_grad()`` meanwhile is seen (:meth:`take_in_zero_grad`)."""
        if self.state is not GradState.ACCUMULATING:
            self.set_state(GradState.ACCUMULATING)
        self.optimizer_view.show_pending()

    def take_in_zero_grad(self) -> None:
        """Before gradients are added to or reduced from a held window: a ``zero_grad()`` of the user's optimizer
        since drops what the window holds (torch: ``opt.step()`` applies what was accumulated since the optimizer's
        last ``zero_grad()``). ``set_to_none=False`` keeps the parameters that had a gradient stepping, with zeros."""
        if self.state is GradState.ACCUMULATING:
            seen = self.optimizer_view.touched()
            if seen is not None:
                self.drop_window(keep_used=seen == "zeroed")

    def reopen(self) -> None:
        """A backward adds to a window already reduced (manual optimization: several backwards before the step, or
        one reaching another optimizer's parameters). What the optimizer holds now (the published average, or
        nothing after its ``zero_grad()``) is carried, and the next reduction's average is added to it: the linear
        sum DDP computes, each backward's gradient communicated once."""
        held = self.optimizer_view.held_grads()
        self.drop_window(keep_used=held is not None)
        if held is not None:
            self.carry = held
            self.hold()

    def drop_window(self, keep_used: bool) -> None:
        """Forget this window's gradients (held, accumulated, carried or published); ``keep_used``: the parameters
        that had one still count as having a gradient (zeros) for the step."""
        self.accum, self.carry = None, None
        self.shard_param.grad = None
        self.optimizer_view.set_grads(None)
        if self.grad_buf is not None:
            if self.spec.frees_grads:
                self.release_grads()
            else:  # stages 0/1 keep the buffer: its ranges are void until the next gradients arrive
                for p in self.params:
                    p.grad = None
                self._filled = [False] * len(self.params)
        if not keep_used:
            self.used.zero_()
        if self.state is not GradState.EMPTY:
            self.set_state(GradState.EMPTY)

    def finish_reduce(self, boundary: bool, accumulate: bool) -> None:
        """Wait for the reduction; fold it into the accumulator and, on a boundary, publish the averaged grad."""
        if self._work is not None:
            with label("reduce_wait"):
                C.wait(self._work, f"the gradient reduction of {self._what()}")
        out = self._out
        assert out is not None
        if self.reduce_q is not None and self._pieces is not None:  # quantized pieces: dequantized, summed in fp32
            Q.sum_pieces(self._pieces, self.reduce_q, out)
        elif self._pieces is not None:  # in rank order, the same on every rank: a deterministic sum
            C.sum_pieces_into(self._pieces.view(self.world, -1), out)
        elif self._recv is not None:  # two pieces: a + b is b + a bit for bit, so this is the rank-order sum too
            out.add_(self._src[self.shard_start:self.shard_end] if self._recv is out else self._recv)
        self._work, self._src, self._out, self._pieces, self._qsend = None, None, None, None, None
        self._recv = None
        if not self.spec.reduce_scatters:
            mine = out[self.own_lo:self.own_hi]
        else:
            mine = out[: self.owned_numel]
        if accumulate:
            if self.accum is None:
                self.accum = self._step_buffer(self.owned_numel, torch.float32, zero=True)
            self.accum.add_(mine)
            mine = self.accum
        elif self.rs_via_all_reduce and self.spec.frees_grads and mine.dtype == self.shard_param.dtype:
            mine = mine.clone()  # a slice of the all-reduced full buffer, which is freed below: keep the shard only
        if self.spec.frees_grads:
            self.release_grads()  # ZeRO-2/3: the full gradient is not needed past its reduce-scatter
        if not boundary:
            self.hold()
            return
        if self.replicate_group is not None:  # hybrid: one cross-island all-reduce of the shard, at the boundary
            C.all_reduce(mine, group=self.replicate_group, tag=f"replicate_bucket{self.index}")
        if mine.dtype != self.shard_param.dtype:
            mine = mine.to(self.shard_param.dtype)
        if self.total_world > 1:  # (x / 1 is x: at world 1 the pass over the shard is skipped, bit for bit the same)
            mine.div_(self.total_world)
        if self.carry is not None:  # the average published earlier in this window (reopen)
            mine.add_(self.carry.to(mine.device))
            self.carry = None
        if self.offload:  # the optimizer steps in host memory: copy the gradient shard out
            if self.host_grad is None:
                self.host_grad = host_buffer(self.owned_numel, self.device)
            self.host_grad.copy_(mine, non_blocking=True)
            if self.device.type == "cuda":
                self._offload_event = torch.cuda.Event()
                self._offload_event.record()
            mine = self.host_grad
        self.shard_param.grad = mine
        self.optimizer_view.set_grads(mine)
        self.set_state(GradState.REDUCED)

    def wait_offload(self) -> None:
        """Offload on CUDA: the host copy of the gradient shard is complete (before the CPU optimizer reads it)."""
        event, self._offload_event = self._offload_event, None
        if event is not None:
            event.synchronize()

    @property
    def chunks(self) -> list[nn.Parameter]:
        return self.optimizer_view.chunks

    def leave_out(self, unused: list[int], opt_state: dict) -> bool:
        """Parameters (slot indices) that got no gradient on any rank in this window are left out of the step
        (``grad=None``), as torch leaves a parameter with no gradient: no momentum, no weight decay, no Adam
        step. True when chunks were split (the optimizer's param groups must be rebound)."""
        return self.optimizer_view.leave_out(set(unused), opt_state)

    @property
    def gathering(self) -> bool:
        """Stages 1/2: the post-step all-gather is in flight (not waited yet)."""
        return self._param_work is not None

    def wait_param_gather(self) -> None:
        work, self._param_work = self._param_work, None
        if work is not None:
            with label("param_gather_wait"):
                C.wait(work, f"the post-step parameter all-gather of {self._what()}")

    def launch_gather(self, async_op: bool) -> Any:
        """Write the updated shard back into ``flat_param`` and all-gather it (stages 1/2); the work is kept
        in ``_param_work`` until :meth:`wait_param_gather`."""
        with torch.no_grad():
            # a host master (offload) is pinned on CUDA: the copy back is asynchronous, ordered before the gather
            if self.spec.shards_params:  # the next forward gathers; only the master needs copying into the shard
                if self.master is not None and self.master.data_ptr() != self.shard.data_ptr():
                    self.shard[: self.owned_numel].copy_(self.master, non_blocking=self.offload)
                return None
            if self.master is not None:
                self.flat_param[self.own_lo:self.own_hi].copy_(self.master, non_blocking=self.offload)
        if not self.spec.gathers_after_step:
            return None
        with label("param_gather_launch"):
            self._param_work = C.all_gather(self.flat_param, self.flat_param[self.shard_start:self.shard_end],
                                            group=self.gather_group, async_op=async_op,
                                            tag=f"param_bucket{self.index}", via=self.ag_path)
        return self._param_work

    # ------------------------------------------------------------------ optimizer state per parameter
    def slot_state(self, opt_state: dict) -> dict[int, dict[str, Any]]:
        return self.optimizer_view.slot_state(opt_state)

    def set_slot_state(self, opt_state: dict, states: dict[int, dict[str, Any]]) -> bool:
        return self.optimizer_view.set_slot_state(opt_state, states)

    def end_window(self) -> None:
        """Close the accumulation window after the optimizer step (or a skipped step)."""
        self.drop_window(keep_used=False)

    # ------------------------------------------------------------------ accounting
    def tensor_bytes(self) -> dict[str, int]:
        def nb(t: Optional[torch.Tensor]) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        # offload: the optimizer's gradient is the host copy (kept allocated across windows); offload_params with
        # fp32 parameters: the host shard is the master itself (counted once, as parameters)
        shard_grad = self.host_grad if self.offload else self.shard_param.grad
        master = 0 if self.master is not None and self.shard is not None and \
            self.master.data_ptr() == self.shard.data_ptr() else nb(self.master)
        aliased = shard_grad is not None and self.grad_buf is not None and \
            shard_grad.untyped_storage().data_ptr() == self.grad_buf.untyped_storage().data_ptr()
        aliased = aliased or (shard_grad is not None and shard_grad is self.accum)
        out = {"params": nb(self.shard) if self.spec.shards_params else nb(self.flat_param),
               "grads": nb(self.grad_buf) + (0 if aliased else nb(shard_grad)), "master": master,
               "accumulators": nb(self.accum), "error_feedback": nb(self.residual),
               "secondary_params": nb(self.secondary)}
        if self.spec.shards_params:
            # (a gather group of one rank computes on the shard itself: nothing gathered beside it)
            out["gathered_params"] = 0 if self.flat_param is self.shard else nb(self.flat_param)
        if self.offload or self.offload_params:  # ``on_host``: the part of the above in host memory
            out["on_host"] = master + nb(self.host_grad) + (out["params"] if self.offload_params else 0)
        return out

