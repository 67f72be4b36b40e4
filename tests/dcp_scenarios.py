"""Worker-side scenarios for torch.distributed.checkpoint interop: the same LightningModule (tests/zoo.py's
TinyLMModule) trained by torch FSDP2 through Lightning's ModelParallelStrategy, saving and resuming DCP
checkpoints, so that they can be exchanged with our strategies."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from tests.scenarios import ResumePoint
from tests.zoo import RankMicroBatches, TinyLMModule, dataset


class FSDP2TinyLM(TinyLMModule):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def fit_fsdp2(steps: int, acc: int, data_steps: Optional[int] = None, ckpt_dir: Optional[str] = None,
              resume_from: Optional[str] = None) -> dict[str, Any]:
    """``ckpt_dir``: ModelCheckpoint every 3 optimizer steps (DCP directories, mid-epoch)."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    L.seed_everything(0, verbose=False)
    module = FSDP2TinyLM(optimizer="adam")
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo",
                                     save_distributed_checkpoint=True)
    point = ResumePoint()
    callbacks: list[L.Callback] = [point]
    if ckpt_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                        accumulate_grad_batches=acc, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    data = dataset(data_steps or steps, acc, world, "tiny_lm")
    trainer.fit(module, DataLoader(data, batch_sampler=RankMicroBatches(len(data), acc, world, rank)),
                ckpt_path=resume_from)
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {"state": {k: v.detach().clone() for k, v in full.items()}, "global_step": trainer.global_step,
            "first": point.first, "steps_taken": point.steps_taken}



def as_fsdp1_folder(ours: str, out: str) -> None:
    """Rewrite one of our DCP folders in the layout Lightning's ``FSDPStrategy(state_dict_type="sharded")``
    writes (torch FSDP1 refuses a CPU-only machine, so it cannot write one here): its ``save_checkpoint`` passes
    ``{"model": state_dict, "optimizer_0": FQN-keyed optimizer state}`` to Lightning's own
    ``_distributed_checkpoint_save`` and puts the rest in ``meta.pt``, as done here with the same function."""
    import shutil
    from pathlib import Path

    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat_path = Path(out).with_suffix(".flat.pt")
    dcp_to_torch_save(ours, flat_path)
    flat = torch.load(flat_path, weights_only=False)
    model = {k[len("state_dict."):]: v for k, v in flat.items() if k.startswith("state_dict.")}
    state: dict = {}
    groups: dict = {}
    for k, v in flat.items():
        if k.startswith("optimizer_0.state."):
            name, key = k[len("optimizer_0.state."):].rsplit(".", 1)
            state.setdefault(name, {})[key] = v
        elif k.startswith("optimizer_0.param_groups."):
            g, key = k[len("optimizer_0.param_groups."):].split(".", 1)
            groups.setdefault(int(g), {})[key] = v
    Path(out).mkdir(parents=True)
    _distributed_checkpoint_save({"model": model, "optimizer_0": {"state": state, "param_groups":
                                  [groups[g] for g in sorted(groups)]}}, Path(out))
    shutil.copy(Path(ours) / "meta.pt", Path(out) / "meta.pt")
