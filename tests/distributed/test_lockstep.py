"""Ranks that call their BatchNorms out of step (issue 55): always checked, inside the messages, no extra collective.

One spawn per (world size, backend) runs every row of the issue's table in turn, each against the float64 oracle
(``F.batch_norm`` over the concatenated global batch), without ``TRITONBN_DEBUG``; the group's timeout
(``tests/helpers/dist.py``, 60 s) makes a hang fail the test. A mismatch must end in the same
:class:`tritonbn.OutOfStepError` on every rank, change no buffer, leave the group usable, and let a later matching
step give the oracle's answer. The legal rows (uneven N and spatial sizes, an empty rank, channels_last on one rank,
float32 and float64 ranks in one layer) must stay correct, with and without ``TRITONBN_DEBUG=1``. The GPU's form of
the check (on the device, no host read: NaN outputs, running statistics kept, :func:`tritonbn.check` raising) runs
here on CPU tensors, through the same Triton kernel under the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import backend_env, load_ranks, save_rank, spawn
from torch import nn

import tritonbn
import tritonbn.lockstep

pytestmark = pytest.mark.distributed

C = 3
BACKENDS = ("torch", "triton")
MISMATCHES = ("swap", "skip, forward only", "eval, forward only", "skip with backward", "eval with backward",
              "unused head")  # fmt: skip
# The layers whose forward the ranks still called in step before the mismatch: those rightly updated their statistics.
MATCHED = {"skip with backward": "a", "eval with backward": "a", "unused head": "abh"}
# What every rank's error says differed, and what the last rank was doing (the others: what the first rank was).
DIFFERS = {
    "swap": ("layer", "the forward all-reduce of layer 'b'", "the forward all-reduce of layer 'a'"),
    "skip, forward only": ("layer", "the forward all-reduce of layer 'b'", "the forward all-reduce of layer 'a'"),
    "eval, forward only": ("layer", "the forward all-reduce of layer 'b'", "the forward all-reduce of layer 'a'"),
    "skip with backward": (
        "pass, layer",
        "the backward all-reduce of layer 'a'",
        "the forward all-reduce of layer 'b'",
    ),
    "eval with backward": (
        "pass, layer",
        "the backward all-reduce of layer 'a'",
        "the forward all-reduce of layer 'b'",
    ),
    "unused head": ("layer", "the backward all-reduce of layer 'b'", "the backward all-reduce of layer 'h'"),
}


def _shapes(world: int, step: int):
    """Per rank ``(N, H, W)``: uneven batches and spatial sizes, rank 1 empty at step 1."""
    shapes = [(3, 2, 2), (2, 3, 1), (1, 2, 3)][:world]
    if step == 1:
        shapes[1] = (0, 3, 1)
    return shapes


def _global(world: int, step: int, salt: int = 0):
    """Every rank's ``(x, dy)`` of one step, float64, from one seed (every rank makes all of them alike)."""
    g = torch.Generator().manual_seed(100 * step + salt)
    xs = [torch.randn(n, C, h, w, generator=g, dtype=torch.float64) * 2 + 3 for n, h, w in _shapes(world, step)]
    dys = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in xs]
    return xs, dys


def _flat(ts):
    """The global batch as one ``(1, C, L)`` tensor: every rank's elements, per channel, in rank order."""
    return torch.cat([t.transpose(0, 1).reshape(C, -1) for t in ts], dim=1).unsqueeze(0)


def _unflat(flat, like):
    """Each rank's part of a :func:`_flat` tensor, in the rank's shape."""
    parts, start = [], 0
    for t in like:
        n = t.numel() // C
        parts.append(flat[0, :, start : start + n].reshape(C, t.shape[0], *t.shape[2:]).transpose(0, 1))
        start += n
    return parts


class _Oracle:
    """One layer's float64 oracle: running statistics and one step over the global batch."""

    def __init__(self, layer) -> None:
        self.rm = torch.zeros(C, dtype=torch.float64)
        self.rv = torch.ones(C, dtype=torch.float64)
        self.w, self.b = layer.weight.detach().double(), layer.bias.detach().double()

    def step(self, xs, dys=None):
        x = _flat(xs).requires_grad_(dys is not None)
        y = F.batch_norm(x, self.rm, self.rv, self.w, self.b, True, 0.1, 1e-5)
        dx = torch.autograd.grad(y, x, _flat(dys))[0] if dys is not None else None
        return _unflat(y.detach(), xs), (None if dx is None else _unflat(dx, xs))


