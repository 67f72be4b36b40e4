"""The parity table of the foreign-model suite: ``python -m tests.parity_table [--worlds 2,4] [--models a,b]``.

Trains every model of :mod:`tests.foreign` under every registered strategy with default knobs on gloo ranks of
this machine and prints, for each (accumulation, world), the max |diff| of rank 0's ``model.state_dict()`` after
``fit`` against one process on the same global batch, or the error the run ended with. A run that fails restarts
the ranks, so one broken case cannot poison the next.
"""

from __future__ import annotations

import argparse
import time

STRATEGIES = ["zero0", "zero1", "zero2", "zero3", "fsdp_shard"]
CASES = [(1, 2), (3, 2), (1, 4), (3, 4)]  # (accumulation, world)


def _short(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[:110]
    return (lines[-1] if lines else type(err).__name__)[:110]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--models", default="")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--timeout", type=float, default=180.0)
    args = ap.parse_args()

    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_shard"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from tests.foreign import MODELS, diff, fit_foreign, reference_state
    from tests.harness import World

    worlds = [int(w) for w in args.worlds.split(",")]
    models = [m for m in args.models.split(",") if m] or list(MODELS)
    strategies = [s for s in args.strategies.split(",") if s]
    cases = [c for c in CASES if c[1] in worlds]
    print("| model | strategy | " + " | ".join(f"acc {a}, world {w}" for a, w in cases) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in cases) + " |")
    refs: dict = {}
    pool: dict[int, World] = {}

    def world(n: int) -> World:
        if n not in pool:
            pool[n] = World(n, timeout=args.timeout)
        return pool[n]

    t0 = time.time()
    for model in models:
        for strategy in strategies:
            cells = []
            for acc, w in cases:
                key = (model, acc, w)
                if key not in refs:
                    refs[key] = reference_state(model, args.steps, acc, w, args.optimizer)
                try:
                    res = world(w).run(fit_foreign, model, strategy, args.steps, acc, args.optimizer)
                    cells.append(f"{diff(res[0]['state'], refs[key]):.1e}")
                except BaseException as err:  # noqa: BLE001 - reported in the table
                    cells.append("**" + _short(err).replace("|", "/") + "**")
                    old = pool.pop(w, None)
                    if old is not None:
                        old.close(force=True)
            print(f"| {model} | {strategy} | " + " | ".join(cells) + " |", flush=True)
    for w in pool.values():
        w.close()
    print(f"\n{len(models) * len(strategies) * len(cases)} runs in {time.time() - t0:.0f} s "
          f"(steps={args.steps}, optimizer={args.optimizer})")


if __name__ == "__main__":
    main()
