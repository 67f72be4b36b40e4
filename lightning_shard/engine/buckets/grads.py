"""A bucket's gradients: the full gradient buffer's lifetime, its reduction, and the window the optimizer sees.

Autograd accumulates into ``grad_buf`` (the parameters' ``.grad`` are views of it); on a communicating backward the
buffer is reduced (:meth:`BucketGrads.launch`, the collective itself is comm/reduce.py's) and :meth:`finish` keeps
this rank's shard of the average as the gradient the optimizer steps with (``shard_param.grad`` and the chunks').
Between boundaries a window is held (``GradState``, engine/states.py): the optimizer is shown placeholders, so that
a ``zero_grad()`` of the user's is seen and drops what the window holds, as torch's contract says.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm.reduce import InFlight, Reduction
from ..labels import label
from ..states import GradState, ParamState, transition
from .chunks import OptimizerChunks
from .context import BucketName
from .flat import slot_views
from .gather import ParamGather
from .storage import BucketStorage, nbytes


class BucketGrads:
    def __init__(self, name: BucketName, store: BucketStorage, gather: ParamGather, reduction: Reduction,
                 view: OptimizerChunks) -> None:
        self.name, self.store, self.spec = name, store, store.spec
        self.gather = gather  # stage 3: ``.grad`` views exist only on gathered parameters
        self.reduction = reduction  # how the buffer is summed over the ranks (comm/reduce.py)
        self.view = view  # what the optimizer sees (buckets/chunks.py)
        self.grad_buf: Optional[torch.Tensor] = None
        self.grad_views: list[torch.Tensor] = []
        # which parameters' ranges of ``grad_buf`` hold this window's gradient (stage 3: this backward's). A range
        # that does not is void (never zeroed in advance): the parameter's ``.grad`` is None, so autograd hands its
        # next gradient over whole and :meth:`adopt` copies it in (a copy, where an add into a zeroed view would
        # read the range twice and the zeroing write it once more); a range still void at the reduction is zeroed then
        self.filled: list[bool] = []
        self.used = torch.zeros(len(store.params), dtype=torch.uint8)  # got a gradient in this window (hook fired)
        self.pending = 0  # gradients of this backward still to arrive
        self.lazy = False  # the full gradient buffer is allocated when this backward's first gradient arrives
        self.accum: Optional[torch.Tensor] = None  # fp32 shard accumulator (per_micro_batch policy)
        # the averaged gradient shard published earlier in this optimizer window, as the optimizer holds it now: a
        # backward after the boundary (manual optimization: several backwards before a step) adds to it
        self.carry: Optional[torch.Tensor] = None
        self.state = GradState.EMPTY
        self.in_flight: Optional[InFlight] = None  # the reduction launched and not waited yet

    def set_state(self, new: GradState) -> None:
        self.state = transition(self.state, new, self.name.text)

    # ------------------------------------------------------------------ the buffer
    def expect(self) -> None:
        """A backward starts and no gradient is held (ZeRO-2, the start of a window): allocate the full buffer
        only when the first gradient arrives (:meth:`attach` from the hook), so that the buckets whose gradients
        are not computed yet, or already reduce-scattered and freed, hold no full gradients."""
        self.lazy = True
        self.pending = len(self.store.params)

    def attach(self) -> None:
        """Allocate ``grad_buf`` on first use (not zeroed: see ``filled``) and take in what the parameters'
        ``.grad`` hold; a gradient the window already has stays a view (autograd adds into it)."""
        params = self.store.params
        self.lazy = False
        if self.grad_buf is None:
            self.grad_buf = self.store.step_buffer(self.store.layout.padded_numel, self.store.dtype)
            self.grad_views = slot_views(self.store.layout, self.grad_buf)
            self.filled = [False] * len(params)
        self.pending = len(params)
        if self.spec.shards_params:
            if self.gather.param_state is not ParamState.UNSHARDED:
                return  # no .grad views on empty placeholders; void ranges are zeroed at the reduction
            for i, (p, view) in enumerate(zip(params, self.grad_views)):
                if p.grad is None:  # stage 3 detaches .grad at every reshard: the buffer is the truth
                    if self.filled[i]:
                        p.grad = view
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
                    self.filled[i] = True
                elif not self.filled[i]:
                    p.grad = None
            return
        for i, (p, view) in enumerate(zip(params, self.grad_views)):
            g = p.grad
            if g is None:
                if self.filled[i]:  # the user dropped this window's gradient (zero_grad(set_to_none=True)): as
                    self.filled[i] = False  # in torch, the parameter has none unless a later backward brings one
                    self.used[i] = 0
            elif g.data_ptr() != view.data_ptr():  # a gradient set by hand: it is this window's
                view.copy_(g)
                p.grad = view
                self.filled[i] = True
            elif not self.filled[i]:  # a view of a void range: autograd must not add into it
                p.grad = None

    def adopt(self, i: int) -> None:
        """Called from the post-accumulate hook: make sure parameter ``i``'s gradient lives in the buffer."""
        p, view = self.store.params[i], self.grad_views[i]
        if p.grad is not None:
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
            if self.filled:
                self.filled[i] = True
        self.used[i] = 1
        self.pending -= 1

    def _fill_void(self) -> None:
        """Before a reduction: zero the ranges no gradient reached in this window, and the padding (a quantized
        reduction into this buffer need not leave it zero)."""
        for i, done in enumerate(self.filled):
            if not done:
                self.grad_views[i].zero_()
                self.filled[i] = True
        self.grad_buf[self.store.layout.numel:].zero_()

    def release(self) -> None:
        for p in self.store.params:
            if not self.spec.shards_params or self.gather.param_state is ParamState.UNSHARDED:
                p.grad = None
        self.grad_buf, self.grad_views, self.filled = None, [], []

    # ------------------------------------------------------------------ the reduction
    def launch(self, async_op: bool) -> None:
        """Start the reduction of the gradient buffer (stage 0: all-reduce; stages 1-3: reduce-scatter)."""
        with label("reduce_launch"):
            self.set_state(GradState.REDUCING)
            if self.grad_buf is None:  # boundary reached with no backward in this window: contribute zeros
                self.attach()
            self._fill_void()
            self.in_flight = self.reduction.launch(self.grad_buf, async_op, self.name.grad_tag)

    def finish(self, boundary: bool, accumulate: bool) -> None:
        """Wait for the reduction; fold it into the accumulator and, on a boundary, publish the averaged grad."""
        assert self.in_flight is not None
        mine = self.in_flight.wait(f"the gradient reduction of {self.name.label}")
        self.in_flight = None  # the buffers it kept for the wait (pieces, the reduce-dtype copy) go now
        shard_param = self.store.shard_param
        if accumulate:
            if self.accum is None:
                self.accum = self.store.step_buffer(self.store.owned_numel, torch.float32, zero=True)
            self.accum.add_(mine)
            mine = self.accum
        elif self.reduction.form.shard_in_full_buffer and self.spec.frees_grads and mine.dtype == shard_param.dtype:
            mine = mine.clone()  # a slice of the all-reduced full buffer, which is freed below: keep the shard only
        if self.spec.frees_grads:
            self.release()  # ZeRO-2/3: the full gradient is not needed past its reduce-scatter
        if not boundary:
            self.hold()
            return
        mine = self.reduction.average(mine, shard_param.dtype, self.name.replicate_tag)
        if self.carry is not None:  # the average published earlier in this window (reopen)
            mine.add_(self.carry.to(mine.device))
            self.carry = None
        if self.store.offload:  # the optimizer steps in host memory: copy the gradient shard out
            mine = self.store.to_host(mine)
        shard_param.grad = mine
        self.view.set_grads(mine)
        self.set_state(GradState.REDUCED)

    # ------------------------------------------------------------------ the window as the user's optimizer sees it
    def hold(self) -> None:
        """This window's gradients stay here, not (all) reduced, until a boundary or the step; the optimizer is shown
        placeholders, so that a ``zero_grad()`` meanwhile is seen (:meth:`take_in_zero_grad`)."""
        if self.state is not GradState.ACCUMULATING:
            self.set_state(GradState.ACCUMULATING)
        self.view.show_pending()

    def take_in_zero_grad(self) -> None:
        """Before gradients are added to or reduced from a held window: a ``zero_grad()`` of the user's optimizer
        since drops what the window holds (torch: ``opt.step()`` applies what was accumulated since the optimizer's
        last ``zero_grad()``). ``set_to_none=False`` keeps the parameters that had a gradient stepping, with zeros."""
        if self.state is GradState.ACCUMULATING:
            seen = self.view.touched()
            if seen is not None:
                self.drop_window(keep_used=seen == "zeroed")

    def reopen(self) -> None:
        """A backward adds to a window already reduced (manual optimization: several backwards before the step, or
        one reaching another optimizer's parameters). What the optimizer holds now (the published average, or
        nothing after its ``zero_grad()``) is carried, and the next reduction's average is added to it: the linear
        sum DDP computes, each backward's gradient communicated once."""
        held = self.view.held_grads()
        self.drop_window(keep_used=held is not None)
        if held is not None:
            self.carry = held
            self.hold()

    def drop_window(self, keep_used: bool) -> None:
        """Forget this window's gradients (held, accumulated, carried or published); ``keep_used``: the parameters
        that had one still count as having a gradient (zeros) for the step."""
        self.accum, self.carry = None, None
        self.store.shard_param.grad = None
        self.view.set_grads(None)
        if self.grad_buf is not None:
            if self.spec.frees_grads:
                self.release()
            else:  # stages 0/1 keep the buffer: its ranges are void until the next gradients arrive
                for p in self.store.params:
                    p.grad = None
                self.filled = [False] * len(self.store.params)
        if not keep_used:
            self.used.zero_()
        if self.state is not GradState.EMPTY:
            self.set_state(GradState.EMPTY)

    def tensor_bytes(self) -> dict[str, int]:
        """Bytes of the gradients (the full buffer, and the optimizer's shard gradient where it is not a view of
        it), the accumulator and ``reduce_quant``'s error feedback."""
        # offload: the optimizer's gradient is the host copy (kept allocated across windows)
        shard_grad = self.store.host_grad if self.store.offload else self.store.shard_param.grad
        aliased = shard_grad is not None and self.grad_buf is not None and \
            shard_grad.untyped_storage().data_ptr() == self.grad_buf.untyped_storage().data_ptr()
        aliased = aliased or (shard_grad is not None and shard_grad is self.accum)
        return {"grads": nbytes(self.grad_buf) + (0 if aliased else nbytes(shard_grad)),
                "accumulators": nbytes(self.accum), "error_feedback": nbytes(self.reduction.residual)}