def _layers():
    """Two converted layers ``a`` and ``b`` of C channels and a head ``h``, each with its own affine parameters."""
    g = torch.Generator().manual_seed(7)
    model = nn.ModuleDict({k: nn.BatchNorm2d(C) for k in "abh"})
    for m in model.values():
        with torch.no_grad():
            m.weight.copy_(torch.rand(C, generator=g) + 0.5)
            m.bias.copy_(torch.randn(C, generator=g))
    return tritonbn.convert_sync_batchnorm(model)


def _buffers(model):
    return {k: t.detach().clone() for k, t in model.state_dict().items() if "running" in k or "num_batches" in k}


def _close(got, want, what):
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _legal(rank, world, debug: bool) -> dict:
    """Uneven N and spatial sizes, an empty rank, channels_last on rank 0, float64 on the last rank: 2 steps, both
    passes, against the oracle."""
    os.environ["TRITONBN_DEBUG"] = "1" if debug else "0"
    model = _layers()
    dtype = torch.float64 if rank == world - 1 else torch.float32
    a = model["a"].to(dtype)
    oracle = _Oracle(model["a"])
    for step in range(2):
        xs, dys = _global(world, step)
        want_y, want_dx = oracle.step(xs, dys)
        x = xs[rank].to(dtype)
        if rank == 0:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(True)
        y = a(x)
        y.backward(dys[rank].to(dtype))
        _close(y, want_y[rank], f"step {step} y")
        _close(x.grad, want_dx[rank], f"step {step} dx")
        _close(a.running_mean, oracle.rm, f"step {step} running_mean")
        _close(a.running_var, oracle.rv, f"step {step} running_var")
    os.environ.pop("TRITONBN_DEBUG")
    return {"buffers": {k: v.double() for k, v in _buffers(model).items()}}


def _mismatched_step(rank, world, case, model, xs, dys):
    """One step in which the last rank calls its layers out of step with the others."""
    odd = rank == world - 1
    x = xs[rank].float().requires_grad_(True)
    a, b, h = model["a"], model["b"], model["h"]
    if case == "swap":  # the last rank calls b, then a
        out = a(b(x)) if odd else b(a(x))
        out.backward(dys[rank].float())
    elif case in ("skip, forward only", "eval, forward only"):  # recalibration: training mode, no autograd
        with torch.no_grad():
            if case.startswith("eval") and odd:
                a.eval()
            b(x if (odd and case.startswith("skip")) else a(x))
    elif case in ("skip with backward", "eval with backward"):
        if case.startswith("eval") and odd:
            b.eval()
        out = a(x) if (odd and case.startswith("skip")) else b(a(x))
        out.backward(dys[rank].float())
    elif case == "unused head":  # the last rank's loss does not reach head h (DDP's find_unused_parameters=True)
        z = a(x)
        loss, head = (b(z) * dys[rank].float()).sum(), h(z)  # every rank calls the head in forward
        if not odd:
            loss = loss + head.sum()
        loss.backward()
    else:
        raise AssertionError(case)


def _matching_step(model, x, dy):
    x = x.float().requires_grad_(True)
    y = model["b"](model["a"](x))
    y.backward(dy.float())
    return y, x.grad


