"""Worker-side Fabric scenarios (run inside :class:`tests.harness.World` ranks): a plain Fabric loop with
accumulation, as litgpt's scripts write it, on the models and data of tests/zoo.py."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

from lightning_shard.engine.comm import collectives as C
from tests.zoo import VOCAB, RankMicroBatches, TinyLMModule, dataset


class TorchLM(nn.Module):
    """A model built only from torch's own modules (nn.TransformerEncoderLayer: MultiheadAttention inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(tokens)))


def uses_side(tokens: torch.Tensor) -> bool:
    """Whether :class:`BranchyLM` runs its side layer on this micro-batch (decided by the data alone)."""
    return int(tokens[0, 0]) % 3 == 0


class BranchyLM(nn.Module):
    """A side layer that only some micro-batches run: in a window one rank may use it and the other not, and a rank
    that used it in one window may not in the next (its gradient range must then count as zero, not as last
    window's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.side = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        if uses_side(tokens):
            h = h + torch.tanh(self.side(h))
        return self.head(h)


def _loss(model: Any, tokens: torch.Tensor, i: int = 0) -> torch.Tensor:
    if isinstance(getattr(model, "module", model), L.LightningModule):  # Fabric redirects it through forward
        return model.training_step((tokens,), i)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _optimizer(module: nn.Module, name: str) -> torch.optim.Optimizer:
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "lr": 0.05}]
    if name == "adam":
        return torch.optim.Adam(groups, lr=0.01, eps=1e-6)
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def _model(model: str) -> nn.Module:
    """``tiny_lm``: a LightningModule (its training_step in the loop); ``gpt``: the same GPT as a plain module;
    ``torch_lm``: torch's own layers; ``branchy``: a layer some micro-batches skip (:class:`BranchyLM`);
    ``stack``: layers whose ``reset_parameters`` is their whole init (deferred init draws the same values as a full
    one)."""
    if model == "torch_lm":
        return TorchLM()
    if model == "branchy":
        return BranchyLM()
    if model == "stack":
        return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, VOCAB))
    module = TinyLMModule()
    return module if model == "tiny_lm" else module.model


def reference(model: str, steps: int, acc: int, world: int, optimizer: str = "adam",
              clip: Optional[float] = None, bf16_autocast: bool = False,
              epoch_steps: Optional[int] = None,
              discard_first: bool = False, precision: str = "32-true") -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, plain torch: the same global batch per optimizer step (every rank's micro-batches);
    ``bf16_autocast``: forward and loss under CPU bf16 autocast, as Fabric's ``"bf16-mixed"``; ``epoch_steps``: the
    data holds that many steps and is run again each epoch (as a Trainer with a longer ``max_steps`` does);
    ``discard_first``: every rank's first micro-batch of every window is thrown away (``zero_grad(set_to_none=True)``
    after the backward of the last of them); ``precision``: ``"16-mixed"`` or ``"bf16-true"``, see
    :func:`half_reference`."""
    from contextlib import nullcontext

    if precision != "32-true":
        if bf16_autocast or epoch_steps or discard_first:
            raise ValueError("a half-precision reference takes only model, steps, acc, world, optimizer and clip")
        return half_reference(model, steps, acc, world, precision, optimizer, clip)
    L.seed_everything(0, verbose=False)
    net = _model(model)
    opt = _optimizer(net, optimizer)
    data = dataset(epoch_steps or steps, acc, world, "tiny_lm")
    loader = DataLoader(data, batch_size=4, shuffle=False)
    n, norms = acc * world, []
    batches = [b for _ in range(-(-steps // (epoch_steps or steps))) for b in loader][:steps * n]
    for i, (tokens,) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16_autocast else nullcontext():
            loss = _loss(net, tokens, i)
        (loss / n).backward()
        if discard_first and i % n == world - 1:  # every rank's first micro-batch: global ones 0 .. world-1
            net.zero_grad(set_to_none=True)
        if (i + 1) % n == 0:
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, norms


LOSS_SCALE = 2.0**16  # fp16: the loss scale a scaler starts at (torch's GradScaler and ours); no overflow here


def half_reference(model: str, steps: int, acc: int, world: int, precision: str, optimizer: str = "adam",
                   clip: Optional[float] = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, plain torch, in half precision as a user reads Fabric's promise, without the engine: forward and
    loss under Lightning's own plugin's ``forward_context()`` (``"16-mixed"``: CPU fp16 autocast; ``"bf16-true"``:
    bf16 default dtype), on the same global batch per step.

    * ``"16-mixed"``: fp32 weights; each micro-batch's loss / (acc x world) is scaled by :data:`LOSS_SCALE` before
      its backward (so that fp16 activation gradients do not underflow) and the summed gradients are unscaled before
      clipping and the step.
    * ``"bf16-true"``: the model created in bf16 (the plugin's ``module_init_context()``, as ``fabric.init_module()``
      does), its fp32 masters stepped by the optimizer; each rank's micro-batches run forward and backward on
      its own bf16 copy of the masters (``.to(bfloat16)``, round to nearest), the bf16 gradient accumulating in bf16
      over the rank's micro-batches (one autograd buffer); the ranks' gradients are cast to fp32, summed and divided by
      the world size. ``state_dict()``: the fp32 masters."""
    if precision not in ("16-mixed", "bf16-true"):
        raise ValueError(f"no half-precision reference for {precision!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: a half-precision kernel's rounding depends on its thread split
    try:
        return _half_reference(model, steps, acc, world, precision, optimizer, clip)
    finally:
        torch.set_num_threads(threads)


def _half_reference(model: str, steps: int, acc: int, world: int, precision: str, optimizer: str,
                    clip: Optional[float]) -> tuple[dict[str, torch.Tensor], list[float]]:
    import copy

    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu") if precision == "16-mixed" else HalfPrecision("bf16-true")
    L.seed_everything(0, verbose=False)
    if precision == "bf16-true":  # created in bf16 as under fabric.init_module(); the masters start from those values
        with plugin.module_init_context():
            net = _model(model)
        net = net.float()
    else:
        net = _model(model)
    opt = _optimizer(net, optimizer)
    data = dataset(steps, acc, world, "tiny_lm")
    batches = list(DataLoader(data, batch_size=4, shuffle=False))  # global micro-batch j: rank j % world
    n, norms = acc * world, []
    params = list(net.parameters())
    for step in range(steps):
        window = batches[step * n:(step + 1) * n]
        if precision == "16-mixed":
            for i, (tokens,) in enumerate(window):
                with plugin.forward_context():
                    loss = _loss(net, tokens, step * n + i)
                (loss / n * LOSS_SCALE).backward()
            for p in params:
                if p.grad is not None:
                    p.grad.div_(LOSS_SCALE)
        else:
            copies = [copy.deepcopy(net).to(torch.bfloat16) for _ in range(world)]
            for i, (tokens,) in enumerate(window):
                with plugin.forward_context():
                    loss = _loss(copies[i % world], tokens, step * n + i)
                (loss / acc).backward()
            for p, *half in zip(params, *(c.parameters() for c in copies)):
                grads = [h.grad.float() for h in half if h.grad is not None]
                p.grad = sum(grads) / world if grads else None
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, norms


def fabric_fit(strategy: Any, acc: int, steps: int, model: str = "tiny_lm", optimizer: str = "adam",
               clip: Optional[float] = None, precision: str = "32-true", knobs: Optional[dict] = None,
               save_to: Optional[str] = None, save_step: Optional[int] = None, load_from: Optional[str] = None,
               first_step: int = 0, empty_init: bool = False, separate_setup: bool = False,
               compile_backend: Optional[str] = None, compile_whole: bool = False,
               compile_wrapped: bool = False, discard_first: bool = False) -> dict[str, Any]:
    """Train ``steps`` optimizer steps with ``acc`` micro-batches each in a Fabric loop; ``save_to`` after
    ``save_step`` steps (``fabric.save``), ``load_from`` before the first (``fabric.load``). Returns the weights as
    a user saves them (``model.state_dict()``), the ledger's (op, tag) per micro-batch and what load returned."""
    world, rank = C.get_world_size(), C.get_rank()
    if knobs:  # a strategy name with knobs: the class registered under that name, with the knobs
        from lightning_shard.strategies import FABRIC_CLASSES

        strategy = FABRIC_CLASSES[strategy](**knobs)
    if precision == "16-mixed":  # the string falls back to bf16-mixed on CPU (Fabric's connector); the plugin itself
        from lightning.fabric.plugins.precision import MixedPrecision  # runs fp16 autocast there

        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, plugins=MixedPrecision("16-mixed", "cpu"))
    else:
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=precision)
    fabric.launch()
    L.seed_everything(0, verbose=False)
    with fabric.init_module(empty_init=empty_init):
        net = _model(model)
    opt = _optimizer(net, optimizer)
    if compile_backend:  # each transformer block (or the whole GPT) compiled in place: names, checkpoints unchanged
        import torch._dynamo

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        gpt = net.model if isinstance(net, TinyLMModule) else net
        if compile_wrapped:  # torch.compile's OptimizedModule in place of each block (names gain "_orig_mod.")
            for i, block in enumerate(gpt.blocks):
                gpt.blocks[i] = torch.compile(block, backend=compile_backend)
        blocks = [net.enc] if isinstance(net, TorchLM) else gpt.blocks  # torch's TransformerEncoderLayer
        for m in [] if compile_wrapped else [gpt] if compile_whole else blocks:
            m.compile(backend=compile_backend)
    if separate_setup:
        net = fabric.setup_module(net)
        opt = fabric.setup_optimizers(opt)
    else:
        net, opt = fabric.setup(net, opt)
    initial = {k: v.detach().clone() for k, v in net.state_dict().items()}
    loaded = None
    if load_from:
        loaded = fabric.load(load_from, {"model": net, "optimizer": opt})
    data = dataset(first_step + steps, acc, world, "tiny_lm")
    loader = DataLoader(data, batch_sampler=RankMicroBatches(len(data), acc, world, rank, first_step))
    per_batch: list[list[tuple[str, str]]] = []
    norms: list[float] = []
    for i, (tokens,) in enumerate(loader):
        mark = C.LEDGER.mark()
        boundary = (i + 1) % acc == 0
        with fabric.no_backward_sync(net, enabled=not boundary):
            fabric.backward(_loss(net, tokens, i) / acc)
        if discard_first and i % acc == 0:  # the user drops this micro-batch's gradients (``net.zero_grad``)
            net.zero_grad(set_to_none=True)
        if boundary:
            if clip is not None:
                norms.append(float(fabric.clip_gradients(net, opt, max_norm=clip)))
            opt.step()
            opt.zero_grad()
        per_batch.append([(e.op, e.tag, e.wire_bytes) for e in C.LEDGER.since(mark)])
        if save_to and boundary and (i + 1) // acc == save_step:
            fabric.save(save_to, {"model": net, "optimizer": opt, "step": save_step})
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    strategy_obj = fabric.strategy
    out = {"state": state, "initial": initial, "per_batch": per_batch, "norms": norms, "loaded": loaded,
           "policy": getattr(strategy_obj, "accumulation_policy", None), "class": type(strategy_obj).__name__,
           "param_dtype": str(next(net.parameters()).dtype)}
    if compile_backend:
        import torch._dynamo

        out["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        out["break_reasons"] = sorted(torch._dynamo.utils.counters["graph_break"])[:5]
        out["frames"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    strategy_obj.teardown()
    return out


def two_setups() -> None:
    """setup_optimizers twice: the second is refused (the engine is built for the optimizers it was given)."""
    fabric = Fabric(accelerator="cpu", devices=C.get_world_size(), strategy="zero2")
    fabric.launch()
    net = fabric.setup_module(_model("gpt"))
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    fabric.setup_optimizers(torch.optim.SGD(decay, lr=0.1))
    try:
        fabric.setup_optimizers(torch.optim.SGD(rest, lr=0.1))
    finally:
        fabric.strategy.teardown()


def double_backward(strategy: str) -> dict[str, Any]:
    """Two backwards without no_backward_sync, then one step (torch's contract: the step applies the sum of both,
    averaged over ranks, as DDP's linear all-reduces give): the weights after the step, and the gradient reductions
    the ledger saw."""
    fabric = Fabric(accelerator="cpu", devices=C.get_world_size(), strategy=strategy)
    fabric.launch()
    L.seed_everything(0, verbose=False)
    net = _model("gpt")
    net, opt = fabric.setup(net, _optimizer(net, "sgd"))
    data = dataset(1, 2, C.get_world_size(), "tiny_lm").tensors[0]
    mark = C.LEDGER.mark()
    try:
        for k in range(2):
            fabric.backward(_loss(net, data[k * 8 + C.get_rank() * 4:][:4]))
        opt.step()
        state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    finally:
        if strategy != "ddp":
            fabric.strategy.teardown()
    return {"state": state, "reductions": sum(e.tag.startswith("grad_bucket") for e in C.LEDGER.since(mark))}


def shard_alias_probe(strategy: str, model: str = "torch_lm") -> dict[str, Any]:
    """World 1, stage 3: two forwards and backwards, recording inside every forward whether each parameter the
    module computes with is a view of its bucket's persistent shard (no gathered copy), and the engine's ledger of
    gathered bytes after a forward."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    L.seed_everything(0, verbose=False)
    net = _model(model)
    opt = _optimizer(net, "adam")
    net, opt = fabric.setup(net, opt)
    engine = fabric.strategy.engine
    shards = {b.store.shard.untyped_storage().data_ptr() for b in engine.buckets}
    seen: list[bool] = []

    def probe(module: nn.Module, _args: Any) -> None:
        for p in module.parameters(recurse=False):
            seen.append(p.numel() > 0 and p.untyped_storage().data_ptr() in shards)

    hooks = [m.register_forward_pre_hook(probe) for m in net.modules()
             if next(m.parameters(recurse=False), None) is not None]
    tokens = dataset(1, 1, 1, "tiny_lm").tensors[0][:4]
    for _ in range(2):
        loss = _loss(net, tokens)
        gathered = engine.memory_report().get("gathered_params")
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    for h in hooks:
        h.remove()
    fabric.strategy.teardown()
    return {"seen": seen, "gathered": gathered}
