"""``ckpt_path=last`` with Lightning's meaning: the newest complete ``checkpoints/last.ckpt`` of this job's run folder
(a restart or a requeue) or of an earlier run of the same combination (the sibling folders), or, with none, a warning
and a fresh start. A checkpoint that was being written when its rank died is never chosen."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from lightning_shard.app.preflight import _compose
from lightning_shard.app.resume import last_checkpoint, resolve_ckpt_path
from lightning_shard.checkpoint.format import META


def _sharded(run: Path, mtime: float, complete: bool = True) -> Path:
    ckpt = run / "checkpoints" / "last.ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "rank00000.pt").write_bytes(b"")
    if complete:
        (ckpt / META).write_text("{}")
        os.utime(ckpt / META, (mtime, mtime))
    return ckpt


def test_the_newest_complete_checkpoint_wins_this_runs_own_included(tmp_path):
    here = tmp_path / "slurm-42"
    assert last_checkpoint(here) is None
    older = _sharded(tmp_path / "2026-12-01_10-00-00", 1_000)
    assert last_checkpoint(here) == older
    own = _sharded(here, 2_000)  # a restart of this job: its own folder, although its name sorts first
    assert last_checkpoint(here) == own
    _sharded(tmp_path / "2026-12-02_10-00-00", 3_000, complete=False)  # its ranks died while saving: no meta.json
    assert last_checkpoint(here) == own
    (tmp_path / "2026-12-03_10-00-00" / "checkpoints" / ".tmp-last.ckpt-1").mkdir(parents=True)
    assert last_checkpoint(here) == own
    newest_file = tmp_path / "2026-12-04_10-00-00" / "checkpoints" / "last.ckpt"  # state_dict_type=full
    newest_file.parent.mkdir(parents=True)
    newest_file.write_bytes(b"x")
    os.utime(newest_file, (4_000, 4_000))
    assert last_checkpoint(here) == newest_file


def test_last_without_a_checkpoint_warns_and_starts_fresh(tmp_path):
    cfg = _compose(["ckpt_path=last", f"hydra.run.dir={tmp_path / 'run'}"])  # as the preflight composes it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_ckpt_path(cfg) is None
    assert any("starting from scratch" in str(w.message) for w in caught)
    own = _sharded(tmp_path / "run", 1_000)
    assert resolve_ckpt_path(cfg) == str(own)
