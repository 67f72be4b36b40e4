"""Jobs that end right after their last collective, for the clean-exit tests (tests/strategies/test_exit.py).

    python tests/exit_job.py raw GUARD RANK PORT    one rank of a 2-rank gloo job without Lightning; GUARD: on | off
    python tests/exit_job.py fit STRATEGY           a 2-rank Lightning fit (popen launcher), then the interpreter exits

Both set a switch interval of 1000 s: the main thread then gives up the GIL only when it blocks (in a collective's
wait, a sleep), never to a thread that merely asks for it. A gloo worker thread that still has to destroy a finished
collective (which takes the GIL) when the main thread reaches interpreter finalization aborts the process ("terminate
called without an active exception"); ordinary scheduling makes that rare, this switch interval makes it likely. The
raw job's last collectives are ours (``C.all_gather`` + ``C.wait``); with GUARD off it skips the exit guard
``C.init_process_group`` installs, as a control that the harness provokes the abort on this machine.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_shard.engine.comm import collectives as C  # noqa: E402


def raw(guard: str, rank: int, port: int) -> None:
    torch.set_num_threads(1)
    init = f"tcp://127.0.0.1:{port}"
    if guard == "on":
        C.init_process_group("gloo", rank, 2, init, timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    group = C.duplicate_group(None, "gather")  # a subgroup, as stage 3's gathers use
    shard, full = torch.randn(4096), torch.empty(2 * 4096)
    sys.setswitchinterval(1000.0)
    for _ in range(4):
        C.wait(C.all_gather(full, shard, group=group, async_op=True), "exit_job gather")
    print(f"RANK{rank} DONE guard={C.exit_guard_installed()}", flush=True)


def fit(name: str) -> None:
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shard.strategies import FSDPShardStrategy, Zero2Strategy, Zero3Strategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    torch.set_num_threads(1)
    sys.setswitchinterval(1000.0)
    strategy = {"zero2": Zero2Strategy, "zero3": Zero3Strategy, "fsdp_shard": FSDPShardStrategy}[name]()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), DataLoader(data, batch_size=4))
    print(f"RANK{trainer.global_rank} DONE guard={C.exit_guard_installed()}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "raw":
        raw(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        fit(sys.argv[2])
