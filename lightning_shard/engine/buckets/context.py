"""What every bucket of one engine shares (:class:`BucketContext`, built once per engine), and a bucket's name.

A new engine-wide setting is a field here: the buckets read it from their context, so no bucket signature changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import torch

from ...options import Compression
from ..comm import collectives as C
from ..comm.choices import CommChoices
from ..comm.reduce import ReduceForm
from ..spec import ShardSpec


@dataclass(frozen=True)
class BucketContext:
    spec: ShardSpec  # what the stage means for a bucket
    rank: int  # this rank in ``group``: which shard it owns
    group: C.Group = None  # the shard group: gradients are reduced and parameters sharded over it
    replicate_group: C.Group = None  # hybrid sharding: the same shard on the other islands
    gather_group: C.Group = None  # the parameter all-gathers' group (stage 3's, stages 1/2's post-step); None: group
    secondary_group: C.Group = None  # stage 3 ``secondary_shard`` (hpZ): this rank's island
    chunk_numel: int = 1 << 20  # elements per optimizer chunk (buckets/chunks.py)
    param_dtype: Optional[torch.dtype] = None  # the mixed-precision policy: fp32 parameters computed in this dtype
    reduce_dtype: Optional[torch.dtype] = None  # gradients travel in this dtype (None: comm/reduce.py's rule)
    offload: bool = False  # ``offload_optimizer``: fp32 masters, gradient shards and optimizer state in host memory
    offload_params: bool = False  # stage 3: the parameter shards in host memory too
    gather_quant: str = "none"  # stage 3's parameter all-gathers quantized (comm/quant.py)
    reduce_quant: str = "none"  # gradient reductions quantized (comm/reduce.py ``QuantizedAllToAll``)
    quant_block: int = Compression.block
    error_feedback: bool = True  # ``reduce_quant``: carry each rank's quantization error to its next reduction
    comm: CommChoices = field(default_factory=CommChoices)  # how collectives run on this backend (comm/choices.py)

    @cached_property
    def reduce_form(self) -> ReduceForm:
        """The gradient reduce-scatter's form on this backend: chosen once, for every bucket."""
        return self.comm.reduce_form(self.group)

    @cached_property
    def total_world(self) -> int:
        """Every rank a gradient is averaged over (hybrid: the shard group times the islands)."""
        return self.spec.world * (C.get_world_size(self.replicate_group) if self.replicate_group is not None else 1)


class BucketName:
    """A bucket's number and the strings that name it: in messages, and as the ledger's tags of its collectives.
    Stage 3 numbers its buckets once every unit is built (engine/build.py): the bucket and its parts share this
    object, so :meth:`renumber` renames them all."""

    def __init__(self, index: int, first: str, unit: Optional[str] = None) -> None:
        self.first, self.unit = first, unit  # the bucket's first parameter name; stage 3: its unit's name
        self.renumber(index)

    def renumber(self, index: int) -> None:
        self.index = index
        self.text = f"bucket {index} ({self.first}...)"
        self.label = f"unit {self.unit!r} (bucket {index}: {self.first}...)" if self.unit else self.text  # waits
        self.grad_tag, self.replicate_tag = f"grad_bucket{index}", f"replicate_bucket{index}"  # the reductions
        self.unshard_tag, self.param_tag = f"unshard_bucket{index}", f"param_bucket{index}"  # the gathers
