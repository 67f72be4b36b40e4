"""The benchmark's variants: which suite holds which, what each is, and the module + strategy that run it.

Every variant trains one model under AdamW; only the strategy (and for ``zero_r`` the optimizer, for ``fsdp2`` a
``configure_model``) differs. The model (``--model``): ``hf_gpt2`` (Hugging Face ``transformers.GPT2LMHeadModel``,
tied embedding, dropout 0, blocks ``GPT2Block`` in ``model.transformer.h``; the suites' default) or ``gpt`` (the
project's recipe GPT, ``lightning_shard.recipes.gpt.GPT``: tied embedding / LM head, pre-LayerNorm blocks
``lightning_shard.recipes.gpt.Block``, no dropout; the speed suite's second model).

Options of the lightning_shard variants (``lightning_shard/options``): the ``peak`` and ``speed`` suites run every
strategy with its default options (zero0/1/2: only ``tuning.bucket_mb``; fsdp_shard: only its wrap class), and on
request (``--variants``, :data:`OPT_IN`) the same with the options of a suffix
(:data:`SUFFIXES`): ``_ac`` (``activation_checkpointing="auto"``), ``_bf16`` (``param_dtype="bf16"``), ``_offload``
(``offload_optimizer``), ``_offload_all`` (zero3: ``offload_optimizer`` and ``offload_params``), ``_rs`` (the
backend's reduce-scatter), ``_pf3`` / ``_pf2`` / ``_pf1`` (stage 3: ``tuning.prefetch_depth=3`` / ``2`` / ``1``).

A/A controls (speed suite, opt-in, :data:`AA_CONTROLS`): ``ddp_aa`` and ``fsdp2_aa`` run the program of ``ddp`` and
``fsdp2`` under another name, so that their paired ratio to the peer in the same run shows how far two identical
programs spread on the machine: the noise floor that any other ratio of that run is to be read against.

DeepSpeed peers (peak suite, opt-in: ``--variants ds_zero1 ds_zero2 ds_zero3``; needs the ``bench-deepspeed`` extra):
DeepSpeed ZeRO stage 1/2/3 with the same model, data, seed, AdamW groups and step counts, run by
``bench/deepspeed_rank.py`` under ``deepspeed.initialize`` rather than a Lightning Trainer (Lightning's
``DeepSpeedStrategy`` refuses the CPU accelerator); their DeepSpeed config: :func:`deepspeed_config`.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

# ``<strategy><suffix>``: the strategy with the options of each suffix (peak suite, opt-in): activation checkpointing,
# the bf16 mixed-precision policy, ZeRO-Offload of the optimizer (and, for stage 3, of the parameter shards too); a
# group's fields as a mapping (``tuning``, ``compression``); ``comm``: how collectives run, not an option but the
# engine's per-backend choice, set on the strategy (engine/comm/choices.py ``CommChoices``)
SUFFIXES: dict[str, dict[str, Any]] = {
    "_ac": {"activation_checkpointing": "auto"},
    "_bf16": {"param_dtype": "bf16"},
    "_offload": {"offload_optimizer": True},
    "_offload_all": {"offload_optimizer": True, "offload_params": True},
    "_rs": {"comm": {"reduce_scatter": "reduce_scatter"}},  # the backend's reduce-scatter (gloo's until issue 16)
    "_pf3": {"tuning": {"prefetch_depth": 3}},  # stage 3: three units gathered ahead instead of one
    "_pf1": {"tuning": {"prefetch_depth": 1}},  # stage 3: one unit ahead (zero3's default is 3)
    "_pf2": {"tuning": {"prefetch_depth": 2}},  # stage 3: two units ahead
    "_ar": {"comm": {"reduce_scatter": "all_reduce"}},  # gloo's default before the all-to-all form (issue 16)
    "_u0": {"tuning": {"min_unit_mb": 0.0}},  # zero3: one unit per module with parameters (before issue 16's merging)
    # compressed communication (issue 14, engine/comm/quant.py): int8 gathers, int8 / int4 reductions, both
    "_q8g": {"compression": {"gather_quant": "int8"}},
    "_q8r": {"compression": {"reduce_quant": "int8"}},
    "_q4r": {"compression": {"reduce_quant": "int4"}},
    "_q8": {"compression": {"gather_quant": "int8", "reduce_quant": "int8"}},
    "_agc": {"comm": {"all_gather": "all_gather"}},  # the backend's all-gather (gloo's until issue 16's 4th round)
    "_nohuge": {"comm": {"huge_pages": False}},  # plain 4 KiB pages per-step (the default until issue 16's 5th)
}
_KNOBBED = ("zero2_ac", "zero3_ac", "fsdp_shard_ac", "zero2_bf16", "zero3_bf16", "fsdp_shard_bf16",
            "zero2_offload", "zero3_offload", "fsdp_shard_offload", "zero3_offload_all",
            "zero1_rs", "zero2_rs", "zero3_rs", "fsdp_shard_rs", "zero3_pf3", "fsdp_shard_pf3",
            "zero3_pf1", "zero3_pf2", "fsdp_shard_pf2", "zero1_ar", "zero2_ar", "zero3_ar", "fsdp_shard_ar", "zero3_u0",
            "zero2_q8r", "zero2_q4r", "zero3_q8g", "zero3_q8r", "zero3_q4r", "zero3_q8", "fsdp_shard_q8",
            "zero1_agc", "zero2_agc", "zero3_agc", "fsdp_shard_agc",
            "zero1_nohuge", "zero2_nohuge", "zero3_nohuge", "fsdp_shard_nohuge")
OURS = ("zero0", "zero1", "zero2", "zero3", "fsdp_shard") + _KNOBBED  # ShardEngine
STAGE3 = ("zero3", "fsdp_shard") + tuple(v for v in _KNOBBED if v.startswith(("zero3", "fsdp")))
# ours with parameters sharded (3 passes of parameter bytes per step)
SUITES = {
    "peak": ("ddp", "zero0", "zero1", "zero2", "fsdp2", "zero3", "fsdp_shard"),
    # tokens/s side by side, best of the repeats (bench_speed.py); ``single`` (opt-in): plain Lightning on one
    # device, a reference for a world-1 row set only (the scaling table's first)
    "speed": ("ddp", "zero_r", "zero1", "zero2", "fsdp2", "zero3", "fsdp_shard"),
}
# variants a suite runs only when ``--variants`` names them (the default table stays as it is), e.g.
# ``bench_peak.py --variants zero2 zero2_ac zero3 zero3_ac zero3_bf16 zero3_offload zero3_offload_all``
# DeepSpeed ZeRO-1/2/3 (``bench/deepspeed_rank.py``; the stage is the variant's last digit)
DEEPSPEED = ("ds_zero1", "ds_zero2", "ds_zero3")
# the DeepSpeed peers are in the default peak table where DeepSpeed is installed (the ``bench-deepspeed`` extra)
if importlib.util.find_spec("deepspeed") is not None:
    SUITES["peak"] = SUITES["peak"] + DEEPSPEED
    SUITES["speed"] = SUITES["speed"] + DEEPSPEED
# A/A controls (speed suite, opt-in): a peer run again under another name, the same program; its paired ratio to the
# peer in one run is that run's noise floor, how far the ratio of two identical programs spreads on this machine
AA_CONTROLS = {"ddp_aa": "ddp", "fsdp2_aa": "fsdp2"}
OPT_IN = {"peak": _KNOBBED + tuple(v for v in DEEPSPEED if v not in SUITES["peak"]),
          "speed": ("single", "zero0", "zero_auto") + tuple(AA_CONTROLS) + _KNOBBED
          + tuple(v for v in DEEPSPEED if v not in SUITES["speed"])}


def program_of(variant: str) -> str:
    """The variant whose program ``variant`` runs: an A/A control's peer, else ``variant`` itself."""
    return AA_CONTROLS.get(variant, variant)


