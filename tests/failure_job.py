"""A 2-rank training job for the failure tests, launched by Lightning's default (popen) launcher.

    python tests/failure_job.py MODE DIR     MODE: straight | kill | sleep | resume

kill: rank 1 SIGKILLs itself at step 5; sleep: rank 1 stalls for 300 s at step 3 (collective timeout 10 s);
resume: continues from ckpt_path="last". Rank 0 writes DIR/final.pt (full weights) when training completes.
"""

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

from lightning_shard.strategies import Zero2Strategy  # noqa: E402


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Trouble(L.Callback):
    def __init__(self, mode):
        self.mode = mode

    def on_train_batch_start(self, trainer, *args):
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
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=Zero2Strategy(timeout_s=10), max_steps=8,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ckpt, Trouble(mode)])
    module = Net()
    trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path="last" if mode == "resume" else None)
    state = trainer.strategy.full_state_dict()
    if trainer.global_rank == 0:
        torch.save(state, os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
