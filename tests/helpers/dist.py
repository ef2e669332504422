"""Spawn gloo process groups for multi-rank tests."""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

import fast_interpreter
import torch
import torch.distributed as dist

from tritonbn.cli import _spawn

TIMEOUT = datetime.timedelta(seconds=60)  # a hang fails the test instead of stalling CI


def spawn(world: int, fn, *args, timeout: datetime.timedelta = TIMEOUT) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (group ``timeout``); re-raises a rank's exception."""
    _spawn.spawn(world, fn, *args, timeout=timeout, setup=fast_interpreter.install)


def run_ranks(world: int, fn, backend: str) -> list:
    """``fn(rank, world, out_dir)`` on ``world`` gloo ranks with ``TRITONBN_BACKEND=backend``: what each saved."""
    with backend_env(backend), tempfile.TemporaryDirectory() as out_dir:
        spawn(world, fn, out_dir)
        return load_ranks(out_dir, world)


def load_ranks(out_dir: str, world: int) -> list:
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def save_rank(out_dir: str, rank: int, obj) -> None:
    torch.save(obj, os.path.join(out_dir, f"rank{rank}.pt"))


def count_all_reduces() -> list[int]:
    """From now on in this process, record the size of every ``dist.all_reduce``: the list it returns grows."""
    sizes: list[int] = []
    reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    return sizes


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