def split_variant(variant: str) -> tuple[str, dict[str, Any]]:
    """``"zero3_offload_all"`` -> ``("zero3", {"offload_optimizer": True, "offload_params": True})``."""
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if variant.endswith(suffix) and variant in _KNOBBED:
            return variant[: -len(suffix)], dict(SUFFIXES[suffix])
    return variant, {}


def suite_variants(suite: str) -> tuple[str, ...]:
    """Every variant ``suite`` can run: its default table, then its opt-in variants."""
    return SUITES[suite] + OPT_IN.get(suite, ())


VARIANTS = tuple(dict.fromkeys(v for suite in SUITES for v in suite_variants(suite)))
MODELS = ("gpt", "hf_gpt2")
NOTES = {
    "single": "plain Lightning on one device (Trainer(devices=1), no distributed strategy)",
    "zero0": "lightning_shard stage 0: bucketed all-reduce, replicated AdamW",
    "zero_auto": "lightning_shard strategy=auto with calibrate=True: the planner's pick by the calibrated time model "
                 "(profile from $LIGHTNING_SHARD_CACHE)",
    "zero1": "lightning_shard: reduce-scatter grads, sharded AdamW, all-gather params",
    "zero2": "as zero1, full grads freed after reduce-scatter",
    "ddp": "Lightning DDPStrategy (baseline)",
    "ddp_aa": "Lightning DDPStrategy again, the same program as ddp (A/A control: its ratio to ddp is the noise)",
    "fsdp2_aa": "torch FSDP2 again, the same program as fsdp2 (A/A control: its ratio to fsdp2 is the noise)",
    "zero_r": "torch ZeroRedundancyOptimizer(AdamW) under Lightning DDP: all-reduce + per-param broadcasts",
    "zero3": "lightning_shard Zero3Strategy: every module with parameters is a unit",
    "fsdp_shard": "lightning_shard FSDPShardStrategy(wrap_classes=[GPT block]): one unit per block + root",
    "fsdp2": "torch FSDP2 fully_shard per block + root, Lightning ModelParallelStrategy (dp=N, tp=1, gloo)",
    "zero2_ac": "zero2 with activation_checkpointing='auto' (every block's forward recomputed in backward)",
    "zero3_ac": "zero3 with activation_checkpointing='auto'",
    "fsdp_shard_ac": "fsdp_shard with activation_checkpointing='auto'",
    "zero2_bf16": "zero2 with param_dtype='bf16' (fp32 masters; parameters held, gathered, computed in bf16)",
    "zero3_bf16": "zero3 with param_dtype='bf16'",
    "fsdp_shard_bf16": "fsdp_shard with param_dtype='bf16'",
    "zero2_offload": "zero2 with offload_optimizer=True (master shard, its grad, AdamW state in host memory)",
    "zero3_offload": "zero3 with offload_optimizer=True",
    "fsdp_shard_offload": "fsdp_shard with offload_optimizer=True",
    "zero3_offload_all": "zero3 with offload_optimizer=True and offload_params=True (shards in host memory too)",
    "zero1_rs": "zero1 with reduce_scatter_via='reduce_scatter' (gloo's own reduce-scatter, the default until "
                "issue 16)",
    "zero2_rs": "zero2 with reduce_scatter_via='reduce_scatter'",
    "zero3_rs": "zero3 with reduce_scatter_via='reduce_scatter'",
    "fsdp_shard_rs": "fsdp_shard with reduce_scatter_via='reduce_scatter'",
    "zero3_pf3": "zero3 with tuning.prefetch_depth=3 (three units gathered ahead)",
    "zero3_pf1": "zero3 with tuning.prefetch_depth=1 (one unit gathered ahead; the default is 3)",
    "zero1_ar": "zero1 with reduce_scatter_via='all_reduce' (an all-reduce of the bucket: gloo's default until the "
                "all-to-all form, issue 16)",
    "zero2_ar": "zero2 with reduce_scatter_via='all_reduce'",
    "zero3_ar": "zero3 with reduce_scatter_via='all_reduce'",
    "fsdp_shard_ar": "fsdp_shard with reduce_scatter_via='all_reduce'",
    "zero3_u0": "zero3 with tuning.min_unit_mb=0 (one unit per module with parameters: the plan before issue 16)",
    "fsdp_shard_pf3": "fsdp_shard with tuning.prefetch_depth=3 (three units gathered ahead)",
    "fsdp_shard_pf2": "fsdp_shard with tuning.prefetch_depth=2 (two units gathered ahead)",
    "zero3_pf2": "zero3 with tuning.prefetch_depth=2 (two units gathered ahead)",
    "zero2_q8r": "zero2 with compression.reduce_quant='int8' (quantized reductions with error feedback, "
                 "docs/compression.md)",
    "zero2_q4r": "zero2 with compression.reduce_quant='int4'",
    "zero3_q8g": "zero3 with compression.gather_quant='int8' (quantized parameter all-gathers)",
    "zero3_q8r": "zero3 with compression.reduce_quant='int8'",
    "zero3_q4r": "zero3 with compression.reduce_quant='int4'",
    "zero3_q8": "zero3 with compression.gather_quant='int8' and reduce_quant='int8'",
    "fsdp_shard_q8": "fsdp_shard with compression.gather_quant='int8' and reduce_quant='int8'",
    "zero1_agc": "zero1 with all_gather_via='all_gather' (gloo's own all-gather after each step: the default until "
                 "the broadcast form, issue 16)",
    "zero2_agc": "zero2 with all_gather_via='all_gather'",
    "zero3_agc": "zero3 with all_gather_via='all_gather' (gloo's own all-gather of each unit)",
    "fsdp_shard_agc": "fsdp_shard with all_gather_via='all_gather'",
    "zero1_nohuge": "zero1 with huge_pages=False (its per-step host buffers in plain 4 KiB pages: the default until "
                    "issue 16's fifth round)",
    "zero2_nohuge": "zero2 with huge_pages=False",
    "zero3_nohuge": "zero3 with huge_pages=False",
    "fsdp_shard_nohuge": "fsdp_shard with huge_pages=False",
    "ds_zero1": "DeepSpeed ZeRO stage 1 (deepspeed.initialize, no Lightning Trainer; DS_ACCELERATOR=cpu, gloo), torch "
                "AdamW as client optimizer, fp32 (no fp16/bf16 section), reduce_bucket_size = allgather_bucket_size "
                "= bucket_mb MiB of fp32 elements (25 MiB: 6,553,600), overlap_comm=False, "
                "contiguous_gradients=True, gradient_clipping=0",
    "ds_zero2": "DeepSpeed ZeRO stage 2, otherwise as ds_zero1 (reduce_bucket_size = allgather_bucket_size = "
                "bucket_mb MiB of fp32 elements, overlap_comm=False, contiguous_gradients=True, fp32)",
    "ds_zero3": "DeepSpeed ZeRO stage 3, fp32, reduce_bucket_size = bucket_mb MiB of fp32 elements, "
                "overlap_comm=False, contiguous_gradients=True, stage3_max_reuse_distance=0 (release a module's "
                "parameters after each use; DeepSpeed keeps gathered any parameter reused within this many elements, "
                "and the default 1e9 exceeds the whole model), "
                "stage3_prefetch_bucket_size = one transformer block's parameters (~ prefetch one unit ahead; default "
                "5e7), stage3_param_persistence_threshold=1e5 and stage3_max_live_parameters=1e9 (defaults)",
}


