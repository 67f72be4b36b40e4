"""What a ZeRO stage means for one bucket: the one place the stage number is interpreted.

============  ============  =================  ===================  ===============  ====================
stage         num_shards    reduce_scatters    frees_grads          shards_params    gathers_after_step
============  ============  =================  ===================  ===============  ====================
0             1             no (all-reduce)    no                   no               no
1             N             yes                no                   no               yes (N > 1)
2             N             yes                yes                  no               yes (N > 1)
3             N             yes                yes                  yes              no (per unit, on use)
============  ============  =================  ===================  ===============  ====================
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ShardSpec:
    stage: int
    world: int  # ranks of the shard group
    # what follows is derived from the two above once (plain attributes, read on every hook: no call per read)
    num_shards: int = field(init=False)  # pieces a bucket is split into (stage 0 keeps one: the whole buffer)
    reduce_scatters: bool = field(init=False)  # gradients reduce-scattered to their owners (stage 0: all-reduced)
    frees_grads: bool = field(init=False)  # the full gradient buffer is freed after its reduction (ZeRO-2/3)
    shards_params: bool = field(init=False)  # only the rank's shard of the parameters persists (ZeRO-3/FSDP)
    # full parameters on every rank, all-gathered after each step (ZeRO-1/2); a shard group of one rank owns the
    # whole buffer, so there is nothing to gather (the all-gather at world 1 was a copy onto itself plus a wait in
    # the next forward, 4% of the step in the speed benchmark at world 1)
    gathers_after_step: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ShardEngine handles ZeRO stages 0 to 3, got stage={self.stage}")
        derived = {"num_shards": 1 if self.stage == 0 else self.world, "reduce_scatters": self.stage >= 1,
                   "frees_grads": self.stage >= 2, "shards_params": self.stage == 3,
                   "gathers_after_step": self.stage in (1, 2) and self.world > 1}
        for name, value in derived.items():
            object.__setattr__(self, name, value)
