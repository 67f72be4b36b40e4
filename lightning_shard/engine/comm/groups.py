"""The process groups one engine communicates over (made by the strategy from its layout options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .collectives import Group


@dataclass
class Groups:
    shard: Group = None  # the ranks a bucket is sharded over; None: the world group
    replicate: Group = None  # hybrid sharding: the copies of this rank's shard on the other islands; None: none
    axes: Optional[dict[str, int]] = None  # the layout's sizes by name ("shard", "replicate"), for logs and checks
    gather: Group = None  # stages 1-3: a copy of the shard group for parameter all-gathers (None: the engine's own)
    island: Group = None  # stage 3 ``secondary_shard`` (hpZ): this rank's island, for the gathers after the first
