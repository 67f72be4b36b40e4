"""Test set-up shared by every module: one thread per process (2 cores), quiet Lightning."""

import logging
import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def worlds():
    """``worlds(n)``: a persistent World of n gloo ranks, started once per test module on first use."""
    from tests.harness import World

    made: dict = {}

    def get(n: int) -> World:
        if n not in made:
            made[n] = World(n)
        return made[n]

    yield get
    for w in made.values():
        w.close()
