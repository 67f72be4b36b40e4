"""The hf_causal_lm recipe with peft LoRA trained under zero3 on 2 ranks, its sharded checkpoint exported with
``lightning-shard consolidate --hf`` / ``--hf-adapter``, and loaded back with Hugging Face's and peft's own loaders:
the same logits as the trained model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.optional import require

require("transformers", "hf")
require("peft", "hf")

CFG = dict(model_type="gpt2", vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2)
LORA = {"r": 4, "alpha": 8, "targets": "auto"}


def _inputs() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


def train_and_save(ckpt_dir: str, lora: Any, strategy: str) -> dict[str, Any]:
    """A few steps of the recipe; ModelCheckpoint writes the sharded directory during fit; returns the trained
    model's logits on fixed inputs (after fit the module holds full weights on every rank)."""
    from lightning_shard.recipes.hf_causal_lm import HFCausalLM, HFTextDataModule

    L.seed_everything(0, verbose=False)
    module = HFCausalLM(config=CFG, lora=lora, lr=2e-2, warmup_steps=1)
    dm = HFTextDataModule(tokenizer=None, block_size=16, micro_batch_size=4, max_bytes=20_000, max_val_windows=2)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="last", every_n_train_steps=3,
                                               save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=torch.distributed.get_world_size(), strategy=strategy,
                        max_steps=3, limit_val_batches=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ckpt])
    trainer.fit(module, datamodule=dm)
    module.eval()
    with torch.no_grad():
        logits = module.model(input_ids=_inputs()).logits
    return {"logits": logits, "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad)}


@pytest.fixture(scope="module")
def trained(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for tag, lora in (("lora", LORA), ("full", None)):
        res = worlds(2).run(train_and_save, str(root / tag), lora, "zero3")[0]
        out[tag] = (root / tag / "last.ckpt", res)
    return out


def _consolidate(*args: str) -> None:
    from lightning_shard.cli import main

    assert main(["consolidate", *args]) == 0


def test_hf_export_merges_lora_and_loads_with_from_pretrained(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt, res = trained["lora"]
    assert ckpt.is_dir() and all(".lora_" in n for n in res["trainable"])  # sharded dir; only adapters trained
    _consolidate(str(ckpt), str(tmp_path / "hf"), "--hf")
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hf" / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not any("lora" in n for n, _ in model.named_parameters())  # merged: a plain GPT-2
    with torch.no_grad():
        logits = model(input_ids=_inputs()).logits
    assert (logits - res["logits"]).abs().max() < 1e-4


def test_hf_adapter_export_loads_with_peft(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt, res = trained["lora"]
    _consolidate(str(ckpt), str(tmp_path / "ad"), "--hf-adapter")
    assert (tmp_path / "ad" / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "ad" / "base")
    model = PeftModel.from_pretrained(base, tmp_path / "ad").eval()
    with torch.no_grad():
        logits = model(input_ids=_inputs()).logits
    assert (logits - res["logits"]).abs().max() < 1e-4
    with torch.no_grad():  # and the adapters matter: the base alone differs
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ad" / "base").eval()(input_ids=_inputs()).logits
    assert (plain - res["logits"]).abs().max() > 1e-3


def test_hf_export_of_a_full_fine_tune(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    ckpt, res = trained["full"]
    _consolidate(str(ckpt), str(tmp_path / "hf"), "--hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(input_ids=_inputs()).logits
    assert (logits - res["logits"]).abs().max() < 1e-4
    from lightning_shard.cli import main

    assert main(["consolidate", str(ckpt), str(tmp_path / "ad"), "--hf-adapter"]) == 2
    assert "--hf-adapter: this run trained no LoRA adapters" in capsys.readouterr().err


def test_hf_export_refuses_a_checkpoint_of_another_recipe(tmp_path):
    from lightning_shard.recipes.hf_export import save_hf

    with pytest.raises(ValueError, match="needs a checkpoint of the hf_causal_lm recipe"):
        save_hf({}, {"n_layer": 2}, Path(tmp_path) / "x")
