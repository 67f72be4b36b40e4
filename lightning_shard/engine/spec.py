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

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShardSpec:
    stage: int
    world: int  # ranks of the shard group

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ShardEngine handles ZeRO stages 0 to 3, got stage={self.stage}")

    @property
    def num_shards(self) -> int:
        """Pieces a bucket is split into (stage 0 keeps one "shard": the whole buffer, on every rank)."""
        return 1 if self.stage == 0 else self.world

    @property
    def reduce_scatters(self) -> bool:
        """Gradients are reduce-scattered to their owners (stage 0: all-reduced to every rank)."""
        return self.stage >= 1

    @property
    def frees_grads(self) -> bool:
        """The full gradient buffer is freed after its reduction (ZeRO-2/3)."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        """Only the rank's shard of the parameters persists; units gather them when used (ZeRO-3/FSDP)."""
        return self.stage == 3

    @property
    def gathers_after_step(self) -> bool:
        """Full parameters live on every rank and are all-gathered after each step (ZeRO-1/2); a shard group of one
        rank owns the whole buffer, so there is nothing to gather (the all-gather at world 1 was a copy onto
        itself plus a wait in the next forward, 4% of the step: bench/results/speed_world1.md)."""
        return self.stage in (1, 2) and self.world > 1
