"""Models the project did not write, wrapped as LightningModules for parity runs with default knobs.

Each entry of :data:`MODELS` builds a network from a third-party library (torch's own modules, Lightning's demo,
Hugging Face transformers, peft, litgpt) or a pattern users bring (parameters never used, a branch used on some
steps only, routing that sends different ranks to different experts, a plain MLP without blocks). The
LightningModule around it only computes the loss and builds the optimizer over the trainable parameters.

Data: token sequences (or feature vectors), laid out by :class:`tests.zoo.RankMicroBatches` so that the global
micro-batches of a distributed run are those of a single-process reference with ``accumulate = acc x world``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.zoo import MICRO, RankMicroBatches

VOCAB, SEQ, D = 32, 8, 16


# ------------------------------------------------------------------------------------------ networks
class _EncoderLM(nn.Module):
    """torch's ``nn.TransformerEncoder`` (whose ``MultiheadAttention`` reads ``out_proj.weight`` itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.encoder(self.emb(x), mask=mask, is_causal=True))


class _AttentionOnly(nn.Module):
    """``nn.MultiheadAttention`` used directly, with separate key/value widths (q/k/v projection weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.kv = nn.Embedding(VOCAB, D // 2)
        self.attn = nn.MultiheadAttention(D, 2, kdim=D // 2, vdim=D // 2, batch_first=True)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, kv = self.emb(x), self.kv(x)
        out, _ = self.attn(q, kv, kv, need_weights=False)
        return self.head(out + q)


class _LSTMLM(nn.Module):
    """``nn.LSTM`` keeps its weights in ``_flat_weights``, read by its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.lstm = nn.LSTM(D, D, num_layers=2, batch_first=True)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(x))[0])


class _WeightNormConv(nn.Module):
    """Parametrized weights (``weight_norm``: the parameters live in ``parametrizations.weight``) and convs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(D, D, 3, padding=1))
        self.norm = nn.LayerNorm(D)
        self.head = nn.utils.parametrizations.weight_norm(nn.Linear(D, VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.emb(x).transpose(1, 2)).transpose(1, 2)
        return self.head(self.norm(torch.tanh(h)))


class _MLP(nn.Module):
    """No ``nn.ModuleList`` anywhere: FSDP-style auto wrapping has no blocks to find."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, D), nn.Flatten(), nn.Linear(SEQ * D, 3 * D), nn.GELU(),
                                 nn.Linear(3 * D, VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).unsqueeze(1).expand(-1, x.shape[1], -1)


class _Unused(nn.Module):
    """``never`` gets no gradient, ever; ``odd`` only on odd optimizer steps; ``frozen`` has requires_grad off."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.body = nn.Linear(D, D)
        self.odd = nn.Linear(D, D)
        self.never = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(D, VOCAB)
        self.step = 0  # set by the LightningModule before each forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.emb(x)))
        h = h + self.frozen(h)
        if self.step % 2 == 1:
            h = h + torch.tanh(self.odd(h))
        return self.head(h)


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _Routed(nn.Module):
    """Top-1 mixture of experts, one module per expert in an ``nn.ModuleList``; an expert runs only when tokens
    are routed to it, so ranks run different experts. Tokens below 8 go to expert 0/1 by their parity, the rest by
    the router: rank-dependent data (see :func:`_routed_data`) leaves experts idle on one rank and busy on another."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.router = nn.Linear(D, experts)
        self.experts = nn.ModuleList(_Expert() for _ in range(experts))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).reshape(-1, D)
        gate = torch.softmax(self.router(h), dim=-1)
        choice = gate.argmax(dim=-1)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            idx = (choice == i).nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            out.index_add_(0, idx, expert(h[idx]) * gate[idx, i:i + 1])
        return self.head(h + out).reshape(x.shape[0], x.shape[1], VOCAB)


