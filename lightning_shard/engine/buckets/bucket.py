"""A bucket: a group of parameters flattened into one padded buffer, and the rank's shard of it.

A bucket is a holder of three parts, one per concern:

* ``store`` (:class:`.storage.BucketStorage`): the memory: the flat parameter buffer, the shard, the fp32 masters,
  the offload host buffers, and the module's parameters as views of them;
* ``grads`` (:class:`.grads.BucketGrads`): the full gradient buffer's lifetime, its reduction (how it runs is
  comm/reduce.py's ``Reduction``) and the accumulation window;
* ``gather`` (:class:`.gather.ParamGather`): stage 3's unshard/reshard and the post-step all-gather of stages 1/2.

The optimizer sees ``optimizer_view``: views of ``store.shard_param`` (:mod:`.chunks`), split at parameter
boundaries where parameters are treated differently, so that a parameter that got no gradient in a window is left
out of the step (``grad=None``) with its own state and step count, exactly as torch does.

What every bucket of an engine shares (groups, stage, dtypes, offload, quantization, the collectives' forms) comes
in one :class:`.context.BucketContext`. Below: what the bucket is, and the few verbs the engine and stage 3's controller
call on the whole bucket; the rest they call on its parts (``bucket.grads.launch``, ``bucket.gather.unshard``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..comm.reduce import Reduction
from ..states import GradState
from .chunks import OptimizerChunks
from .context import BucketContext, BucketName
from .gather import Gauge, ParamGather
from .grads import BucketGrads
from .storage import BucketStorage

__all__ = ["Bucket", "Gauge"]


class Bucket:
    def __init__(self, ctx: BucketContext, index: int, params: list[nn.Parameter], names: list[str],
                 opt_index: Optional[int], param_groups: Optional[list[int]] = None, unit: Optional[str] = None
                 ) -> None:
        """``opt_index``: the optimizer holding these parameters (None: frozen, stage 3); ``param_groups``: each
        parameter's param group in it (a bucket holds every group of its optimizer, each a contiguous run:
        engine/buckets/plan.py); ``unit``: the stage-3 unit's name, for messages."""
        self.spec, self.group, self.opt_index = ctx.spec, ctx.group, opt_index
        self.param_groups = list(param_groups) if param_groups is not None else [0] * len(params)
        self.trainable = opt_index is not None  # stage 3 also shards frozen parameters, with no optimizer
        self.name = BucketName(index, names[0], unit)
        self.store = store = BucketStorage(ctx, params, names, self.trainable)
        # what the bucket is, fixed by its storage at construction: the parameters, the layout and this rank's
        # ranges of it (``[shard_start, shard_end)`` padded, ``[own_lo, own_hi)`` its real elements), the dtype the
        # module computes in (``cast``: held as fp32 masters, computed in ``param_dtype``), what the optimizer steps
        self.params, self.names, self.layout = store.params, store.names, store.layout
        self.device, self.dtype, self.itemsize, self.cast = store.device, store.dtype, store.itemsize, store.cast
        self.shard_start, self.shard_end, self.own_lo, self.own_hi = (store.shard_start, store.shard_end,
                                                                       store.own_lo, store.own_hi)
        self.owned_numel, self.shard_param = store.owned_numel, store.shard_param
        self.gather = ParamGather(ctx, self.name, store)
        self.optimizer_view = OptimizerChunks(store.shard_param, store.layout.owned_slots(store.own_lo, store.own_hi),
                                              ctx.chunk_numel, self.trainable, self.param_groups)
        self.grads = BucketGrads(self.name, store, self.gather, self._reduction(ctx, store),
                                 self.optimizer_view)

    @staticmethod
    def _reduction(ctx: BucketContext, store: BucketStorage) -> Reduction:
        """How this bucket's gradients are summed over the ranks (comm/reduce.py decides)."""
        return Reduction(ctx.spec, ctx.reduce_form, group=ctx.group, shard=(store.shard_start, store.shard_end),
                         own=(store.own_lo, store.own_hi), dtype=store.dtype, alloc=store.step_buffer,
                         reduce_dtype=ctx.reduce_dtype, reduce_quant=ctx.reduce_quant, quant_block=ctx.quant_block,
                         error_feedback=ctx.error_feedback, replicate_group=ctx.replicate_group,
                         total_world=ctx.total_world)

    # ------------------------------------------------------------------ what the bucket is (its storage's)
    @property
    def index(self) -> int:
        return self.name.index

    @index.setter
    def index(self, value: int) -> None:  # stage 3: numbered once every unit is built (engine/build.py)
        self.name.renumber(value)

    # ------------------------------------------------------------------ gradients (grads.py)
    @property
    def pending(self) -> int:
        """Gradients of this backward still to arrive."""
        return self.grads.pending

    @pending.setter
    def pending(self, value: int) -> None:
        self.grads.pending = value

    @property
    def grad_buf(self) -> Optional[torch.Tensor]:
        """The full gradient buffer (None while this bucket holds no full gradients)."""
        return self.grads.grad_buf

    @property
    def state(self) -> GradState:
        return self.grads.state

    @property
    def used(self) -> torch.Tensor:
        """Per parameter: got a gradient in this window."""
        return self.grads.used

    def expect_grads(self) -> None:
        self.grads.expect()

    def attach_grads(self) -> None:
        self.grads.attach()

    def end_window(self) -> None:
        """Close the accumulation window after the optimizer step (or a skipped step)."""
        self.grads.drop_window(keep_used=False)

    def wait_offload(self) -> None:
        self.store.wait_offload()

    # ------------------------------------------------------------------ the optimizer (chunks.py)
    @property
    def chunks(self) -> list[nn.Parameter]:
        return self.optimizer_view.chunks

    def leave_out(self, unused: list[int], opt_state: dict) -> bool:
        """Parameters (slot indices) that got no gradient on any rank in this window are left out of the step
        (``grad=None``), as torch leaves a parameter with no gradient: no momentum, no weight decay, no Adam
        step. True when chunks were split (the optimizer's param groups must be rebound)."""
        return self.optimizer_view.leave_out(set(unused), opt_state)

    # ------------------------------------------------------------------ stage 3 parameters (gather.py: the gathers)
    @property
    def gauge(self) -> Gauge:
        return self.gather.gauge

    @gauge.setter
    def gauge(self, value: Gauge) -> None:  # the controller hands every bucket of its units the same one
        self.gather.gauge = value

    def detach_full(self) -> None:
        self.gather.detach_full()

    def drop_secondary(self) -> None:
        self.gather.drop_secondary()

    # ------------------------------------------------------------------ accounting
    def tensor_bytes(self) -> dict[str, Any]:
        """Bytes this bucket holds, by kind (ShardEngine.memory_report adds them up)."""
        return {**self.store.tensor_bytes(), **self.grads.tensor_bytes(), **self.gather.tensor_bytes()}
