"""A Lightning Fabric loop on lightning_shard, as litgpt's scripts write one: the recipe GPT on synthetic tokens,
2 CPU processes, a sharded strategy, gradient accumulation, clipping, a sharded checkpoint and its reload.

    .venv/bin/python scripts/fabric_example.py                       # zero3, 2 processes
    .venv/bin/python scripts/fabric_example.py --strategy zero2 --steps 20 --dcp
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import lightning_shard  # noqa: F401  registers the strategy names in Fabric's registry
from lightning_shard.recipes.gpt import GPT
from lightning_shard.recipes.synthetic import SyntheticTokens
from lightning_shard.strategies import FABRIC_CLASSES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="zero3", choices=sorted(FABRIC_CLASSES))
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--dcp", action="store_true", help="save through torch.distributed.checkpoint")
    args = ap.parse_args()

    torch.set_num_threads(1)
    strategy = FABRIC_CLASSES[args.strategy](state_dict_type="dcp" if args.dcp else "sharded")
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=args.strategy in ("zero3", "fsdp_shard")):  # stage 3: meta device
        model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = SyntheticTokens(num_samples=args.steps * args.accumulate * args.devices * 8, block_size=64, vocab_size=256)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=False))

    t0, step = time.perf_counter(), 0
    for i, (x, y) in enumerate(loader):
        boundary = (i + 1) % args.accumulate == 0
        with fabric.no_backward_sync(model, enabled=not boundary):
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            fabric.backward(loss / args.accumulate)
        if boundary:
            norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            fabric.print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {float(norm):.3f}")
    fabric.print(f"{step} steps in {time.perf_counter() - t0:.1f} s")

    root = Path(fabric.broadcast(tempfile.mkdtemp(prefix="fabric_example_") if fabric.global_rank == 0 else None))
    fabric.save(root / "ckpt", {"model": model, "optimizer": optimizer, "step": step})
    rest = fabric.load(root / "ckpt", {"model": model, "optimizer": optimizer})
    state = model.state_dict()  # full weights on every rank (collective)
    fabric.print(f"saved and reloaded {root / 'ckpt'} (step {rest['step']}); "
                 f"{sum(v.numel() for v in state.values()) / 1e6:.2f}M values in model.state_dict()")


if __name__ == "__main__":
    main()
