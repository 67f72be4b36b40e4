"""What a run shows the user (issue 12): Lightning's model summary counts the real parameters under zero3 /
fsdp_shard (not the empty shards), the progress bar counts optimizer steps against ``max_steps`` without
``v_num``, and ``gathered_params()`` after ``fit`` is a no-op on the whole module (it crashed inside the
library). World 2 on gloo, a model nobody on the project wrote (``nn.MultiheadAttention`` with kdim/vdim)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_shard.callbacks import StepProgressBar
from tests.foreign import ForeignModule, dataset
from tests.scenarios import RankMicroBatches


class _Capture:
    seen: list[dict[str, Any]] = []

    @staticmethod
    def record(summary_data: Any, total_parameters: int, trainable_parameters: int, *args: Any, **kw: Any) -> None:
        _Capture.seen.append({"data": dict(summary_data), "total": total_parameters,
                              "trainable": trainable_parameters})


class CapturingSummary(ModelSummary):
    summarize = staticmethod(_Capture.record)


class CapturingRichSummary(RichModelSummary):
    summarize = staticmethod(_Capture.record)


def fit_and_show(strategy: str, log_dir: str, rich: bool) -> dict[str, Any]:
    from lightning_shard.engine.comm import collectives as C

    world, rank = C.get_world_size(), C.get_rank()
    torch.set_num_threads(1)
    _Capture.seen.clear()
    module = ForeignModule("torch_mha")
    expected = {"total": sum(p.numel() for p in module.parameters()),
                "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad)}
    bar = StepProgressBar()
    steps, acc = 3, 2
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                        accumulate_grad_batches=acc, use_distributed_sampler=False,
                        logger=CSVLogger(log_dir), enable_checkpointing=False,
                        callbacks=[bar, CapturingRichSummary() if rich else CapturingSummary()])
    data = dataset("torch_mha", steps, acc, world)
    trainer.fit(module, DataLoader(data, batch_sampler=RankMicroBatches(len(data), acc, world, rank)))
    with trainer.strategy.gathered_params():  # after fit: the module is whole, nothing to gather
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    return {"summary": list(_Capture.seen), "expected": expected, "shapes": shapes,
            "full_shapes": {n: tuple(p.shape) for n, p in ForeignModule("torch_mha").named_parameters()},
            "metrics": bar.get_metrics(trainer, module), "total": bar.total_train_batches,
            "description": bar._get_train_description(trainer.current_epoch)}


@pytest.mark.parametrize("strategy,rich", [("zero3", True), ("fsdp_shard", False)])
def test_summary_counts_progress_shows_steps_and_gathered_params_after_fit(worlds, tmp_path, strategy, rich):
    results = worlds(2).run(fit_and_show, strategy, str(tmp_path), rich)
    r0 = results[0]
    assert len(r0["summary"]) == 1, "rank 0 prints one summary"
    s, e = r0["summary"][0], r0["expected"]
    assert (s["total"], s["trainable"]) == (e["total"], e["trainable"]) and e["total"] > 0
    held = s["data"]["Params per Device"]  # this rank's share, as Lightning's DeepSpeed summary shows it
    assert len(held) == len(s["data"]["Params"]) and held != s["data"]["Params"]
    for r in results:
        assert r["shapes"] == r["full_shapes"]
        assert "v_num" not in r["metrics"] and r["metrics"]["micro_batches"] == "6 (2/step)"
        assert r["total"] == 3 and r["description"].strip() == "steps"


def test_every_option_is_in_the_signature_and_documented_in_the_class_docstring():
    """``help(Zero2Strategy)`` showed only ``(**kwargs)``: every option a class accepts is now in its signature
    (keyword-only, with its default) and has a line of text in its docstring; a group's fields are listed under
    the group, indented."""
    import dataclasses
    import inspect

    from lightning_shard.strategies import (
        AutoStrategy,
        FSDPShardStrategy,
        Zero0Strategy,
        Zero1Strategy,
        Zero2Strategy,
        Zero3Strategy,
    )

    for cls in (Zero0Strategy, Zero1Strategy, Zero2Strategy, Zero3Strategy, FSDPShardStrategy, AutoStrategy):
        sig = inspect.signature(cls)
        assert not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()), cls
        options = set(cls.OPTIONS.names())
        assert options <= set(sig.parameters), (cls, options - set(sig.parameters))
        doc = inspect.getdoc(cls)
        lines = doc.splitlines()
        entries = []  # (the entry's line prefix, its text's indent)
        for f in dataclasses.fields(cls.OPTIONS):
            group = f.metadata.get("group")
            if group is None:
                entries.append((f"{f.name}=", "    "))
                continue
            assert f"{f.name}={group.__name__}(...): " in doc, f"{cls.__name__}: group {f.name} not in the docstring"
            entries += [(f"    {g.name}=", "        ") for g in dataclasses.fields(group)]
        for prefix, indent in entries:
            at = next((i for i, line in enumerate(lines) if line.startswith(prefix)), None)
            assert at is not None, f"{cls.__name__}: {prefix.strip()} not in the docstring"
            assert lines[at + 1].startswith(indent) and lines[at + 1].strip(), f"{cls.__name__}.{prefix}: no text"
        assert sig.parameters["accumulation"].default == "auto"
        assert cls().options.stage == {"Zero0Strategy": 0, "Zero1Strategy": 1}.get(
            cls.__name__, 2 if "Zero2" in cls.__name__ else 3)
