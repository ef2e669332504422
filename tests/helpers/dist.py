"""Spawn gloo process groups for multi-rank tests.

Spawning ranks costs seconds (each imports torch, Triton and tritonbn, then joins a gloo group), often more than
the test's own work. So by default (``tests/conftest.py``'s ``rank_pools`` fixture) the ranks of one world size
are spawned once per test session (per xdist worker) and kept: :func:`spawn` hands each ``fn`` to them, and they
run it in their process group as a fresh spawn would, with the test process's environment and ``sys.path``.
Each run starts with torch's random generator as a fresh process has it. Between two runs a rank puts back what a
run may have changed: the environment and ``sys.path``,
``torch.distributed``'s functions (tests wrap ``all_reduce`` to count it), warning filters, torch's thread count,
default dtype and grad mode, and torch.compile's caches. A run that fails, or a rank that dies,
closes the pool: the next run starts fresh ranks. A run with a ``timeout`` of its own spawns fresh ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
import warnings

import fast_interpreter
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tritonbn.cli import _spawn

TIMEOUT = datetime.timedelta(seconds=60)  # a hang fails the test instead of stalling CI
_POOLS: dict[int, RankPool] | None = None  # world size -> ranks kept alive, while a module's fixture allows it


def spawn(world: int, fn, *args, timeout: datetime.timedelta = TIMEOUT) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (group ``timeout``); re-raises a rank's exception."""
    if _POOLS is None or timeout != TIMEOUT:
        _spawn.spawn(world, fn, *args, timeout=timeout, setup=fast_interpreter.install)
        return
    pool = _POOLS.get(world)
    if pool is None:
        pool = _POOLS[world] = RankPool(world)
    try:
        pool.run(fn, args)
    except BaseException:
        _POOLS.pop(world).close()
        raise


@contextlib.contextmanager
def pooled():
    """Within the block, :func:`spawn` keeps the ranks of each world size alive between runs."""
    global _POOLS
    outer, _POOLS = _POOLS, {}
    try:
        yield
    finally:
        pools, _POOLS = _POOLS, outer
        for pool in pools.values():
            pool.close()


class RankPool:
    """``world`` spawned processes in one gloo group, each running what :meth:`run` sends it, in order."""

    def __init__(self, world: int) -> None:
        context = mp.get_context("spawn")
        self.world = world
        self._dir = tempfile.TemporaryDirectory()
        init = os.path.join(self._dir.name, "init")
        self._inboxes = [context.SimpleQueue() for _ in range(world)]
        self._outbox = context.Queue()
        self._procs = [context.Process(target=_serve, args=(rank, world, init, self._inboxes[rank], self._outbox),
                                       daemon=True) for rank in range(world)]  # fmt: skip
        for p in self._procs:
            p.start()

    def run(self, fn, args: tuple) -> None:
        env = dict(os.environ)  # backend_env and the tests' settings, as a fresh spawn would inherit them
        # fn and args are unpickled in the rank after it takes this sys.path: the path pytest gave the test's module
        task = (pickle.dumps((fn, args)), env, list(sys.path))
        for inbox in self._inboxes:
            inbox.put(task)
        errors = {}
        deadline = time.monotonic() + 3 * TIMEOUT.total_seconds()
        for _ in range(self.world):
            while True:
                try:
                    rank, error = self._outbox.get(timeout=0.5)
                    break
                except queue.Empty:
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                    if dead:
                        raise RuntimeError(
                            f"pooled rank {dead[0]} exited (code {self._procs[dead[0]].exitcode})"
                        ) from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"pooled ranks did not finish {fn.__name__} in time") from None
            if error is not None:
                errors[rank] = error
        if errors:
            rank = min(errors)
            raise RuntimeError(f"rank {rank} of {self.world} failed in {fn.__name__}:\n{errors[rank]}")

    def close(self) -> None:
        if all(p.is_alive() for p in self._procs):
            for inbox in self._inboxes:
                inbox.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._dir.cleanup()


def _serve(rank: int, world: int, init: str, inbox, outbox) -> None:
    fast_interpreter.install()
    torch.set_num_threads(1)
    env, functions, base_path = dict(os.environ), dict(vars(dist)), list(sys.path)
    filters, dtype, seed = list(warnings.filters), torch.get_default_dtype(), torch.initial_seed()
    with _spawn.process_group(torch.device("cpu"), TIMEOUT, init_method=f"file://{init}", rank=rank, world_size=world):
        while (task := inbox.get()) is not None:
            error = None
            try:
                payload, task_env, path = task
                os.environ.clear()
                os.environ.update(task_env)
                sys.path[:] = path
                torch.manual_seed(seed)  # the generator as a fresh process has it: the same on every rank
                fn, args = pickle.loads(payload)
                fn(rank, world, *args)
            except BaseException:  # noqa: BLE001 - the parent raises it
                error = traceback.format_exc()
            finally:  # what a run may have changed, put back for the next one
                os.environ.clear()
                os.environ.update(env)
                sys.path[:] = base_path
                for name, value in functions.items():
                    if getattr(dist, name, None) is not value:
                        setattr(dist, name, value)
                warnings.filters[:] = filters
                torch.set_num_threads(1)
                torch.set_default_dtype(dtype)
                torch.set_grad_enabled(True)
                if "torch._dynamo" in sys.modules:
                    torch._dynamo.reset()
            outbox.put((rank, error))  # after an error the parent closes the pool: the group may be broken
    # The group is left and every result was taken: exit without the interpreter's teardown of torch (about half a
    # second a process, on the critical path at the end of each xdist worker).
    os._exit(0)


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
