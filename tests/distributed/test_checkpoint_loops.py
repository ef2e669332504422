"""Activation checkpointing over 2 gloo ranks, both backends: one collective per pass, as without checkpointing.

Each loop runs two training steps of a small model in which tritonbn layers are checkpointed one way or another.
Every rank counts the ``all_reduce`` calls it makes per step (the Triton kernels' and the PyTorch backend's packed
path make one per pass) and keeps the step's outputs, gradients and buffers. A loop must match its reference step,
the same model without checkpointing, in the count and bitwise in everything else.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as cp
from compilers import NO_CXX
from dist import backend_env, load_ranks, save_rank, spawn
from torch import nn

import tritonbn

pytestmark = pytest.mark.distributed

WORLD = 2


class Net(nn.Module):
    """conv -> bn -> relu -> conv -> bn -> relu -> bn, the last layer ``shared`` applied again at the end (``twice``:
    accumulate_stats pools only layers called equally often)."""

    def __init__(self, twice=True):
        super().__init__()
        self.twice = twice
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Conv1d(3, 4, 3), tritonbn.SyncBatchNorm(4), nn.ReLU())
        self.b = nn.Sequential(nn.Conv1d(4, 4, 1), tritonbn.SyncBatchNorm(4, momentum=None), nn.ReLU())
        self.shared = tritonbn.SyncBatchNorm(4)
        tritonbn.convert_sync_batchnorm(self)  # names the layers

    def forward(self, x, how=None):
        run = how or (lambda f, *args: f(*args))
        y = run(self.a, x)
        y = run(self._tail, y)
        return y

    def _tail(self, y):
        y = self.shared(self.b(y))
        return self.shared(y * 0.5 + 1) if self.twice else y  # the same layer twice in one segment


def _plain(net, x):
    return net(x)


def _nonreentrant(net, x):
    return net(x, lambda f, *a: cp.checkpoint(f, *a, use_reentrant=False))


def _reentrant(net, x):
    return net(x, lambda f, *a: cp.checkpoint(f, *a, use_reentrant=True))


def _whole(net, x):  # one segment around both calls of the shared layer and everything else
    return cp.checkpoint(net, x, use_reentrant=False)


def _sequential(reentrant):
    def loop(net, x):
        seq = nn.Sequential(net.a, net.b, net.shared)
        y = cp.checkpoint_sequential(seq, 2, x, use_reentrant=reentrant)
        return net.shared(y * 0.5 + 1) if net.twice else y

    return loop


def _selective(policy):
    def loop(net, x):
        context = functools.partial(cp.create_selective_checkpoint_contexts, policy)
        return net(x, lambda f, *a: cp.checkpoint(f, *a, use_reentrant=False, context_fn=context))

    return loop


def _recompute_all(ctx, op, *args, **kwargs):
    return cp.CheckpointPolicy.PREFER_RECOMPUTE


def _save_bn(ctx, op, *args, **kwargs):
    if op is torch.ops.tritonbn.batch_norm_forward.default:
        return cp.CheckpointPolicy.MUST_SAVE
    return cp.CheckpointPolicy.PREFER_RECOMPUTE


class Compiled(nn.Module):
    """A module whose forward checkpoints, compiled whole (``fullgraph``)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return _nonreentrant(self.net, x)


def _compiled(backend, checkpointed=True):
    def loop(net, x):
        cache = net.__dict__.setdefault("_compiled", {})
        if (backend, checkpointed) not in cache:
            module = Compiled(net) if checkpointed else net
            cache[backend, checkpointed] = torch.compile(module, fullgraph=True, backend=backend)
        return cache[backend, checkpointed](x)

    return loop


def _micro_batches(loop):
    """Two micro-batches through the loop, then one backward of both."""

    def run(net, x):
        return torch.cat([loop(net, half) for half in x.chunk(2)])

    return run


