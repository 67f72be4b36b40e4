"""The table of Lightning training patterns: ``python -m tests.pattern_table``.

Trains every pattern of :mod:`tests.patterns` under Lightning's ``ddp`` and under zero1, zero2, zero3, fsdp_shard
(2 gloo ranks) and zero3_hybrid (4 ranks as 2 islands x 2), every knob at its default, and prints the max |diff| of
rank 0's ``model.state_dict()`` after ``fit`` against ``ddp``'s, or the error a run ended with; then the GAN's
collectives per step from the independent torch.distributed counter beside the ledger's. What
tests/strategies/test_patterns.py asserts, as one Markdown table.
"""

from __future__ import annotations

import argparse
from collections import Counter

STRATEGIES = ["zero1", "zero2", "zero3", "fsdp_shard"]
HYBRID = "zero3_hybrid"


def _short(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else type(err).__name__)[:110]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--patterns", default="")
    args = ap.parse_args()

    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    from tests.harness import World
    from tests.patterns import AUTO_VARIANTS, GAN_VARIANTS, REFUSED_VARIANTS, fit_pattern
    from tests.zoo import max_diff

    patterns = args.patterns.split(",") if args.patterns else list(GAN_VARIANTS + AUTO_VARIANTS + REFUSED_VARIANTS)
    rows: dict[str, dict[str, str]] = {p: {} for p in patterns}
    counts: dict[str, list] = {}
    for size, names in ((2, STRATEGIES), (4, [HYBRID])):
        world = World(size)
        try:
            for pattern in patterns:
                try:
                    peer = world.run(fit_pattern, "ddp", pattern)[0]
                except Exception as err:  # noqa: BLE001 - refused by ddp too: show each strategy's answer
                    peer = {"error": _short(err)}
                    world.close(force=True)
                    world = World(size)
                for name in names:
                    try:
                        ours = world.run(fit_pattern, name, pattern)[0]
                        rows[pattern][name] = (f"{max_diff(ours['state'], peer['state']):.1e}" if "state" in peer
                                               else f"trained, where ddp refused: {peer['error']}")
                    except Exception as err:  # noqa: BLE001 - the table shows the failure
                        rows[pattern][name] = _short(err)
                        world.close(force=True)
                        world = World(size)
            if size == 2 and "gan" in patterns:
                for name in ("zero2", "zero3"):
                    res = world.run(fit_pattern, name, "gan", count=True)[0]
                    counts[name] = [res["trainable_buckets"], res["batches"][1]]
        finally:
            world.close()
    names = STRATEGIES + [HYBRID]
    print("| pattern | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for pattern in patterns:
        print(f"| {pattern} | " + " | ".join(rows[pattern].get(n, "-") for n in names) + " |")
    for name, (buckets, batch) in counts.items():
        same = "equal" if batch["ours"] == batch["ledger"] else "DIFFERENT"
        print(f"\nGAN under {name}, one step (2 backwards, 2 optimizer steps), {buckets} trainable buckets: "
              f"torch.distributed calls {dict(Counter(batch['ours']))}; ledger {same}; "
              f"by tag {dict(batch['grad'])}")


if __name__ == "__main__":
    main()
