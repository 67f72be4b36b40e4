"""Model zoo and data for parity tests against a single-process Lightning reference.

:class:`ZooModule` covers, in one small model: a parameter count not divisible by the world size, tied
weights (embedding = output head), a frozen submodule, a parameter unused on odd optimizer steps, BatchNorm
buffers and two param groups with different hyperparameters. SGD with momentum keeps the update linear in
the gradient, so fp32 parity is tight ("Design rules" 8).

Data layout: a reference run with micro-batch ``m`` and ``accumulate_grad_batches = acc * world`` sees the
global micro-batches of each step in order; rank ``r`` of a distributed run with ``acc`` micro-batches per
step sees micro-batches ``k * world + r``. Every distributed micro-batch is therefore one reference micro-
batch (same BatchNorm statistics), and the sum of gradients per step is the same.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

VOCAB, FEAT, HID, EMB = 11, 7, 13, 6
MICRO = 4


class ZooNet(nn.Module):
    def __init__(self, bn: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(FEAT, HID)  # 104 parameters: not divisible by 3, 8, ...
        self.bn = nn.BatchNorm1d(HID) if bn else nn.Identity()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.head = nn.Linear(EMB, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: embedding = output head
        self.lin2 = nn.Linear(HID + EMB, EMB)
        self.frozen = nn.Linear(EMB, EMB)
        self.frozen.requires_grad_(False)
        self.extra = nn.Linear(EMB, EMB)  # used only on even optimizer steps

    def forward(self, x: torch.Tensor, tok: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.bn(torch.tanh(self.lin1(x)))
        z = self.lin2(torch.cat([h, self.emb(tok)], dim=-1))
        z = z + self.frozen(z)
        if use_extra:
            z = z + self.extra(torch.tanh(z))
        return self.head(z)


class ZooModule(L.LightningModule):
    def __init__(self, optimizer: str = "sgd", bn: bool = True, manual: bool = False, acc: int = 1,
                 unused: bool = True, **_: Any) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.net = ZooNet(bn)
        self.optimizer_name = optimizer
        self.grad_norms: list[float] = []
        self.automatic_optimization = not manual
        self.acc = acc  # used by manual optimization only
        self.unused = unused  # skip self.net.extra on odd optimizer steps

    def _loss(self, batch: Any) -> torch.Tensor:
        x, tok, y = batch
        logits = self.net(x, tok, use_extra=not self.unused or self.trainer.global_step % 2 == 0)
        return F.cross_entropy(logits, y)

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        if self.automatic_optimization:
            return self._loss(batch)
        opt = self.optimizers()
        boundary = (batch_idx + 1) % self.acc == 0
        with opt.toggle_model(sync_grad=boundary):
            self.manual_backward(self._loss(batch) / self.acc)
        if boundary:
            opt.step()
            opt.zero_grad()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        lin2 = list(self.net.lin2.parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in lin2)]
        groups = [{"params": rest}, {"params": lin2, "lr": 0.2, "weight_decay": 0.01}]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(groups, lr=0.01, eps=1e-6)
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is None and gradient_clip_val and gradient_clip_algorithm != "value":  # reference: global norm
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if engine is not None and gradient_clip_val:
            self.grad_norms.append(engine.last_grad_norm)


class TinyLMModule(L.LightningModule):
    """A 2-block GPT (recipes/gpt.py) whose ``Block``s are the FSDP wrap units; tied embedding and head."""

    SEQ = 8

    def __init__(self, optimizer: str = "sgd", activation_checkpointing: bool = False, **_: Any) -> None:
        super().__init__()
        from lightning_shard.recipes.gpt import GPT

        torch.manual_seed(1234)
        self.model = GPT(vocab_size=VOCAB, block_size=self.SEQ, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
        if activation_checkpointing:  # non-reentrant checkpoint inside each block: recomputed in backward
            from functools import partial

            from torch.utils.checkpoint import checkpoint

            for block in self.model.blocks:
                block.forward = partial(checkpoint, block.forward, use_reentrant=False)
        self.optimizer_name = optimizer
        self.grad_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "lr": 0.05}]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(groups, lr=0.01, eps=1e-6)
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)

    configure_gradient_clipping = ZooModule.configure_gradient_clipping


def make_module(model: str = "zoo", **kwargs: Any) -> L.LightningModule:
    return TinyLMModule(**kwargs) if model == "tiny_lm" else ZooModule(**kwargs)


def dataset(steps: int, acc: int, world: int, model: str = "zoo") -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    n = steps * acc * world * MICRO
    if model == "tiny_lm":
        return TensorDataset(torch.randint(0, VOCAB, (n, TinyLMModule.SEQ + 1), generator=g))
    return TensorDataset(torch.randn(n, FEAT, generator=g), torch.randint(0, VOCAB, (n,), generator=g),
                         torch.randint(0, VOCAB, (n,), generator=g))


class RankMicroBatches(Sampler):
    """Rank ``rank`` gets global micro-batches ``step*acc*world + k*world + rank`` (see module docstring)."""

    def __init__(self, n: int, acc: int, world: int, rank: int, first_step: int = 0) -> None:
        self.n, self.acc, self.world, self.rank, self.first_step = n, acc, world, rank, first_step

    def __iter__(self):
        per_step = self.acc * self.world
        for step in range(self.first_step, self.n // (MICRO * per_step)):
            for k in range(self.acc):
                j = step * per_step + k * self.world + self.rank
                yield list(range(j * MICRO, (j + 1) * MICRO))

    def __len__(self) -> int:
        return (self.n // (MICRO * self.acc * self.world) - self.first_step) * self.acc


def reference_fit(steps: int, acc: int, world: int, optimizer: str = "sgd", clip: Optional[float] = None,
                  precision: str = "32-true", bn: bool = True, unused: bool = True, model: str = "zoo",
                  clip_algorithm: str = "norm") -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single process, same global batch per optimizer step."""
    module = make_module(model, optimizer=optimizer, bn=bn, unused=unused)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=acc * world,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=clip, precision=precision,
                        gradient_clip_algorithm=clip_algorithm)
    trainer.fit(module, DataLoader(dataset(steps, acc, world, model), batch_size=MICRO, shuffle=False))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, module.grad_norms


def params_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "running" not in k and "num_batches" not in k}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