LOOPS = {
    "nonreentrant": (_nonreentrant, "plain"),
    "reentrant": (_reentrant, "plain"),
    "whole": (_whole, "plain"),
    "sequential": (_sequential(False), "plain"),
    "sequential_reentrant": (_sequential(True), "plain"),
    "selective_recompute": (_selective(_recompute_all), "plain"),
    "selective_save_bn": (_selective(_save_bn), "plain"),
    "selective_list": (_selective([torch.ops.aten.convolution.default]), "plain"),
    "micro_nonreentrant": (_micro_batches(_nonreentrant), "micro_plain"),
    "micro_reentrant": (_micro_batches(_reentrant), "micro_plain"),
    "compiled": (_compiled("aot_eager"), "compiled_plain"),
}
REFERENCES = {
    "plain": _plain,
    "micro_plain": _micro_batches(_plain),
    "compiled_plain": _compiled("aot_eager", checkpointed=False),
}
if not NO_CXX:
    LOOPS["compiled_inductor"] = (_compiled("inductor"), "compiled_inductor_plain")
    REFERENCES["compiled_inductor_plain"] = _compiled("inductor", checkpointed=False)


def _batch(rank, step):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 3, 6, generator=g) * (1 + step) + 2


def _run(loop, rank, calls, accumulate=False):
    net = Net(twice=not accumulate)
    steps = []
    weights = torch.linspace(-1, 1, 4 * 4 * 4).reshape(4, 4, 4)
    for step in range(2):
        x = _batch(rank, step).requires_grad_()
        calls.clear()
        if accumulate:
            with tritonbn.accumulate_stats(net):
                y = loop(net, x)
                (y * weights).sum().backward()
        else:
            y = loop(net, x)
            (y * weights).sum().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        steps.append({"calls": list(calls), "y": y.detach(), "dx": x.grad, "grads": grads,
                      "buffers": [b.clone() for b in net.buffers()]})  # fmt: skip
        net.zero_grad()
    return steps


def _rank(rank, world, out_dir, names, debug, accumulate):
    if debug:
        os.environ["TRITONBN_DEBUG"] = "1"
    calls = []
    reduce = dist.all_reduce

    def logged(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return reduce(tensor, *args, **kwargs)

    dist.all_reduce = logged
    results = {}
    for name in names:
        loop, reference = LOOPS[name]
        results[reference] = results.get(reference) or _run(REFERENCES[reference], rank, calls, accumulate)
        results[name] = _run(loop, rank, calls, accumulate)
    save_rank(out_dir, rank, results)


# Reentrant checkpointing runs a nested backward per segment, which adds a parameter's gradient contributions from
# several micro-batches in another order than one backward does (the shared layer's weight and bias: 4 calls). That is
# torch's, with or without tritonbn's replay; those gradients agree to rounding.
REORDERED = {"micro_reentrant"}


def _check(results, names):
    for name in names:
        reference = LOOPS[name][1]
        for r, ranks in enumerate(results):
            for step, (got, want) in enumerate(zip(ranks[name], ranks[reference], strict=True)):
                where = f"{name}, rank {r}, step {step}"
                assert got["calls"] == want["calls"], f"{where}: all_reduce sizes {got['calls']} != {want['calls']}"
                assert torch.equal(got["y"], want["y"]), where
                assert torch.equal(got["dx"], want["dx"]), where
                for a, b in zip(got["buffers"], want["buffers"], strict=True):
                    assert torch.equal(a, b), where
                for a, b in zip(got["grads"], want["grads"], strict=True):
                    if name in REORDERED:
                        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=where)
                    else:
                        assert torch.equal(a, b), where


def _spawn(backend, names, debug=False, accumulate=False):
    with backend_env(backend), tempfile.TemporaryDirectory() as out_dir:
        spawn(WORLD, _rank, out_dir, names, debug, accumulate)
        return load_ranks(out_dir, WORLD)


# The property (one collective per pass, a replay bitwise equal to the first forward) lives above the backend: every
# loop runs on the PyTorch backend, and the kernels (under the interpreter) take one loop per checkpoint mechanism,
# the ledger on a checkpoint frame (non-reentrant) and on the Function that recomputes (reentrant).
KERNEL_LOOPS = ["nonreentrant", "reentrant"]


EAGER = [n for n in LOOPS if not n.startswith("compiled")]
# aot_eager's partitioner (the default one); inductor's (min-cut rematerialization) decides what a compiled checkpoint
# recomputes in its own way: its C++ build (20-30 s here) runs in CI's compile sweep.
INDUCTOR = [] if NO_CXX else [pytest.param("torch", ["compiled_inductor"], id="torch-inductor",
                                           marks=pytest.mark.compile_sweep)]  # fmt: skip


