"""Dynamic loss scaling for fp16 whose skip/grow decision is taken once for all ranks.

The engine's :meth:`~lightning_shard.engine.engine.ShardEngine.unscale_and_check` all-reduces the found-inf
flag, so every rank skips (and backs off) or steps (and maybe grows) together: no rank updates alone.
The schedule follows ``torch.amp.GradScaler``'s documented defaults (init 2**16, x0.5 back-off, x2 growth
every 2000 clean steps).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    _good_steps: int = 0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1 and self.growth_interval > 0):
            raise ValueError("LossScaler needs scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                             "growth_interval > 0")

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self._good_steps = 0
            self.skipped_steps += 1
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self._good_steps = int(sd.get("good_steps", 0))
        self.skipped_steps = int(sd.get("skipped_steps", 0))
