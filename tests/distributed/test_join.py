"""tritonbn.join: ranks with different numbers of batches, against one process in float64, every step.

At step ``s`` the ranks that still hold a batch train; the oracle runs their batches' concatenation through the same
two BatchNorms (the second with ``momentum=None``) in float64, one running-statistics update per step. Every active
rank's output and input gradient, and its buffers after the step, must match the oracle's; at the end every rank,
joined ones included, holds the oracle's buffers. Under DDP the parameters take SGD steps on the gradients DDP
averages over the initial world size (Join's default) or, with ``divide_by_initial_world_size=False``, over the ranks
still training, and every rank ends with the same parameters. ``enable=False`` and ``throw_on_early_termination=True``
behave as under ``Join([ddp])``. A hang fails the test: the ranks' process group, and the group tritonbn.join makes
from it, time out.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn.functional as F
from dist import backend_env, load_ranks, save_rank, spawn
from oracle import PARAM_GRAD_TOL, TOLERANCES
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tritonbn

pytestmark = pytest.mark.distributed

C, LR = 4, 0.1


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(tritonbn.SyncBatchNorm(C), tritonbn.SyncBatchNorm(C, momentum=None))
    with torch.no_grad():
        model[0].weight.copy_(torch.linspace(0.5, 1.5, C))
        model[1].bias.copy_(torch.linspace(-1, 1, C))
    return model


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = 1 + (rank + step) % 3
    x = torch.randn(n, C, 5, generator=g, dtype=torch.float64) * (1 + rank) + step
    return x.float(), torch.randn(n, C, 5, generator=g)


def _rank(rank, world, out_dir, batches, wrap, broadcast_buffers):
    save_rank(out_dir, rank, _run(rank, batches, wrap, broadcast_buffers, {}))


def _run(rank, batches, wrap, broadcast_buffers, join_kwargs):
    """This rank's outputs, input gradients and buffers at each step of a ``tritonbn.join`` block, and at its end."""
    model = _model()
    net = DistributedDataParallel(model, broadcast_buffers=broadcast_buffers) if wrap else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR) if wrap else None
    steps, error = [], None
    try:
        with tritonbn.join(net, **join_kwargs):
            for step in range(batches[rank]):
                x, dy = _batch(rank, step)
                x.requires_grad_()
                y = net(x)
                y.backward(dy)
                steps.append({"y": y.detach(), "dx": x.grad, "buffers": [b.clone() for b in model.buffers()]})
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad()
    except RuntimeError as e:  # throw_on_early_termination=True: every rank raises once one has run out
        if not join_kwargs.get("throw_on_early_termination"):
            raise
        error = str(e)
    final = {
        "buffers": [b.clone() for b in model.buffers()],
        "params": [p.detach().clone() for p in model.parameters()],
    }
    return {"steps": steps, "final": final, "error": error}


def _oracle(batches, world, wrap, divide_by_initial_world_size=True):
    """Per step: ``{rank: (y, dx)}`` and the buffers after it; the final parameters. DDP's gradients are the sum of
    the ranks' over the initial world size, or with ``divide_by_initial_world_size=False`` over the active ranks."""
    model = _model()
    w = [m.weight.detach().double().clone() for m in model]
    b = [m.bias.detach().double().clone() for m in model]
    rm = [torch.zeros(C, dtype=torch.float64) for _ in model]
    rv = [torch.ones(C, dtype=torch.float64) for _ in model]
    out = []
    for step in range(max(batches)):
        active = [r for r in range(world) if batches[r] > step]
        data = [_batch(r, step) for r in active]
        x = torch.cat([d[0] for d in data]).double().requires_grad_()
        ws = [t.clone().requires_grad_() for t in w]
        bs = [t.clone().requires_grad_() for t in b]
        y = F.batch_norm(x, rm[0], rv[0], ws[0], bs[0], True, 0.1, 1e-5)
        y = F.batch_norm(y, rm[1], rv[1], ws[1], bs[1], True, 1.0 / (step + 1), 1e-5)  # momentum=None: 1 / count
        grads = torch.autograd.grad(y, [x, *ws, *bs], torch.cat([d[1] for d in data]).double())
        sizes = [d[0].shape[0] for d in data]
        per_rank = dict(zip(active, zip(y.detach().split(sizes), grads[0].split(sizes), strict=True), strict=True))
        out.append((per_rank, [rm[0].clone(), rv[0].clone(), rm[1].clone(), rv[1].clone()], step + 1))
        if wrap:  # DDP: the sum of the ranks' gradients over the initial world size (or the active ranks), then SGD
            ranks = world if divide_by_initial_world_size else len(active)
            w = [t - LR * g / ranks for t, g in zip(w, grads[1:3], strict=True)]
            b = [t - LR * g / ranks for t, g in zip(b, grads[3:5], strict=True)]
    return out, [p for pair in zip(w, b, strict=True) for p in pair]