def _mismatch(rank, world, case) -> dict:
    """A matching step, the mismatched one (the error, or none), then a matching step against the oracle."""
    model = _layers()
    oa, ob = _Oracle(model["a"]), _Oracle(model["b"])

    def oracle_step(xs, dys):
        ya, _ = oa.step(xs)
        yb, _ = ob.step(ya)
        x = _flat(xs).requires_grad_(True)
        # the chained step's dx, recomputed over the chain (the oracles already stepped their running statistics)
        mean_a, var_a = x.mean((0, 2)), x.var((0, 2), unbiased=False)
        za = (x - mean_a[:, None]) / torch.sqrt(var_a[:, None] + 1e-5) * oa.w[:, None] + oa.b[:, None]
        mean_b, var_b = za.mean((0, 2)), za.var((0, 2), unbiased=False)
        zb = (za - mean_b[:, None]) / torch.sqrt(var_b[:, None] + 1e-5) * ob.w[:, None] + ob.b[:, None]
        (dx,) = torch.autograd.grad(zb, x, _flat(dys))
        return yb, _unflat(dx, xs)

    xs, dys = _global(world, 0, salt=1)
    want_y, want_dx = oracle_step(xs, dys)
    y, dx = _matching_step(model, xs[rank], dys[rank])
    _close(y, want_y[rank], f"{case}: first step y")
    _close(dx, want_dx[rank], f"{case}: first step dx")
    before = _buffers(model)
    xs, dys = _global(world, 1, salt=2)
    error = None
    try:
        _mismatched_step(rank, world, case, model, xs, dys)
    except tritonbn.OutOfStepError as e:
        error = str(e)
    changed = [k for k, v in _buffers(model).items() if not torch.equal(v, before[k])]
    if "a" in MATCHED.get(case, ""):
        ya, _ = oa.step(xs)
        if "b" in MATCHED[case]:
            ob.step(ya)
    model.train()
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is usable: nothing hangs, nothing is left half-done
    xs, dys = _global(world, 2, salt=3)  # back in step: the oracle's answer, from the last good statistics
    want_y, want_dx = oracle_step(xs, dys)
    y, dx = _matching_step(model, xs[rank], dys[rank])
    _close(y, want_y[rank], f"{case}: step after y")
    _close(dx, want_dx[rank], f"{case}: step after dx")
    for k, o in (("a", oa), ("b", ob)):
        _close(model[k].running_mean, o.rm, f"{case}: running_mean of {k} after")
        _close(model[k].running_var, o.rv, f"{case}: running_var of {k} after")
    return {"error": error, "changed": changed, "after": t.item(), "nbt": int(model["a"].num_batches_tracked)}


class _Heads(nn.Module):
    """A trunk and two heads; ``use_h`` decides whether head ``h``'s output reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.m = nn.Conv2d(C, C, 1), _layers()

    def forward(self, x, use_h: bool):
        z = self.m["a"](self.conv(x))
        loss, head = (self.m["b"](z) ** 2).sum(), self.m["h"](z)
        return loss + head.sum() if use_h else loss


def _ddp_unused_head(rank, world) -> dict:
    """Under DDP with ``find_unused_parameters=True``, the last rank's loss leaves head ``h`` out: before the check,
    gloo aborted a rank (the head's backward message met another layer's, or DDP's own)."""
    ddp = nn.parallel.DistributedDataParallel(_Heads(), find_unused_parameters=True)
    xs, _ = _global(world, 0, salt=4)
    ddp(xs[rank].float(), use_h=True).backward()  # a matching step
    try:
        ddp(xs[rank].float(), use_h=rank != world - 1).backward()
        error = None
    except tritonbn.OutOfStepError as e:
        error = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"error": error, "after": t.item()}


def _on_device(rank, world) -> dict:
    """The GPU's form of the check, on CPU tensors (the Triton kernel under the interpreter): the swapped step
    raises nothing; its outputs are NaN, its running statistics stay; :func:`tritonbn.check` raises on every rank."""
    tritonbn.lockstep.host_checked.clear()
    try:
        model = _layers()
        xs, dys = _global(world, 0)
        _matching_step(model, xs[rank], dys[rank])
        tritonbn.check()  # nothing to report
        before = _buffers(model)
        x = xs[rank].float()
        a, b = model["a"], model["b"]
        with torch.no_grad():
            y = a(b(x)) if rank == world - 1 else b(a(x))
        changed = [k for k, v in _buffers(model).items() if not torch.equal(v, before[k])]
        try:
            tritonbn.check()
            error = None
        except tritonbn.OutOfStepError as e:
            error = str(e)
        tritonbn.check()  # reported once
        return {"nan": bool(y.isnan().all()), "changed": changed, "error": error}
    finally:
        tritonbn.lockstep.host_checked.add("cpu")


def _shifted_indices(rank, world) -> dict:
    """Layers built directly, known by construction index, with rank 0 building one more first (an EMA copy, a
    second model): the indices differ between ranks, the calls are in step, and nothing raises."""
    if rank == 0:
        tritonbn.SyncBatchNorm(C)
    layer = tritonbn.SyncBatchNorm(C)
    xs, dys = _global(world, 0, salt=5)
    x = xs[rank].float().requires_grad_(True)
    layer(x).backward(dys[rank].float())
    if rank != 0:  # the indices in step again: later tests in these pooled ranks name layers by them (debug mode)
        tritonbn.SyncBatchNorm(C)
    return {"name": layer._tritonbn_name}