# ============================================================================================ model
def model_kind(args: argparse.Namespace) -> str:
    return getattr(args, "model", None) or "gpt"


def build_model(args: argparse.Namespace):
    """The benchmark's model at its sizes (tied embedding, dropout 0): the recipe GPT or HF GPT-2."""
    if model_kind(args) == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        # bos/eos ids inside the vocabulary (GPT-2's 50256 is not, and transformers warns); unused in training
        cfg = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
                         n_positions=args.block_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)
        return GPT2LMHeadModel(cfg)
    from lightning_shard.recipes.gpt import GPT

    return GPT(vocab_size=args.vocab, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
               n_embd=args.n_embd, dropout=0.0, tie_weights=True)


def transformer_blocks(model: Any) -> Any:
    """The model's transformer blocks (the FSDP2 units below the root)."""
    return model.transformer.h if hasattr(model, "transformer") else model.blocks


def block_class(args: argparse.Namespace) -> type:
    """The block class ``fsdp_shard`` wraps."""
    if model_kind(args) == "hf_gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block
    from lightning_shard.recipes.gpt import Block

    return Block


def model_param_count(args: argparse.Namespace) -> int:
    """Parameters (tied weight once), from a meta-device copy: no memory, independent of sharding."""
    import torch

    with torch.device("meta"):
        model = build_model(args)
        return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def unit_param_counts(args: argparse.Namespace) -> dict[str, int]:
    """Parameters of one transformer block and of what is outside the blocks (the root unit of a per-block wrap:
    embeddings, final norm, tied head), from a meta-device copy."""
    import torch

    with torch.device("meta"):
        model = build_model(args)
        blocks = list(transformer_blocks(model))
        total = sum(p.numel() for p in model.parameters())
        block = sum(p.numel() for p in blocks[0].parameters()) if blocks else 0
        return {"block": block, "root": total - block * len(blocks), "n_blocks": len(blocks)}


