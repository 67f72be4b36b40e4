"""Single-process checks of the tiny recipe: corpus, GPT model, and a short fit that learns."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.utils.data import RandomSampler

from lightning_shard.callbacks import CommSummary
from lightning_shard.recipes.corpus import StdlibTextDataModule, WindowDataset, is_validation_file, load_stdlib_corpus
from lightning_shard.recipes.gpt import GPT, GPTLightningModule, warmup_cosine
from tests.optional import require

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def corpus():
    return load_stdlib_corpus(max_bytes=200_000, val_fraction=0.1)


# ------------------------------------------------------------------------------------ corpus
def test_corpus_is_deterministic(corpus):
    again = load_stdlib_corpus(max_bytes=200_000, val_fraction=0.1)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.val, again.val)
    assert corpus.train_files == again.train_files


def test_corpus_respects_the_byte_cap(corpus):
    assert corpus.train.dtype == torch.uint8
    assert corpus.train.numel() == 180_000 and corpus.val.numel() == 20_000
    assert list(corpus.train_files) == sorted(corpus.train_files)


def test_split_is_disjoint_and_by_hash(corpus):
    assert corpus.train_files and corpus.val_files
    assert not set(corpus.train_files) & set(corpus.val_files)
    assert all(is_validation_file(f, 0.1) for f in corpus.val_files)
    assert not any(is_validation_file(f, 0.1) for f in corpus.train_files)


@pytest.mark.parametrize("kwargs,match", [(dict(val_fraction=0.0), "val_fraction"),
                                          (dict(val_fraction=1.0), "val_fraction"),
                                          (dict(max_bytes=100), "max_bytes")])
def test_corpus_refuses_bad_knobs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_stdlib_corpus(**kwargs)


def test_windows_shift_by_one():
    tokens = torch.arange(100, dtype=torch.uint8)
    ds = WindowDataset(tokens, block_size=10)
    assert len(ds) == (100 - 11) // 10 + 1
    x, y = ds[3]
    assert x.dtype == torch.long and x.shape == (10,)
    assert torch.equal(x, torch.arange(30, 40)) and torch.equal(y, torch.arange(31, 41))
    x_last, y_last = ds[len(ds) - 1]
    assert int(y_last[-1]) <= 99
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="block_size \\+ 1 = 101"):
        WindowDataset(tokens, block_size=100)


def test_datamodule_leaves_the_sampler_to_lightning():
    dm = StdlibTextDataModule(block_size=32, micro_batch_size=4, max_bytes=50_000, max_val_windows=8)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, RandomSampler)  # Lightning swaps in a DistributedSampler
    x, y = next(iter(loader))
    assert x.shape == (4, 32) and y.shape == (4, 32)
    assert len(dm.val_set) == 8


# ------------------------------------------------------------------------------------ model
def test_gpt_forward_shapes():
    model = GPT(**TINY)
    logits = model(torch.randint(0, 256, (3, 17)))
    assert logits.shape == (3, 17, 256)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(0, 256, (1, 33)))
    with pytest.raises(ValueError, match="30 % 4 = 2"):
        GPT(n_embd=30, n_head=4)


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, b = model(idx), model(changed)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_tied_weights_are_really_tied():
    model = GPT(**TINY)
    assert model.lm_head.weight is model.wte.weight
    untied = GPT(**TINY, tie_weights=False)
    assert model.num_parameters() == untied.num_parameters() - 256 * 32
    # a step through the LightningModule's optimizer keeps them one tensor
    module = GPTLightningModule(**TINY, total_steps=10)
    opt = module.configure_optimizers()["optimizer"]
    loss = module._loss((torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))))
    loss.backward()
    opt.step()
    assert module.model.lm_head.weight.data_ptr() == module.model.wte.weight.data_ptr()


def test_param_groups_split_decay():
    module = GPTLightningModule(**TINY)
    decay, no_decay = module.param_groups()
    all_params = list(module.model.parameters())
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(all_params)
    assert all(p.dim() == 2 for p in decay["params"])
    assert any(p is module.model.wte.weight for p in no_decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"] if p is not module.model.wte.weight
               and p is not module.model.wpe.weight)
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(500, 10, 100, 0.1) == pytest.approx(0.1)


# ------------------------------------------------------------------------------------ short fit
def test_twenty_step_fit_lowers_the_loss():
    torch.set_num_threads(1)
    L.seed_everything(0)
    dm = StdlibTextDataModule(block_size=32, micro_batch_size=16, max_bytes=100_000, max_val_windows=32)
    module = GPTLightningModule(**TINY, lr=1e-2, warmup_steps=2)
    comm = CommSummary()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=20, accumulate_grad_batches=2,
                        limit_val_batches=2, val_check_interval=20, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[comm])
    trainer.fit(module, datamodule=dm)
    s = comm.summary(trainer)
    assert trainer.global_step == 20 and len(comm.step_losses) == 20
    assert s["first_train_loss"] == pytest.approx(math.log(256), abs=0.5)
    assert s["last_train_loss"] < s["first_train_loss"] - 1.0
    assert s["final_val_step"] == 20 and s["final_val_loss"] < s["first_train_loss"] - 1.0
    assert module.tokens_seen == 20 * 2 * 16 * 32 and s["tokens_per_s"] > 0
    assert s["memory"]["total"] > 0


# ------------------------------------------------------------------------------------ synthetic, LoRA, digits, HF
def test_synthetic_tokens_are_fixed_and_deterministic():
    from lightning_shard.recipes.synthetic import SyntheticTokens

    ds = SyntheticTokens(num_samples=10, block_size=8, vocab_size=50, seed=3)
    x, y = ds[4]
    assert x.shape == (8,) and torch.equal(x[1:], y[:-1]) and int(x.max()) < 50
    assert torch.equal(ds[4][0], SyntheticTokens(10, 8, 50, seed=3)[4][0])
    assert not torch.equal(ds[4][0], ds[5][0])


def test_peft_lora_starts_at_the_base_model_and_trains_only_adapters():
    require("peft", "hf")
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_shard.recipes.hf_causal_lm import apply_peft_lora

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)).eval()
    x = torch.randint(0, 64, (2, 8))
    before = model(x).logits
    wrapped, names = apply_peft_lora(model, targets="auto", r=2, alpha=4)
    assert names == ["base_model.model.transformer.h.0.attn.c_attn", "base_model.model.transformer.h.1.attn.c_attn"]
    assert torch.allclose(wrapped(x).logits, before)  # B = 0: the adapted model is the base model
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    with pytest.raises(ValueError, match="match no module"):
        apply_peft_lora(GPT2LMHeadModel(GPT2Config(vocab_size=8, n_embd=8, n_layer=1, n_head=1)), targets=["q_proj"])


def test_digits_split_is_stratified_and_deterministic():
    require("sklearn", "digits")
    from lightning_shard.recipes.digits import DigitsDataModule

    a, b = DigitsDataModule(micro_batch_size=16), DigitsDataModule(micro_batch_size=16)
    a.setup(), b.setup()
    assert len(a.train_set) + len(a.val_set) == 1797 and 340 < len(a.val_set) < 380
    assert torch.equal(a.val_set.tensors[1], b.val_set.tensors[1])
    assert torch.bincount(a.val_set.tensors[1]).min() >= 30  # every class in validation


def test_hf_tiny_llama_lora_fit_lowers_the_loss():
    require("transformers", "hf")
    from lightning_shard.recipes.hf_causal_lm import HFCausalLM, HFTextDataModule

    torch.set_num_threads(1)
    L.seed_everything(0)
    cfg = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    full = HFCausalLM(config=cfg)
    module = HFCausalLM(config=cfg, lora={"r": 4, "alpha": 8, "targets": "auto"}, lr=2e-2, warmup_steps=1)
    assert module.lora_modules and all(n.endswith(("q_proj", "v_proj")) for n in module.lora_modules)
    assert module.trainable_parameters() < full.trainable_parameters() / 4
    dm = HFTextDataModule(tokenizer=None, block_size=32, micro_batch_size=8, max_bytes=60_000, max_val_windows=8)
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    comm = CommSummary()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=15, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[comm])
    trainer.fit(module, datamodule=dm)
    params = dict(module.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen.items())  # the base never moves
    assert all(not torch.equal(params[n], v) for n, v in adapters.items() if ".lora_B." in n)
    assert comm.step_losses[-1] < comm.step_losses[0]
