"""The planner's prediction for compressed communication (issue 14): per topology preset and strategy, step time,
exposed communication, wire bytes per rank per step by link class and peak memory, without and with each option
(``gather_quant``, ``reduce_quant``), and whether ``strategy=auto`` would take one (>= ``QUANT_MARGIN`` faster).

    python bench/quant_plan.py --recipe gpt_7b --presets hgx_h100_8 h100_nvl_8 a100_pcie_4_pairs pcie_8 \\
        hgx_h100_2nodes_ib --out-md bench/results/quant_plan.md

Nothing here is measured: it is the planner's model (planner/time.py, traffic.py, memory.py), printed beside the CPU
measurements of docs/compression.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_shard.planner.config import StrategyConfig  # noqa: E402
from lightning_shard.planner.evaluate import island_shard_size  # noqa: E402
from lightning_shard.planner.models import from_recipe  # noqa: E402
from lightning_shard.planner.recommend import QUANT_MARGIN, plan  # noqa: E402

OPTIONS = [("none", "none"), ("int8", "none"), ("none", "int8"), ("none", "int4"), ("int8", "int8")]
GiB, MiB = 2**30, 2**20


def rows_for(strategy: str, stage: int, policy: str, island: int | None) -> list[StrategyConfig]:
    out = []
    for gq, rq in OPTIONS:
        if gq != "none" and stage != 3:
            continue
        out.append(StrategyConfig(strategy, stage, policy=policy, gather_quant=gq, reduce_quant=rq))
        if stage == 3 and island and (gq, rq) in (("none", "none"), ("int8", "int8")):  # hpZ
            out.append(out[-1].with_(secondary_shard=island))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="gpt_7b")
    p.add_argument("--presets", nargs="+", default=["hgx_h100_8", "h100_nvl_8", "a100_pcie_4_pairs", "pcie_8",
                                                    "hgx_h100_2nodes_ib"])
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--precision", default="bf16-true")
    p.add_argument("--out-md", default=None)
    args = p.parse_args(argv)
    module = from_recipe(args.recipe)
    lines = [f"# Planner: compressed communication, {args.recipe}, global batch {args.global_batch}, micro-batch "
             f"{args.micro_batch}, {args.precision}", "",
             f"Command: `python bench/quant_plan.py --recipe {args.recipe} --presets {' '.join(args.presets)}`. "
             "Predicted, not measured (planner/time.py: alpha-beta ring model; quantization "
             "costed as eager torch's memory traffic, 64 bytes per element quantized, 24 dequantized, 24 for error "
             "feedback). `auto` = what `strategy=auto` recommends (it takes a quantized "
             f"row only when predicted >= {QUANT_MARGIN:.0%} faster than the exact one).", ""]
    for preset in args.presets:
        configs = []
        probe = plan(module, preset, None, args.global_batch, args.micro_batch, args.precision,
                     configs=[StrategyConfig("zero2", 2)], require_fit=False)
        island = island_shard_size(probe.context.placement)
        for strategy, stage, policy in (("zero2", 2, "defer"), ("zero3", 3, "keep_unsharded_grads"),
                                        ("fsdp_shard", 3, "keep_unsharded_grads")):
            configs += rows_for(strategy, stage, policy, island)
        res = plan(module, preset, None, args.global_batch, args.micro_batch, args.precision, configs=configs,
                   require_fit=False)
        auto = plan(module, preset, None, args.global_batch, args.micro_batch, args.precision, require_fit=False)
        lines += [f"## {preset} (world {res.context.job.world}, {res.context.device.name})", "",
                  f"auto: {auto.reason}", "",
                  "| strategy | gather | reduce | hpZ | s/step | vs exact | exposed comm s | intra-island GB "
                  "| inter-island GB | inter-node GB | peak GiB | fits |",
                  "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        exact = {}
        for r in res.rows:
            c = r.config
            key = (c.strategy, c.policy)
            if c.gather_quant == "none" and c.reduce_quant == "none" and not c.secondary_shard:
                exact[key] = r.time.total
            base = exact.get(key, r.time.total)
            tr = r.traffic
            lines.append(f"| {c.strategy} | {c.gather_quant} | {c.reduce_quant} | {c.secondary_shard or '-'} | "
                         f"{r.time.total:.3f} | "
                         f"{r.time.total / base:.3f} | {r.time.exposed_comm:.3f} | {tr['intra-island'] / 1e9:.2f} | "
                         f"{tr['inter-island'] / 1e9:.2f} | {tr['inter-node'] / 1e9:.2f} | "
                         f"{r.memory['total'] / GiB:.1f} | {'yes' if r.fits else 'no'} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out_md:
        Path(args.out_md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