def model_param_bytes(args: argparse.Namespace) -> int:
    """Psi in bytes (fp32)."""
    return 4 * model_param_count(args)


def make_module(args: argparse.Namespace, variant: str):
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    hf = model_kind(args) == "hf_gpt2"

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(args)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.model(input_ids=x, use_cache=False).logits if hf else self.model(x)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

        def configure_optimizers(self):
            decay = [p for p in self.parameters() if p.dim() >= 2]
            rest = [p for p in self.parameters() if p.dim() < 2]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
            hp = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
            if variant == "zero_r":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                zr = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                             weight_decay=0.1, **hp)
                zr.add_param_group(groups[1])
                return zr
            return torch.optim.AdamW(groups, **hp)

    if program_of(variant) != "fsdp2":
        return BenchModule()

    class FSDP2Module(BenchModule):
        """ModelParallelStrategy requires ``configure_model``: FSDP2 on each block, then on the model's root."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self.model, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            for block in transformer_blocks(self.model):
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return FSDP2Module()


def deepspeed_config(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """The DeepSpeed config of ``ds_zero<stage>`` (what :data:`NOTES` states): fp32 (no ``fp16`` / ``bf16``
    section), ZeRO ``stage``, buckets of ``--bucket-mb`` MiB of fp32 elements as the lightning_shard zero0-2 get,
    no overlap (no side streams on CPU), DeepSpeed's contiguous gradient buffer; stage 3: parameters released after
    each use and prefetch of about one block ahead (the defaults, reuse distance 1e9 and prefetch 5e7 elements,
    exceed the whole of a model this small)."""
    stage = int(variant[-1])
    bucket = int(args.bucket_mb * 2**20) // 4  # elements of fp32
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": False,
                            "contiguous_gradients": True}
    if stage < 3:
        zero["allgather_bucket_size"] = bucket
    else:
        zero.update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=unit_param_counts(args)["block"],
                    stage3_param_persistence_threshold=100_000, stage3_max_live_parameters=1_000_000_000)
    return {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "zero_optimization": zero, "steps_per_print": 10**9,
            "wall_clock_breakdown": False}


def make_strategy(args: argparse.Namespace, variant: str) -> Any:
    """The strategy of ``variant``; a suffix's ``comm`` (how collectives run) is set on it, not passed as options."""
    base, options = split_variant(program_of(variant))
    strategy = _make_strategy(args, variant)
    if "comm" in options:
        from lightning_shard.engine.comm.choices import CommChoices

        strategy.comm = CommChoices(**options["comm"])
    return strategy


