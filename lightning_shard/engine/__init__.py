"""Sharding engine: torch only (no Lightning, no Hydra). See docs/architecture.md, "Design rules" 1."""

from .buckets.flat import FlatLayout, flat_layout
from .comm.collectives import LEDGER
from .comm.ledger import Ledger, LedgerEntry, ring_wire_bytes
from .engine import ShardEngine
from .scaler import LossScaler
from .states import AccumulationPolicy, GradState

__all__ = ["LEDGER", "AccumulationPolicy", "FlatLayout", "GradState", "Ledger", "LedgerEntry", "LossScaler",
           "ShardEngine", "flat_layout", "ring_wire_bytes"]