def _rank_all(rank, world, out_dir, backend):
    results = {"legal": _legal(rank, world, debug=False), "legal, debug": _legal(rank, world, debug=True)}
    results["shifted indices"] = _shifted_indices(rank, world)
    for case in MISMATCHES:
        results[case] = _mismatch(rank, world, case)
    if backend == "torch":  # one backend: the rows above cover both
        results["ddp"] = _ddp_unused_head(rank, world)
    if backend == "triton":
        results["on device"] = _on_device(rank, world)
    save_rank(out_dir, rank, results)


@pytest.fixture(scope="module", params=[(w, b) for w in (2, 3) for b in BACKENDS], ids=lambda p: f"world{p[0]}-{p[1]}")
def ranks(request, tmp_path_factory):
    world, backend = request.param
    out = tmp_path_factory.mktemp(f"lockstep{world}{backend}")
    with backend_env(backend):
        spawn(world, _rank_all, str(out), backend)
    return world, backend, load_ranks(str(out), world)


def test_legal_cases_stay_correct(ranks):
    """Every rank matched the oracle at every step (checked in the ranks); the float32 ranks hold the same buffers,
    bitwise, and the float64 rank (the last) the same up to float32's rounding."""
    world, _, seen = ranks
    for case in ("legal", "legal, debug"):
        first = seen[0][case]["buffers"]
        for rank, r in enumerate(seen[1:], start=1):
            for k, v in r[case]["buffers"].items():
                if rank < world - 1:
                    assert torch.equal(v, first[k]), f"{case}: {k} differs between ranks 0 and {rank}"
                else:
                    torch.testing.assert_close(v.float(), first[k].float(), msg=lambda m, k=k, c=case: f"{c}: {k}: {m}")


def test_construction_indices_are_not_compared(ranks):
    _, _, seen = ranks
    names = [r["shifted indices"]["name"] for r in seen]
    assert names[0] != names[1], names  # it ran without an error (the ranks would have raised)


@pytest.mark.parametrize("case", MISMATCHES)
def test_out_of_step_raises_on_every_rank(ranks, case):
    """The same named error on every rank, nothing updated, the group usable, the next matching step right."""
    world, _, seen = ranks
    got = [r[case] for r in seen]
    for rank, g in enumerate(got):
        assert g["error"] is not None, f"{case}: rank {rank} did not raise"
        assert g["error"].startswith("tritonbn: ranks out of step at the "), g["error"]
        assert "TRITONBN_DEBUG=1" in g["error"] and "Nothing was updated" in g["error"], g["error"]
        differ, last, others = DIFFERS[case]
        ranks = "ranks 0, 1" if world == 3 else "rank 0"
        said = f"ranks disagree on {differ}:\n  {ranks}: {others} (C={C})\n  rank {world - 1}: {last} (C={C}).\n"
        assert said in g["error"], (said, g["error"])
        assert g["error"].partition("on this rank: ")[2] == got[0]["error"].partition("on this rank: ")[2]
        matched = sorted(k for k in _buffers(_layers()) if k[0] in MATCHED.get(case, ""))
        assert sorted(g["changed"]) == matched, f"{case}: rank {rank} changed {g['changed']}, not {matched}"
        assert g["after"] == world
        assert g["nbt"] == 2 + ("a" in MATCHED.get(case, "")), "num_batches_tracked counts the good steps"
        assert any(f"all-reduce of layer '{k}' (C={C}) on this rank" in g["error"] for k in "abh"), g["error"]


def test_unused_head_under_ddp_raises_on_every_rank(ranks):
    world, backend, seen = ranks
    if backend != "torch":
        pytest.skip("run on the PyTorch backend (the backward rows above run on both)")
    for rank, r in enumerate(seen):
        error = r["ddp"]["error"]
        assert error is not None and "ranks out of step at the backward all-reduce" in error, f"rank {rank}: {error}"
        assert r["ddp"]["after"] == world


def test_device_check_poisons_and_reports(ranks):
    world, backend, seen = ranks
    if backend != "triton":
        pytest.skip("the device check is the Triton kernel's (docs/limits.md: the PyTorch backend on a GPU)")
    for rank, r in enumerate(seen):
        got = r["on device"]
        assert got["nan"], f"rank {rank}: the mismatched call's output is not NaN"
        assert got["changed"] == [], f"rank {rank}: the mismatched call changed {got['changed']}"
        assert got["error"] is not None and "found on the device at the forward all-reduce of layer" in got["error"]