@pytest.mark.parametrize(
    "backend, names",
    [pytest.param("torch", EAGER, id="torch-eager"), pytest.param("torch", ["compiled"], id="torch-compiled"),
     *INDUCTOR, pytest.param("triton", KERNEL_LOOPS, id="triton")],
)  # fmt: skip
def test_one_collective_per_pass(backend, names):
    results = _spawn(backend, names)
    _check(results, names)
    reference = LOOPS[names[0]][1]  # the loops' first reference: the same model, not checkpointed
    calls = results[0][reference][0]["calls"]
    assert len(calls) == 2 * 4, calls  # 4 calls of tritonbn layers per step, one all-reduce per pass each
    if "micro_plain" in results[0]:
        assert len(results[0]["micro_plain"][0]["calls"]) == 2 * 2 * 4


DEBUG_LOOPS = ["nonreentrant", "reentrant", "selective_recompute", "micro_nonreentrant", "compiled"]


@pytest.mark.parametrize("backend, names", [("torch", DEBUG_LOOPS), ("triton", ["reentrant"])], ids=["torch", "triton"])
def test_debug_mode(backend, names):
    """With TRITONBN_DEBUG=1 a recompute that replays makes no signature check either (a collective): every rank
    skips it alike, and the counts still match."""
    _check(_spawn(backend, names, debug=True), names)


ACCUMULATE_LOOPS = ["nonreentrant", "reentrant", "micro_nonreentrant", "micro_reentrant"]


@pytest.mark.parametrize("backend, names", [("torch", ACCUMULATE_LOOPS), ("triton", ["micro_reentrant"])],
                         ids=["torch", "triton"])  # fmt: skip
def test_accumulate_stats(backend, names):
    """Under accumulate_stats (eager only: no selective checkpointing's dispatch modes) a recompute adds nothing."""
    _check(_spawn(backend, names, accumulate=True), names)


# --- recomputes that do not replay their forward ---------------------------------------------------------------


def _stale(case, rank):
    """One step whose recompute differs from its forward, as ``case`` says; returns the error message or None."""
    torch.manual_seed(rank)
    bn = tritonbn.SyncBatchNorm(4)
    drop = nn.Dropout(0.5)
    seen = []

    def segment(x):
        seen.append(1)
        if case == "shape" and len(seen) > 1:
            x = x[:, :, 1:]  # the recompute takes another slice
        if case == "values" or (case == "values_rank0" and rank == 0):
            x = drop(x)  # a random layer, without checkpoint's RNG preservation
        return bn(x)

    x = torch.randn(3, 4, 6, requires_grad=True)
    try:
        y = cp.checkpoint(segment, x, use_reentrant=False, preserve_rng_state=False, determinism_check="none")
        if case == "weight":
            with torch.no_grad():
                bn.weight.mul_(2)  # an optimizer step between the forward and its backward
        y.square().sum().backward()
        bn(torch.randn(3, 4, 6)).sum().backward()  # the next step's forward (a signature check under debug)
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(error).__name__}: {error}"
    return None


def _rank_stale(rank, world, out_dir, cases, debug):
    if debug:
        os.environ["TRITONBN_DEBUG"] = "1"
    save_rank(out_dir, rank, {case: _stale(case, rank) for case in cases})


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_recompute_that_does_not_replay_raises(backend):
    """On CPU a recompute compares this rank's sums with its forward's (no synchronization to pay); shapes, dtypes
    and the layer's parameters everywhere. Each rank that sees a difference raises, naming tritonbn and the layer."""
    cases = ["shape", "values", "weight"]
    with backend_env(backend), tempfile.TemporaryDirectory() as out_dir:
        spawn(WORLD, _rank_stale, out_dir, cases, False)
        ranks = load_ranks(out_dir, WORLD)
    for case, what in (("shape", "its input is"), ("values", "values differ"), ("weight", "weight or bias changed")):
        for r in ranks:
            assert r[case] is not None and "tritonbn" in r[case] and what in r[case], (case, r[case])


def test_debug_mode_raises_on_every_rank():
    """With TRITONBN_DEBUG=1 the rank whose recompute differs raises at its next signature check, with the others."""
    with backend_env("torch"), tempfile.TemporaryDirectory() as out_dir:
        spawn(WORLD, _rank_stale, out_dir, ["values_rank0"], True)
        r0, r1 = (r["values_rank0"] for r in load_ranks(out_dir, WORLD))
    assert r0 is not None and "values differ" in r0, r0
    assert r1 is not None and r1.startswith("RemoteInputError") and "rank 0" in r1, r1
