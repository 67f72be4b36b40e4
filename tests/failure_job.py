"""A 2-rank training job for the failure tests, launched by Lightning's default (popen) launcher.

    python tests/failure_job.py MODE DIR     MODE: straight | kill | sleep | resume | diverge

kill: rank 1 SIGKILLs itself at step 5; sleep: rank 1 stalls for 300 s at step 3 (collective timeout 10 s, the
start-up timeout stays at its generous default, so a loaded machine's slow imports are not a failure);
resume: continues from ckpt_path="last"; diverge (zero3): from step 3 on, rank 1 alone runs the first Linear
twice per step, a gather the schedule agreed in the first step does not have. Rank 0 writes DIR/final.pt (full
weights) when training completes; every rank writes DIR/point_rank{R}.json: where its fit started (global step,
epoch, batch index at its first batch) and how many optimizer steps it took (tests/scenarios.py ``ResumePoint``).
A rank whose fit raises prints ``RANK{R} FAILURE {json}`` first: the exception that ended its fit (type, message),
its cause's, the step it was in and the seconds since that step's first batch started on this rank (its own clock).
"""

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_shard.strategies import Zero2Strategy, Zero3Strategy  # noqa: E402
from tests.scenarios import ResumePoint  # noqa: E402


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, i):
        x, y = batch
        out = self.net(x)
        if getattr(self, "diverge", False) and self.trainer.global_rank == 1 and self.trainer.global_step >= 3:
            out = out + 0.0 * self.net[0](x).sum()  # data-dependent extra call, on one rank only
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


TIMEOUT_S = 10  # the collective timeout (safety.timeout_s)


class Trouble(L.Callback):
    def __init__(self, mode):
        self.mode = mode
        self.step_started = {}  # optimizer step -> time.monotonic() at its first batch on this rank

    def on_train_batch_start(self, trainer, *args):
        self.step_started.setdefault(trainer.global_step, time.monotonic())
        print(f"RANK{trainer.global_rank} STEP {trainer.global_step}", flush=True)  # training has started
        if trainer.global_rank != 1:
            return
        if self.mode == "kill" and trainer.global_step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "sleep" and trainer.global_step == 3:
            time.sleep(300)


def main(mode, out):
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g))  # 2 steps per epoch
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, save_last=True)
    strategy = (Zero3Strategy if mode == "diverge" else Zero2Strategy)(safety={"timeout_s": TIMEOUT_S})
    point, trouble = ResumePoint(), Trouble(mode)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=8,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ckpt, trouble, point])
    module = Net()
    module.diverge = mode == "diverge"
    try:
        trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path="last" if mode == "resume" else None)
    except Exception as err:
        step, cause = trainer.global_step, err.__cause__
        print(f"RANK{trainer.global_rank} FAILURE " + json.dumps({
            "type": type(err).__name__, "error": str(err), "cause_type": type(cause).__name__, "cause": str(cause),
            "step": step, "since_step_start_s": time.monotonic() - trouble.step_started.get(step, float("nan")),
            "timeout_s": TIMEOUT_S}), flush=True)
        raise
    with open(os.path.join(out, f"point_rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"first": point.first, "steps_taken": point.steps_taken}, f)
    state = trainer.strategy.full_state_dict()
    if trainer.global_rank == 0:
        torch.save(state, os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
