"""Processes in a process group: the one helper that the CLI, the benchmarks and the tests spawn ranks with."""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=120)


@contextlib.contextmanager
def process_group(device: torch.device, timeout: datetime.timedelta = TIMEOUT, **init):
    """Join the default process group for ``device`` (NCCL on CUDA, else gloo), and leave it at the end.

    ``init`` goes to ``torch.distributed.init_process_group`` (``init_method``, ``rank``, ``world_size``;
    none of them under torchrun). The ranks leave together, through a barrier, when the block succeeds: a
    rank that tears gloo down while a peer still talks can abort the peer.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout, **init)
    try:
        yield dist.group.WORLD
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(
    world: int,
    fn,
    *args,
    cuda: bool = False,
    timeout: datetime.timedelta = TIMEOUT,
    threads: int = 1,
    setup=None,
    start_method: str = "spawn",
) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes, each a rank of one process group.

    Rank ``r`` runs on ``cuda:r`` when ``cuda``, else on the CPU over gloo, with ``threads`` torch
    threads, after ``setup()`` when given (a module-level function: it is pickled). An exception in a
    rank is raised here.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(
            _entry,
            args=(world, init_file, fn, args, cuda, timeout, threads, setup),
            nprocs=world,
            join=True,
            start_method=start_method,
        )


def _entry(rank, world, init_file, fn, args, cuda, timeout, threads, setup):
    if setup is not None:
        setup()
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    with process_group(device, timeout, init_method=f"file://{init_file}", rank=rank, world_size=world):
        fn(rank, world, *args)
