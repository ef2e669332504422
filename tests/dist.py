"""Spawn gloo process groups for multi-rank tests."""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=60)  # a hang fails the test instead of stalling CI


def _entry(rank, world, init_file, fn, args, timeout):
    from fast_interpreter import install

    install()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)
    try:
        fn(rank, world, *args)
        dist.barrier()  # leave together: tearing gloo down while a peer still talks can abort the peer
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, *args, timeout: datetime.timedelta = TIMEOUT) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (group ``timeout``); re-raises a rank's exception."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_entry, args=(world, init_file, fn, args, timeout), nprocs=world, join=True)


def load_ranks(out_dir: str, world: int) -> list:
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def save_rank(out_dir: str, rank: int, obj) -> None:
    torch.save(obj, os.path.join(out_dir, f"rank{rank}.pt"))


@contextlib.contextmanager
def backend_env(name: str):
    """Set TRITONBN_BACKEND (inherited by spawned ranks) for a block wider than a test, then restore it."""
    old = os.environ.get("TRITONBN_BACKEND")
    os.environ["TRITONBN_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITONBN_BACKEND", None)
        else:
            os.environ["TRITONBN_BACKEND"] = old
