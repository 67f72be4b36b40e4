"""Hugging Face causal-LM fine-tune: full fine-tune or LoRA on a frozen base (``transformers`` optional extra).

``HFCausalLM(name_or_path=...)`` loads a local directory or a hub id with ``AutoModelForCausalLM``;
``HFCausalLM(config={"model_type": "llama", ...})`` builds a random-init model from a config dict when no
``name_or_path`` is given (offline; used by the tests). ``lora={"r": 8, "alpha": 16, "targets": "auto"}`` freezes the
base and trains only LoRA adapters made by peft (``LoraConfig`` + ``get_peft_model``; further keys of ``lora`` are
``LoraConfig``'s own, e.g. ``bias``); ``lora=None`` trains every parameter. ``lightning-shard consolidate CKPT OUT
--hf`` turns a checkpoint of this recipe into a ``save_pretrained`` folder (adapters merged, or ``--hf-adapter``: peft's
adapter folder); see :mod:`lightning_shard.recipes.hf_export`.

Data: the standard library's sources (``recipes/corpus.py``), tokenized by the model's tokenizer
(``HFTextDataModule(tokenizer=<name_or_path>)``) or read as bytes when ``tokenizer`` is None (then the model's
vocabulary must be >= 256).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from lightning_shard.recipes.corpus import StdlibTextDataModule, WindowDataset, load_stdlib_corpus
from lightning_shard.recipes.gpt import warmup_cosine
from lightning_shard.recipes.lm_steps import CausalLMSteps


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("the hf_causal_lm recipe needs transformers: pip install 'lightning-shard[hf]'") from err
    return transformers


# what targets="auto" adapts: the attention projections of the common families (Llama/Mistral q_proj and v_proj,
# GPT-2's fused c_attn, GPT-NeoX/Falcon's query_key_value, MPT's Wqkv)
AUTO_TARGETS = ("q_proj", "v_proj", "c_attn", "query_key_value", "Wqkv")


def apply_peft_lora(model: torch.nn.Module, targets: Any = "auto", r: int = 8, alpha: float = 16.0,
                    dropout: float = 0.0, **options: Any) -> tuple[torch.nn.Module, list[str]]:
    """``model`` wrapped by peft's LoRA (base frozen, adapters trainable) and the names of the adapted modules.
    ``targets="auto"``: those of :data:`AUTO_TARGETS` the model has (q_proj/v_proj, GPT-2's c_attn...)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("LoRA in the hf_causal_lm recipe needs peft: pip install 'lightning-shard[hf]'") from err
    linear = {n.rsplit(".", 1)[-1]: type(m).__name__ for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"}
    chosen = [t for t in AUTO_TARGETS if t in linear] if targets == "auto" else list(targets)
    if not chosen or not any(t in linear for t in chosen):
        raise ValueError(f"LoRA targets {list(AUTO_TARGETS) if targets == 'auto' else chosen} match no module; linear "
                         f"layers here are named {sorted(linear)}: set recipe.model.lora.targets to some of them")
    conv1d = any(linear.get(t) == "Conv1D" for t in chosen)  # GPT-2 stores (in, out): peft must know
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=chosen, fan_in_fan_out=conv1d,
                     **options)
    wrapped = get_peft_model(model, cfg)
    from peft.tuners.lora import LoraLayer

    names = [n for n, m in wrapped.named_modules() if isinstance(m, LoraLayer)]
    return wrapped, names


def build_causal_lm(name_or_path: Optional[str], config: Optional[Mapping[str, Any]], dtype: Optional[str] = None,
                    trust_remote_code: bool = False) -> torch.nn.Module:
    if name_or_path is None and config is None:
        raise ValueError("give recipe.model.name_or_path (local directory or hub id) or recipe.model.config "
                         "(a dict with model_type, for a random-init model)")
    tf = _transformers()
    torch_dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if name_or_path is not None:
        kwargs = {"trust_remote_code": trust_remote_code}
        if torch_dtype is not None:
            kwargs["dtype"] = torch_dtype
        return tf.AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ValueError("recipe.model.config needs model_type (e.g. llama, gpt2)")
    model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(model_type, **cfg))
    return model.to(torch_dtype) if torch_dtype is not None else model


class HFCausalLM(CausalLMSteps, pl.LightningModule):
    def __init__(self, name_or_path: Optional[str] = None, config: Optional[dict] = None,
                 lora: Optional[dict] = None, lr: float = 2e-5, weight_decay: float = 0.0,
                 betas: Sequence[float] = (0.9, 0.95), eps: float = 1e-8, warmup_steps: int = 10,
                 min_lr_ratio: float = 0.1, total_steps: Optional[int] = None, dtype: Optional[str] = None,
                 trust_remote_code: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_causal_lm(name_or_path, config, dtype, trust_remote_code)
        self.lora_modules: list[str] = []
        if lora:
            self.model, self.lora_modules = apply_peft_lora(self.model, **dict(lora))
        self.val_loss_mean = MeanMetric()
        self.tokens_seen = 0
        self.last_train_loss: Optional[torch.Tensor] = None

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, weight_decay=hp.weight_decay)
        total = hp.total_steps or (self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0
                                   else int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine(step, hp.warmup_steps, total, hp.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


class HFTextDataModule(StdlibTextDataModule):
    """The stdlib corpus, tokenized with ``tokenizer`` (a local directory or hub id) or as raw bytes (None)."""

    def __init__(self, tokenizer: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tokenizer = tokenizer

    def setup(self, stage: Optional[str] = None) -> None:
        if self.tokenizer is None:
            return super().setup(stage)
        if self.corpus is not None:
            return
        tok = _transformers().AutoTokenizer.from_pretrained(self.tokenizer)
        self.corpus = load_stdlib_corpus(self.max_bytes, self.val_fraction)

        def ids(stream: torch.Tensor) -> torch.Tensor:
            text = bytes(stream.tolist()).decode("utf-8", errors="ignore")
            return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

        self.train_set = WindowDataset(ids(self.corpus.train), self.block_size)
        val = WindowDataset(ids(self.corpus.val), self.block_size)
        if self.max_val_windows is not None and len(val) > self.max_val_windows:
            step = len(val) / self.max_val_windows
            val = torch.utils.data.Subset(val, [int(i * step) for i in range(self.max_val_windows)])
        self.val_set = val
