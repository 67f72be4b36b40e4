"""A training DataLoader that resumes mid-epoch where the checkpoint left off.

Lightning restores the loops' counters from a checkpoint but restarts the epoch's data from its first batch
unless the loader is resumable, so a run resumed from ``last.ckpt`` saved mid-epoch would train on the epoch's
first batches twice. The DataModule (:class:`ResumableData`) saves how many micro-batches of the current epoch
were processed; after a resume its :class:`ResumableLoader` skips that many, and the epoch's shuffle is the
same one (Lightning's ``DistributedSampler`` is seeded by the global seed and the restored epoch), so the
resumed run sees the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader


class ResumableLoader(DataLoader):
    """``DataLoader`` whose first iteration skips ``skip_batches`` batches (the rest of an interrupted epoch)."""

    def __init__(self, *args: Any, skip_batches: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip_batches = skip_batches

    def __iter__(self) -> Any:
        it = super().__iter__()
        skip, self.skip_batches = self.skip_batches, 0
        if skip >= len(self):  # saved at the end of an epoch: the next one starts whole
            skip = 0
        for _ in range(skip):
            next(it)
        return it

    # Lightning asks the loader whether it is resumable (it warns otherwise); the position itself is kept by the
    # DataModule, which knows the loop's counters.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class ResumableData:
    """Mixin for a ``LightningDataModule``: checkpoints the micro-batches processed in the current epoch and
    hands them to :meth:`train_loader` after a resume."""

    _skip_batches = 0

    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return {}
        return {"epoch_batches": trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._skip_batches = int(state_dict.get("epoch_batches", 0))

    def train_loader(self, *args: Any, **kwargs: Any) -> ResumableLoader:
        skip, self._skip_batches = self._skip_batches, 0
        return ResumableLoader(*args, skip_batches=skip, **kwargs)