class _AdapterBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.base = nn.Linear(D, D)
        self.down = nn.Linear(D, 2, bias=False)  # trainable low-rank adapter around a frozen base
        self.up = nn.Linear(2, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + torch.tanh(self.base(h) + self.up(self.down(h)))


class _Adapters(nn.Module):
    """The issue's 30-line LoRA: per block a frozen LayerNorm, a frozen Linear and a trainable low-rank adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(_AdapterBlock() for _ in range(3))
        self.head = nn.Linear(D, VOCAB)
        for p in [*self.emb.parameters(), *self.head.parameters()]:
            p.requires_grad_(False)
        for b in self.blocks:
            b.norm.requires_grad_(False)
            b.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * SEQ)
    return LlamaForCausalLM(cfg)  # RoPE, grouped-query attention, RMSNorm, untied head


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)  # lm_head.weight is transformer.wte.weight (tied)


def _hf_gpt2_wide() -> nn.Module:
    """GPT-2 wide enough (n_embd 512: 3.1M parameters per block; its largest layer, ``mlp.c_fc``, 4 MiB) that its
    buckets and units are large: with default knobs on gloo their parameter gathers run as broadcasts (1 MiB and
    up) and their per-step buffers are advised as huge pages (4 MiB and up), paths the tiny models of
    :data:`MODELS` never reach."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=512, n_layer=2, n_head=8, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _hf_gpt2_lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(_hf_gpt2(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"],
                                                 init_lora_weights="gaussian"))


def _hf_bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=2 * D, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertModel(cfg, add_pooling_layer=True)  # the pooler is never used by the token loss below


def _hf_switch() -> nn.Module:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    cfg = SwitchTransformersConfig(vocab_size=VOCAB, d_model=D, d_kv=8, d_ff=2 * D, num_layers=2,
                                   num_decoder_layers=2, num_heads=2, num_experts=4, expert_capacity=64,
                                   router_jitter_noise=0.0, dropout_rate=0.0, encoder_sparse_step=1,
                                   decoder_sparse_step=1, relative_attention_num_buckets=8,
                                   decoder_start_token_id=0, pad_token_id=0)
    return SwitchTransformersForConditionalGeneration(cfg)


def _hf_mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=1,
                        max_position_embeddings=2 * SEQ, router_jitter_noise=0.0)
    return MixtralForCausalLM(cfg)


def _litgpt() -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(Config(n_layer=2, n_embd=D, n_head=2, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=SEQ,
                      bias=True))


def _demo_transformer() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=VOCAB, ninp=D, nhead=2, nhid=2 * D, nlayers=1, dropout=0.0)


