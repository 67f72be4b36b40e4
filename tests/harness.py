"""A persistent world of N forked ranks (gloo on CPU) that runs many scenarios in one process group.

Starting ranks costs seconds, so each test module starts one :class:`World` (a module-scoped fixture) and
sends it scenario functions by name. Each rank has the environment variables torchrun would set, so a
Lightning ``Trainer`` inside a scenario joins the existing group instead of launching processes.
Results travel back pickled (tensors are copied, not shared). A scenario that hangs fails the test after
``timeout`` seconds and the world is torn down.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import socket
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator

READY = "ready"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn: Any, nodes: int = 1, parent_end: Any = None) -> None:
    if parent_end is not None:  # the fork copied the parent's end of our pipe: close it, so that the parent's death
        parent_end.close()  # reads as EOF below instead of leaving this rank waiting forever
    local = world // nodes  # node-major numbering, as torchrun and SLURM do
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank % local),
                      WORLD_SIZE=str(world), NODE_RANK=str(rank // local), LOCAL_WORLD_SIZE=str(local),
                      OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from lightning_shard.engine.comm import collectives as C

    C.init_process_group("gloo", rank, world, f"tcp://127.0.0.1:{port}", timedelta(seconds=120))
    conn.send_bytes(pickle.dumps((True, READY)))
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:  # the test process is gone (killed, timed out): nobody will close this world
            os._exit(3)
        if msg is None:
            break
        module, name, args, kwargs = msg
        try:
            fn = getattr(importlib.import_module(module), name)
            out = (True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
            out = (False, f"rank {rank}:\n{traceback.format_exc()}")
        try:
            conn.send_bytes(pickle.dumps(out))
        except Exception:  # unpicklable result
            conn.send_bytes(pickle.dumps((False, f"rank {rank}: result not picklable\n{traceback.format_exc()}")))
    C.destroy_process_group()


class World:
    def __init__(self, size: int, timeout: float = 300.0, nodes: int = 1) -> None:
        """``nodes`` > 1 simulates several nodes on this machine through the env vars torchrun would set."""
        if size % nodes:
            raise ValueError(f"{size} ranks cannot be split over {nodes} nodes")
        self.size, self.timeout = size, timeout
        ctx = mp.get_context("fork")
        port = free_port()
        self.conns, self.procs = [], []
        for r in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, size, port, child, nodes, parent), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect()

    def _collect(self) -> list[Any]:
        results, errors = [], []
        for r, c in enumerate(self.conns):
            if not c.poll(self.timeout):
                self.close(force=True)
                raise TimeoutError(f"rank {r} gave no answer within {self.timeout}s (hang or deadlock)")
            ok, val = pickle.loads(c.recv_bytes())
            (results if ok else errors).append(val)
        if errors:
            raise RuntimeError("scenario failed:\n" + "\n".join(errors))
        return results

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run module-level ``fn(*args, **kwargs)`` on every rank; returns the per-rank results."""
        for c in self.conns:
            c.send_bytes(pickle.dumps((fn.__module__, fn.__name__, args, kwargs)))
        return self._collect()

    def run_each(self, fn: Callable, *args: Any, **kwargs: Any) -> list[tuple[str, Any]]:
        """Like :meth:`run`, for a scenario in which ranks fail or die: every rank's outcome instead of the first
        failure: ``("ok", result)``, ``("error", traceback)``, ``("died", exit code)`` (its process ended without
        answering) or ``("silent", None)`` (alive, no answer within ``timeout``). Close the world with
        ``force=True`` after a rank died."""
        for c in self.conns:
            c.send_bytes(pickle.dumps((fn.__module__, fn.__name__, args, kwargs)))
        outcomes: list[tuple[str, Any]] = []
        for c, p in zip(self.conns, self.procs):
            if not c.poll(self.timeout):
                outcomes.append(("silent", None))
                continue
            try:
                ok, val = pickle.loads(c.recv_bytes())
            except EOFError:  # the pipe's other end closed: the rank's process is gone
                p.join(30)
                outcomes.append(("died", p.exitcode))
                continue
            outcomes.append(("ok" if ok else "error", val))
        return outcomes

    def close(self, force: bool = False) -> None:
        for c in self.conns:
            try:
                if not force:
                    c.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()


@contextmanager
def fresh_world(size: int, nodes: int = 1, force_close: bool = False) -> Iterator[World]:
    """A World of its own for one test (a crash, a wrong world size, a simulated second node), closed after it;
    the other tests share the per-module ``worlds(n)`` fixture of conftest.py. ``force_close``: after a test
    that killed a rank."""
    w = World(size, nodes=nodes)
    try:
        yield w
    finally:
        w.close(force=force_close)
