"""One variant, one rank: synthetic data, the variant's module and strategy, a Lightning fit with the Meter."""

from __future__ import annotations

import argparse
import os

from measure import make_callback, profiled_steps
from variants import DEEPSPEED, make_module, make_strategy
from wire import Counters, install_counters


def make_data(args: argparse.Namespace):
    """The synthetic token sequences (fixed seed), as the DataLoader a rank hands to ``Trainer.fit`` (Lightning puts its
    DistributedSampler in; ``deepspeed_rank.py`` does the same by hand)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    n_seq = (args.warmup + args.steps) * args.batch_size * args.devices
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(args.vocab, (n_seq, args.block_size + 1), generator=gen)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size, drop_last=True)


def run_variant(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    import lightning.pytorch as pl

    variant = args.variant
    if variant in DEEPSPEED:  # DeepSpeed's own engine, no Lightning Trainer (deepspeed_rank.py: why, what is the same)
        from deepspeed_rank import run_deepspeed

        run_deepspeed(args)
        return
    pl.seed_everything(args.seed, verbose=False)
    data = make_data(args)
    # The profiled steps come after the timed ones, from further epochs over the same data: the first epoch (and so
    # the DistributedSampler's shuffle of it) is the warmup + timed steps exactly, profiled or not.
    n_profiled = profiled_steps(args, variant)
    epochs = 1 + -(-n_profiled // (args.warmup + args.steps))

    counters = Counters(args.devices, int(os.environ.get("LOCAL_RANK", "0")))
    module = make_module(args, variant)  # same seed on every rank: identical initial weights everywhere
    strategy = make_strategy(args, variant)
    if args.suite != "speed":  # the speed suite patches nothing into a peer (its bytes are computed)
        install_counters(variant, counters)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                         max_steps=args.warmup + args.steps + n_profiled, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[make_callback(args, variant, counters)])
    counters.rank = trainer.global_rank
    trainer.fit(module, train_dataloaders=data)