def _make_strategy(args: argparse.Namespace, variant: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    import lightning_shard  # noqa: F401  (registers the strategy names)
    from lightning_shard.options import merge as merge_options
    from lightning_shard.strategies import FSDPShardStrategy, Zero0Strategy, Zero1Strategy, Zero2Strategy, Zero3Strategy

    if variant == "single":
        return "auto"
    if variant == "zero_auto":  # the planner's pick on this machine, the calibrated model (bench_planner.py)
        from lightning_shard.strategies import AutoStrategy

        return AutoStrategy(topology="cpu", global_batch_size=args.batch_size * args.devices,
                            micro_batch_size=args.batch_size, calibrate=True, wrap_classes=[block_class(args)],
                            check_after_steps=args.warmup + args.steps - 1)
    variant = program_of(variant)
    if variant in ("ddp", "zero_r"):
        return DDPStrategy(process_group_backend="gloo")
    if variant == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1,
                                     process_group_backend="gloo", save_distributed_checkpoint=True)
    base, ac = split_variant(variant)  # ``<strategy><suffix>``: the strategy with the suffix's options (peak suite)
    ac.pop("comm", None)  # set by make_strategy
    # default options, but for zero0/1/2's bucket size (``--bucket-mb``)
    if base == "zero3":
        return Zero3Strategy(**ac)
    if base == "fsdp_shard":
        return FSDPShardStrategy(wrap_classes=[block_class(args)], **ac)
    cls = {"zero0": Zero0Strategy, "zero1": Zero1Strategy, "zero2": Zero2Strategy}[base]
    return cls(**merge_options({"tuning": {"bucket_mb": args.bucket_mb}}, ac))
