"""A bucket's memory: the flat parameter buffer, this rank's shard of it, the fp32 masters, the host buffers of
offloading, and the module parameters as views of them.

The parameters become views into ``flat_param`` (stages 0-2: for good; stage 3: while their unit is gathered, the
rest of the time empty placeholders, and only ``shard`` persists). ``shard_param`` is what the optimizer steps: the
rank's owned elements, as the fp32 ``master`` where parameters are in half precision (or cast by ``param_dtype``, or
offloaded), otherwise a view of ``flat_param`` itself. Which collective fills or reads these buffers is the gather's
(buckets/gather.py) and the gradients' (buckets/grads.py) business; this class only holds them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..comm import hostmem
from .context import BucketContext
from .flat import flat_layout, flatten_into, slot_views


def host_buffer(numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A buffer in host memory for a bucket on ``device`` (pinned when ``device`` is a GPU, so copies to and from it
    are asynchronous)."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")


class BucketStorage:
    def __init__(self, ctx: BucketContext, params: list[nn.Parameter], names: list[str], trainable: bool) -> None:
        spec = self.spec = ctx.spec
        self.params, self.names = params, names
        source = params[0].dtype  # the dtype the module's parameters came in with
        # mixed-precision policy (``param_dtype``): fp32 parameters are held as fp32 masters (the rank's owned
        # elements) and computed, gathered and stored in the module in ``param_dtype``
        self.cast = ctx.param_dtype is not None and source.is_floating_point and ctx.param_dtype != source
        self.dtype = ctx.param_dtype if self.cast else source
        self.device = params[0].device
        # the buffers allocated every step (full gradients, reduction pieces and shards, gathered units) are advised
        # as transparent huge pages on CPU (engine/comm/hostmem.py): fewer page faults, the same values
        self.huge_pages = ctx.comm.huge_pages
        self.layout = flat_layout([(n, tuple(p.shape)) for n, p in zip(names, params)], spec.num_shards)
        shard = 0 if spec.num_shards == 1 else ctx.rank
        self.shard_start, self.shard_end = self.layout.shard_range(shard)  # this rank's padded range
        self.own_lo, self.own_hi = self.layout.owned_range(shard)  # the real (non-padding) elements of it
        self.flat_param: Optional[torch.Tensor] = None  # the full buffer the module's parameters are views of
        self.full: Optional[torch.Tensor] = None  # stage 3: the full buffer whose storage unshard/reshard resize
        self.shard: Optional[torch.Tensor] = None  # stage 3: the padded shard, the only one that persists
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
        # stage 3 ``offload_params``: the persistent shard lives in host memory (pinned on CUDA) and is copied to the
        # device just before its all-gather; only gathered units occupy the accelerator
        self.offload_params = ctx.offload_params and spec.shards_params
        if spec.shards_params:
            if self.offload_params:
                shard_buf = host_buffer(shard_buf.numel(), self.device, shard_buf.dtype).copy_(shard_buf)
            self.shard = shard_buf
            own = self.shard[: self.owned_numel]
            self.free_full()  # the module's parameters are placeholders until their unit is gathered
        else:
            self.show(self.flat_param)
            own = self.flat_param[self.own_lo:self.own_hi]
        # ZeRO-Offload (``offload_optimizer``): the fp32 master shard, its gradient and (created by the optimizer
        # on the master's device) the optimizer state live in host memory, pinned on CUDA; the optimizer steps on
        # the CPU. On a CPU-only machine the same path runs with separate host buffers.
        self.offload = ctx.offload and trainable
        self.host_grad: Optional[torch.Tensor] = None  # offload: the averaged gradient shard, copied out
        self.offload_event: Any = None  # offload on CUDA: the device-to-host gradient copy
        self.master: Optional[torch.Tensor] = None
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
            self.shard_param = nn.Parameter(self.master, requires_grad=trainable)
        elif self.dtype in (torch.float16, torch.bfloat16) and trainable:
            self.master = own.detach().float().clone()
            self.shard_param = nn.Parameter(self.master)
        else:
            self.shard_param = nn.Parameter(own, requires_grad=trainable)  # shares storage

    # ------------------------------------------------------------------ sizes
    @property
    def owned_numel(self) -> int:
        return self.own_hi - self.own_lo

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def full_bytes(self) -> int:
        """Bytes of the full (gathered) parameters."""
        return self.layout.padded_numel * self.itemsize

    def step_buffer(self, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        """A buffer this bucket allocates every step, on its device: advised as huge pages on CPU (``huge_pages``,
        engine/comm/hostmem.py); ``zero``: zero-filled after the advice."""
        return (hostmem.zeros if zero else hostmem.empty)(numel, dtype, self.device, self.huge_pages)

    # ------------------------------------------------------------------ the full buffer (stage 3: gathered units)
    def show(self, flat: torch.Tensor) -> None:
        """The module's parameters become views of ``flat``."""
        for p, view in zip(self.params, slot_views(self.layout, flat)):
            p.data = view

    def grow_full(self) -> torch.Tensor:
        """Stage 3: the full buffer to gather into, as ``flat_param``. One per bucket, kept across reshards; its
        *storage* is freed at :meth:`free_full` and regrown here, so every view of it (autograd's saved ``weight.t()``
        of an ``F.linear`` included) loses its memory when the unit is resharded and sees the gathered values again
        in backward."""
        if self.full is None:
            self.full = self.step_buffer(self.layout.padded_numel, self.dtype)
        else:
            self.full.untyped_storage().resize_(self.layout.padded_numel * self.itemsize)
            if self.huge_pages:  # a fresh allocation, not written yet
                hostmem.advise(self.full)
        self.flat_param = self.full
        return self.full

    def free_full(self) -> None:
        """Stage 3: the module's parameters become empty placeholders (gradients stay in the gradient buffer) and
        the full buffer's memory is freed, not just our reference: views saved for backward too."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty
            p.grad = None
        self.flat_param = None
        if self.full is not None:
            self.full.untyped_storage().resize_(0)

    def hand_over(self) -> None:
        """The engine is being torn down: the module keeps the gathered parameters for good."""
        self.flat_param = None
        self.full = None  # the module owns that storage now: never resized again
        self.shard = None

    # ------------------------------------------------------------------ masters and host copies
    def write_back_master(self) -> None:
        """After the optimizer step: the updated fp32 master into the shard (stage 3) or into this rank's range of
        ``flat_param`` (stages 0-2). A host master (offload) is pinned on CUDA: the copy back is asynchronous,
        ordered before the gather that follows."""
        with torch.no_grad():
            if self.spec.shards_params:
                if self.master is not None and self.master.data_ptr() != self.shard.data_ptr():
                    self.shard[: self.owned_numel].copy_(self.master, non_blocking=self.offload)
            elif self.master is not None:
                self.flat_param[self.own_lo:self.own_hi].copy_(self.master, non_blocking=self.offload)

    def to_host(self, grad: torch.Tensor) -> torch.Tensor:
        """Offload: the optimizer steps in host memory, so the averaged gradient shard is copied out (on CUDA,
        asynchronously: :meth:`wait_offload` before the optimizer reads it)."""
        if self.host_grad is None:
            self.host_grad = host_buffer(self.owned_numel, self.device)
        self.host_grad.copy_(grad, non_blocking=True)
        if self.device.type == "cuda":
            self.offload_event = torch.cuda.Event()
            self.offload_event.record()
        return self.host_grad

    def wait_offload(self) -> None:
        """Offload on CUDA: the host copy of the gradient shard is complete (before the CPU optimizer reads it)."""
        event, self.offload_event = self.offload_event, None
        if event is not None:
            event.synchronize()

    def tensor_bytes(self) -> dict[str, int]:
        """Bytes of the parameters and the masters this bucket holds (``on_host``: the part in host memory)."""
        master = 0 if self.master is not None and self.shard is not None and \
            self.master.data_ptr() == self.shard.data_ptr() else nbytes(self.master)
        out = {"params": nbytes(self.shard) if self.spec.shards_params else nbytes(self.flat_param), "master": master}
        if self.spec.shards_params:
            # (a gather group of one rank computes on the shard itself: nothing gathered beside it)
            out["gathered_params"] = 0 if self.flat_param is self.shard else nbytes(self.flat_param)
        if self.offload or self.offload_params:
            out["on_host"] = master + nbytes(self.host_grad) + (out["params"] if self.offload_params else 0)
        return out


def nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()