# ------------------------------------------------------------------------------------------ losses
def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _plain(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _lm_loss(net(x), y)


def _hf_causal(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _lm_loss(net(input_ids=x).logits, y)


def _hf_bert_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = net(input_ids=x).last_hidden_state  # pooler_output is computed but not in the loss
    return _lm_loss(h @ net.embeddings.word_embeddings.weight.t(), y)


def _hf_seq2seq(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return net(input_ids=x, labels=y).loss


def _demo_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(net(x, y), y.reshape(-1))


# name -> (builder, loss, what it exercises)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable, str]] = {
    "torch_encoder": (_EncoderLM, _plain, "nn.TransformerEncoder: MultiheadAttention reads out_proj.weight"),
    "torch_mha": (_AttentionOnly, _plain, "nn.MultiheadAttention with kdim/vdim: q/k/v projection weights"),
    "torch_lstm": (_LSTMLM, _plain, "nn.LSTM: flat weights read by its own forward"),
    "torch_weight_norm": (_WeightNormConv, _plain, "weight_norm parametrizations, Conv1d, LayerNorm"),
    "lightning_demo": (_demo_transformer, _demo_loss, "lightning.pytorch.demos.Transformer (nn.Transformer)"),
    "hf_gpt2": (_hf_gpt2, _hf_causal, "Hugging Face GPT-2, tied embedding and head"),
    "hf_gpt2_lora": (_hf_gpt2_lora, _hf_causal, "GPT-2 + peft LoRA on c_attn: frozen base inside every unit"),
    "hf_bert": (_hf_bert, _hf_bert_loss, "Hugging Face BERT: the pooler never gets a gradient"),
    "hf_llama": (_hf_llama, _hf_causal, "Hugging Face Llama: RoPE, grouped-query attention, RMSNorm"),
    "adapters": (_Adapters, _plain, "frozen LayerNorm + frozen Linear + trainable low-rank adapter per block"),
    "hf_switch": (_hf_switch, _hf_seq2seq, "Switch Transformers: one module per expert, run only if routed to"),
    "hf_mixtral": (_hf_mixtral, _hf_causal, "Mixtral: stacked expert weights, partly used per step"),
    "litgpt": (_litgpt, _plain, "litgpt's GPT"),
    "mlp": (_MLP, _plain, "an MLP with no nn.ModuleList of blocks"),
    "unused": (_Unused, _plain, "a parameter never used, a branch used on odd steps only, a frozen layer"),
    "routed": (_Routed, _plain, "top-1 MoE, experts in an nn.ModuleList, different experts per rank"),
}


# models too large for the whole matrix of test_foreign_models.py: run where a test names them
LARGE: dict[str, tuple[Callable[[], nn.Module], Callable, str]] = {
    "hf_gpt2_wide": (_hf_gpt2_wide, _hf_causal, "Hugging Face GPT-2 with 3.1M-parameter blocks (large buckets)"),
}


class ForeignModule(L.LightningModule):
    def __init__(self, name: str, optimizer: str = "sgd") -> None:
        super().__init__()
        builder, self._loss_fn, _ = {**MODELS, **LARGE}[name]
        torch.manual_seed(1234)
        self.net = builder()
        self.name, self.optimizer_name = name, optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if isinstance(self.net, _Unused):
            self.net.step = self.trainer.global_step
        return self._loss_fn(self.net, x, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(params, lr=0.01, eps=1e-6, weight_decay=0.01)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _routed_data(n: int, g: torch.Generator, acc: int, world: int) -> torch.Tensor:
    """Token sequences whose global micro-batch index decides the rank (see RankMicroBatches): micro-batches of
    even ranks hold tokens < VOCAB/2 only, odd ranks the rest, so the router sends ranks to different experts."""
    x = torch.empty(n, SEQ + 1, dtype=torch.long)
    for j in range(n // MICRO):
        lo, hi = (0, VOCAB // 2) if (j % world) % 2 == 0 else (VOCAB // 2, VOCAB)
        x[j * MICRO:(j + 1) * MICRO] = torch.randint(lo, hi, (MICRO, SEQ + 1), generator=g)
    return x


def dataset(name: str, steps: int, acc: int, world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    n = steps * acc * world * MICRO
    x = _routed_data(n, g, acc, world) if name == "routed" else torch.randint(1, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(x[:, :-1].contiguous(), x[:, 1:].contiguous())


def reference_state(name: str, steps: int, acc: int, world: int, optimizer: str = "sgd",
                    with_optimizer: bool = False) -> Any:
    """One process, plain Lightning, the same global batch per optimizer step: ``model.state_dict()`` after fit
    (and torch's ``optimizer.state_dict()`` with ``with_optimizer``)."""
    module = ForeignModule(name, optimizer)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=acc * world,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, DataLoader(dataset(name, steps, acc, world), batch_size=MICRO, shuffle=False))
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return (state, trainer.optimizers[0].state_dict()) if with_optimizer else state


class ModuleCalls(L.Callback):
    """Names of the modules matching ``pattern`` whose forward ran, per micro-batch (its index in the fit), on
    this rank."""

    def __init__(self, pattern: str) -> None:
        self.pattern, self.ran, self._handles, self._batch = pattern, {}, [], -1

    def on_train_batch_start(self, *args: Any) -> None:
        self._batch += 1
        self.ran[self._batch] = set()

    def on_train_start(self, trainer: Any, module: Any) -> None:
        import re

        for n, m in module.named_modules():
            if re.fullmatch(self.pattern, n):
                self._handles.append(m.register_forward_pre_hook(lambda mod, args, n=n: self.ran[self._batch].add(n)))

    def on_train_end(self, *args: Any) -> None:
        for h in self._handles:
            h.remove()


def fit_foreign(name: str, strategy: Any, steps: int, acc: int, optimizer: str = "sgd",
                strategy_kwargs: Optional[dict] = None, count_calls: Optional[str] = None,
                with_optimizer: bool = False, callbacks: Optional[list] = None) -> dict[str, Any]:
    """Inside a World rank: ``Trainer(strategy=<registry name>)`` with default knobs (or the class with
    ``strategy_kwargs``); returns rank 0's ``model.state_dict()`` after fit. ``count_calls``: a regex of module
    names whose forward calls are recorded per step (on every rank); ``with_optimizer``: also the optimizer state
    in torch's per-parameter format (``trainer.strategy.optimizer_state``, collective); ``callbacks``: more
    Lightning callbacks for the Trainer."""
    from lightning_shard.engine.comm import collectives as C
    from lightning_shard.engine.comm import hostmem

    world, rank = C.get_world_size(), C.get_rank()
    L.seed_everything(0, verbose=False)
    module = ForeignModule(name, optimizer)
    if strategy_kwargs is not None:
        from lightning.pytorch.strategies import StrategyRegistry

        from tests.scenarios import with_comm

        entry, kwargs = StrategyRegistry[strategy], dict(strategy_kwargs)
        comm = kwargs.pop("comm", None)  # how collectives run: set on the strategy, not an option
        strategy = with_comm(entry["strategy"](**dict(entry["init_params"], **kwargs)), comm)
    calls = ModuleCalls(count_calls) if count_calls else None
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                        accumulate_grad_batches=acc, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=([calls] if calls else []) + list(callbacks or []))
    data = dataset(name, steps, acc, world)
    loader = DataLoader(data, batch_sampler=RankMicroBatches(len(data), acc, world, rank))
    advise, advised = hostmem.advise, []

    def counting(t: torch.Tensor) -> bool:  # the engine's huge-page advice during fit: how many buffers took it
        ok = advise(t)
        advised.append(ok)
        return ok

    hostmem.advise = counting
    try:
        trainer.fit(module, loader)
    finally:
        hostmem.advise = advise
    engine = getattr(trainer.strategy, "engine", None)
    paths = [(b.layout.padded_numel * b.itemsize, b.gather.all_gather.name) for b in engine.buckets
             if b.trainable] if engine else []
    from tests.scenarios import full_optimizer_state

    opt_state = full_optimizer_state(trainer.strategy, trainer.optimizers[0]) if with_optimizer else None
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()} if rank == 0 else None,
            "policy": getattr(trainer.strategy, "accumulation_policy", None),
            "calls": calls.ran if calls else None, "optimizer": opt_state if rank == 0 else None,
            "gather_paths": sorted({path for _, path in paths}),
            "bucket_paths": paths,
            "advised": sum(advised), "not_advised": len(advised) - sum(advised)}


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise AssertionError(f"state_dict keys differ: only in run {sorted(set(a) - set(b))[:5]}, only in reference "
                             f"{sorted(set(b) - set(a))[:5]}")
    out = 0.0
    for k in a:
        if a[k].shape != b[k].shape:
            raise AssertionError(f"{k}: shape {tuple(a[k].shape)} vs reference {tuple(b[k].shape)}")
        if a[k].numel():
            out = max(out, float((a[k].double() - b[k].double()).abs().max()))
    return out


def is_nan(x: float) -> bool:
    return isinstance(x, float) and math.isnan(x)