def _check(ranks, batches, wrap, join_kwargs):
    world = len(batches)
    if join_kwargs.get("throw_on_early_termination"):  # the steps until the first rank ran out, then every rank raises
        _check_thrown(ranks, batches, wrap)
        return
    oracle, params = _oracle(batches, world, wrap, join_kwargs.get("divide_by_initial_world_size", True))
    tol = TOLERANCES[torch.float32]

    def same_buffers(got, want, count, where):
        mean0, var0, n0, mean1, var1, n1 = got
        for a, e in zip((mean0, var0, mean1, var1), want, strict=True):
            torch.testing.assert_close(a.double(), e, atol=1e-5, rtol=1e-5, msg=where)
        assert n0.item() == n1.item() == count, (where, n0, n1, count)

    for step, (per_rank, buffers, count) in enumerate(oracle):
        for rank, (y, dx) in per_rank.items():
            got = ranks[rank]["steps"][step]
            where = f"rank {rank}, step {step}"
            torch.testing.assert_close(got["y"].double(), y, atol=tol[0], rtol=tol[1], msg=where)
            torch.testing.assert_close(got["dx"].double(), dx, atol=tol[0], rtol=tol[1], msg=where)
            same_buffers(got["buffers"], buffers, count, where)
    for rank, r in enumerate(ranks):
        same_buffers(r["final"]["buffers"], oracle[-1][1], oracle[-1][2], f"rank {rank}, at the end")
        for a, other in zip(r["final"]["buffers"], ranks[0]["final"]["buffers"], strict=True):
            assert torch.equal(a, other), f"rank {rank}'s buffers differ from rank 0's"
        if wrap:
            for a, e, other in zip(r["final"]["params"], params, ranks[0]["final"]["params"], strict=True):
                torch.testing.assert_close(a.double(), e, atol=PARAM_GRAD_TOL[torch.float32][0], rtol=1e-5)
                assert torch.equal(a, other), f"rank {rank}'s parameters differ from rank 0's"


def _check_thrown(ranks, batches, wrap):
    """``throw_on_early_termination=True``: every rank ran the steps before the first rank ran out (each as the
    oracle's), then raised torch's error (the rank that ran out: "exhausted all inputs"), and none hung."""
    first = min(batches)
    oracle, _ = _oracle([first] * len(batches), len(batches), wrap)
    for rank, r in enumerate(ranks):
        assert len(r["steps"]) == first, (rank, len(r["steps"]))
        want = "exhausted all inputs" if batches[rank] == first else "exhausted inputs"
        assert r["error"] is not None and want in r["error"], (rank, r["error"])
        for step, (per_rank, _, _) in enumerate(oracle):
            y, dx = per_rank[rank]
            torch.testing.assert_close(r["steps"][step]["y"].double(), y, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(r["steps"][step]["dx"].double(), dx, atol=1e-5, rtol=1e-5)


CASES = {
    "3_ranks_3_5_4_ddp": ([3, 5, 4], True, True),
    "3_ranks_3_5_4_ddp_no_broadcast": ([3, 5, 4], True, False),
    "3_ranks_3_5_4_plain": ([3, 5, 4], False, False),
    "2_ranks_0_2_ddp": ([0, 2], True, True),
    "2_ranks_0_2_plain": ([0, 2], False, False),
    "2_ranks_2_2_ddp": ([2, 2], True, True),  # nobody joins early: the block ends as it began
}


# Every case on the PyTorch backend; two on the kernels, since the Triton interpreter is slow.
RUNS = [("torch", case) for case in CASES] + [("triton", "3_ranks_3_5_4_ddp"), ("triton", "2_ranks_0_2_plain")]


@pytest.mark.parametrize(("backend", "case"), RUNS)
def test_join_matches_one_process(backend, case):
    batches, wrap, broadcast_buffers = CASES[case]
    with backend_env(backend), tempfile.TemporaryDirectory() as out_dir:
        spawn(len(batches), _rank, out_dir, batches, wrap, broadcast_buffers)
        ranks = load_ranks(out_dir, len(batches))
    _check(ranks, batches, wrap, {})


NOT_INITIAL = {"divide_by_initial_world_size": False}
OPTIONS = {  # name: (batches per rank, DDP, broadcast_buffers, Join's keyword arguments), one block after another
    # DDP divides the gradients by the ranks still training, as under Join([ddp], divide_by_initial_world_size=False)
    "3_5_4_ddp_divide_by_active": ([3, 5, 4], True, True, NOT_INITIAL),
    "3_0_5_ddp_divide_by_active": ([3, 0, 5], True, False, NOT_INITIAL),  # a rank with no batch at all
    "3_0_5_ddp_divide_by_initial": ([3, 0, 5], True, True, {"divide_by_initial_world_size": True}),
    # Join off (even batches: nothing to join), then every rank raising once one has run out (last: the blocks end
    # in an error)
    "2_2_2_ddp_disabled": ([2, 2, 2], True, True, {"enable": False}),
    "2_4_3_ddp_throw": ([2, 4, 3], True, True, {"throw_on_early_termination": True}),
    "2_4_3_plain_throw": ([2, 4, 3], False, False, {"throw_on_early_termination": True}),
}


def _options_rank(rank, world, out_dir):
    save_rank(out_dir, rank, {name: _run(rank, *case) for name, case in OPTIONS.items()})


def test_join_options_behave_as_under_torch_join():
    """Every ``Join`` option, each block against the one-process oracle at every step (one spawn of 3 ranks)."""
    with backend_env("torch"), tempfile.TemporaryDirectory() as out_dir:
        spawn(3, _options_rank, out_dir)
        ranks = load_ranks(out_dir, 3)
    for name, (batches, wrap, _, join_kwargs) in OPTIONS.items():
        _check([r[name] for r in ranks], batches, wrap, join_kwargs)
