"""Multi-rank SyncBatchNorm over gloo against the float64 oracle on the concatenated global batch.

One spawn per (world size, backend) runs every case; each rank saves what it saw, and the tests
compare the concatenated outputs, input grads, summed parameter grads and buffers with the oracle.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from dist import backend_env, load_ranks, save_rank, spawn
from oracle import PARAM_GRAD_TOL, TOLERANCES, Oracle, make_layout

import tritonbn

pytestmark = pytest.mark.distributed


@dataclass(frozen=True)
class Case:
    tail: tuple  # (C, *S)
    sizes: dict = field(default_factory=lambda: {2: [3, 5], 3: [3, 5, 2]})  # per-rank N by world size
    layout: str = "contiguous"
    dtype: torch.dtype = torch.float32
    affine: bool = True
    momentum: float | None = 0.1
    steps: int = 2


CASES = {
    "uneven": Case((3, 4, 5)),
    "empty_rank": Case((3, 4, 5), sizes={2: [0, 4], 3: [4, 0, 3]}),
    "all_empty": Case((3, 4, 5), sizes={2: [0, 0], 3: [0, 0, 0]}),
    "one_sample_per_rank": Case((5,), sizes={2: [1, 1], 3: [1, 1, 1]}),
    "2d": Case((7,), sizes={2: [4, 3], 3: [2, 3, 4]}),
    "3d": Case((4, 9)),
    "5d": Case((3, 2, 3, 4), sizes={2: [2, 1], 3: [1, 2, 1]}),
    "channels_last": Case((5, 3, 4), layout="channels_last"),
    "bf16": Case((4, 3, 5), dtype=torch.bfloat16),
    "affine_off_cumulative": Case((4, 3, 5), affine=False, momentum=None, steps=3),
}


def _global_batch(case: Case, world: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + world)
    n = sum(case.sizes[world])
    x = torch.randn((n, *case.tail), generator=g) * (1.5 + step) + step
    dy = torch.randn((n, *case.tail), generator=g)
    return x, dy


def _init_params(bn, C):
    g = torch.Generator().manual_seed(7)
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(torch.rand(C, generator=g) + 0.5)
            bn.bias.copy_(torch.randn(C, generator=g))


def _rank_cases(rank, world, out_dir):
    results = {}
    for name, case in CASES.items():
        C = case.tail[0]
        bn = tritonbn.SyncBatchNorm(C, affine=case.affine, momentum=case.momentum)
        _init_params(bn, C)
        start = sum(case.sizes[world][:rank])
        stop = start + case.sizes[world][rank]
        steps = []
        for step in range(case.steps):
            x, dy = _global_batch(case, world, step)
            x = make_layout(x[start:stop], case.layout).to(case.dtype).requires_grad_()
            dy = dy[start:stop].to(case.dtype)
            y = bn(x)
            y.backward(dy)
            steps.append(
                {
                    "y": y.detach(),
                    "dx": x.grad,
                    "dw": bn.weight.grad.clone() if case.affine else None,
                    "db": bn.bias.grad.clone() if case.affine else None,
                    "buffers": [b.clone() for b in bn.buffers()],
                    "same_format": y.stride() == x.stride(),
                }
            )
            if case.affine:
                bn.weight.grad = bn.bias.grad = None
        results[name] = steps
    save_rank(out_dir, rank, results)


# The kernels at world size 2; the PyTorch backend at 2 and 3 (a third rank changes the collective's inputs, not
# the backend's part).
@pytest.fixture(scope="module", params=[(2, "triton"), (2, "torch"), (3, "torch")], ids=str)
def sync_run(request):
    world, backend_name = request.param
    with backend_env(backend_name), tempfile.TemporaryDirectory() as out_dir:
        spawn(world, _rank_cases, out_dir)
        yield world, load_ranks(out_dir, world)


def _close(actual, expected, tol, what):
    atol, rtol = tol
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_matches_global_batch(sync_run, name):
    world, ranks = sync_run
    case = CASES[name]
    C = case.tail[0]
    template = tritonbn.SyncBatchNorm(C, affine=case.affine, momentum=case.momentum)
    _init_params(template, C)
    oracle = Oracle(C, affine=case.affine, momentum=case.momentum, weight=template.weight, bias=template.bias)
    tol = TOLERANCES[case.dtype]
    total = sum(case.sizes[world])
    for step in range(case.steps):
        seen = [r[name][step] for r in ranks]
        # Every rank holds bitwise-identical buffers.
        for other in seen[1:]:
            for a, b in zip(seen[0]["buffers"], other["buffers"], strict=True):
                assert torch.equal(a, b), f"step {step}: buffers differ between ranks"
        assert all(s["same_format"] for s in seen), "output lost the input's memory format"
        x, dy = _global_batch(case, world, step)
        x, dy = x.to(case.dtype), dy.to(case.dtype)
        y = torch.cat([s["y"] for s in seen])
        dx = torch.cat([s["dx"] for s in seen])
        running_mean, running_var, nbt = seen[0]["buffers"]
        if total == 0:
            assert y.shape == x.shape and dx.shape == x.shape
            assert torch.equal(running_mean, torch.zeros(C)) and torch.equal(running_var, torch.ones(C))
            assert nbt.item() == 0, "an all-empty step must not count as a batch"
            if case.affine:
                assert all(torch.equal(s["dw"], torch.zeros(C)) for s in seen)
            continue
        y_ref, dx_ref, dw_ref, db_ref = oracle.step(x, dy)
        _close(y, y_ref, tol, f"y step {step}")
        _close(dx, dx_ref, tol, f"dx step {step}")
        if case.affine:
            _close(sum(s["dw"] for s in seen), dw_ref, PARAM_GRAD_TOL[case.dtype], f"summed dweight step {step}")
            _close(sum(s["db"] for s in seen), db_ref, PARAM_GRAD_TOL[case.dtype], f"summed dbias step {step}")
        _close(running_mean, oracle.running_mean, (1e-5, 1e-5), f"running_mean step {step}")
        _close(running_var, oracle.running_var, (1e-5, 1e-5), f"running_var step {step}")
        assert nbt.item() == oracle.num_batches_tracked


# --- collectives: exactly one all_reduce per pass, sized by C alone -------------------------------

_COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
]


class _CollectiveLog:
    """Wraps every torch.distributed collective, logging (name, numel, dtype)."""

    def __init__(self):
        self.calls = []
        self._saved = {}

    def __enter__(self):
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapper(*args, _name=name, _fn=fn, **kwargs):
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                self.calls.append((_name, t.numel() if t is not None else None, t.dtype if t is not None else None))
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def _rank_collectives(rank, world, out_dir):
    C = 6
    bn = tritonbn.SyncBatchNorm(C)
    x = torch.randn(2 + rank, C, 3, 4, requires_grad=True)
    log = {}
    with _CollectiveLog() as calls:
        y = bn(x)
        log["forward"] = calls.take()
        y.sum().backward()
        log["backward"] = calls.take()
        bn.eval()
        y = bn(x)
        y.sum().backward()
        log["eval"] = calls.take()
        bn.train()
        x.grad = None
        y = bn(x.detach())  # input needs no grad: backward has nothing to synchronize
        calls.take()
        y.sum().backward()
        log["no_input_grad_backward"] = calls.take()
    save_rank(out_dir, rank, log)


@pytest.mark.parametrize("backend_name", ["triton", "torch"], indirect=True)
def test_one_collective_per_pass(backend_name, tmp_path):
    seen = {}
    for world in (2, 3):
        out = tmp_path / str(world)
        out.mkdir()
        spawn(world, _rank_collectives, str(out))
        seen[world] = load_ranks(str(out), world)
    C = 6
    for world, ranks in seen.items():
        for log in ranks:
            assert log["forward"] == [("all_reduce", 2 * C + 3, torch.float64)], f"world {world}: {log['forward']}"
            assert log["backward"] == [("all_reduce", 2 * C + 3, torch.float64)], f"world {world}: {log['backward']}"
            assert log["eval"] == [], "eval must not communicate"
            assert log["no_input_grad_backward"] == [], "backward without input grad must not communicate"
    assert seen[2][0]["forward"] == seen[3][0]["forward"], "message size must not depend on world size"


# --- process groups, eval alone, conversion --------------------------------------------------------


def _rank_subgroup(rank, world, out_dir):
    """World 3: ranks 0 and 1 sync in a subgroup; rank 2 trains alone on the same data as rank 0."""
    sub = dist.new_group([0, 1])
    solo = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(0)
    batches = [torch.randn(3, 4, 5) + r for r in range(2)]
    if rank < 2:
        bn = tritonbn.SyncBatchNorm(4, process_group=sub)
        y = bn(batches[rank])
    else:
        bn = tritonbn.SyncBatchNorm(4, process_group=solo[rank])
        y = bn(batches[0])
    save_rank(out_dir, rank, {"y": y.detach(), "rm": bn.running_mean.clone(), "rv": bn.running_var.clone()})


@pytest.mark.parametrize("backend_name", ["triton", "torch"], indirect=True)
def test_subgroup_syncs_only_members(backend_name, tmp_path):
    spawn(3, _rank_subgroup, str(tmp_path))
    r0, r1, r2 = load_ranks(str(tmp_path), 3)
    torch.manual_seed(0)
    batches = [torch.randn(3, 4, 5) + r for r in range(2)]
    oracle = Oracle(4, weight=torch.ones(4), bias=torch.zeros(4))
    y_ref, *_ = oracle.step(torch.cat(batches), None)
    _close(torch.cat([r0["y"], r1["y"]]), y_ref, (1e-5, 1e-5), "subgroup y")
    assert torch.equal(r0["rm"], r1["rm"]) and torch.equal(r0["rv"], r1["rv"])
    _close(r0["rm"], oracle.running_mean, (1e-6, 1e-6), "subgroup running_mean")
    alone = Oracle(4, weight=torch.ones(4), bias=torch.zeros(4))
    y_alone, *_ = alone.step(batches[0], None)
    _close(r2["y"], y_alone, (1e-5, 1e-5), "rank outside the subgroup")


def _rank_eval_alone(rank, world, out_dir):
    bn = tritonbn.SyncBatchNorm(3)
    bn(torch.randn(4, 3, 2) * 2 + rank)  # one synchronized training step on every rank
    result = {}
    if rank == 0:  # only rank 0 evaluates: any collective here would hang
        bn.eval()
        result["rm"], result["rv"] = bn.running_mean.clone(), bn.running_var.clone()
        with _CollectiveLog() as calls:
            x = torch.randn(2, 3, 2)
            result["y"] = bn(x)
            result["x"] = x
            result["calls"] = calls.take()
            bn.track_running_stats = False
            bn.running_mean = bn.running_var = None
            result["y_local"] = bn(x)
            result["calls_local"] = calls.take()
    save_rank(out_dir, rank, result)
    dist.barrier()


@pytest.mark.parametrize("backend_name", ["triton", "torch"], indirect=True)
def test_eval_on_one_rank_alone(backend_name, tmp_path):
    spawn(2, _rank_eval_alone, str(tmp_path))
    r0, _ = load_ranks(str(tmp_path), 2)
    assert r0["calls"] == [] and r0["calls_local"] == []
    # track_running_stats=False in eval normalizes with this rank's own batch, as torch does
    y_ref, *_ = Oracle(3, track_running_stats=False, weight=torch.ones(3), bias=torch.zeros(3)).step(
        r0["x"], None, training=False
    )
    _close(r0["y_local"], y_ref, (1e-5, 1e-5), "eval with batch statistics")
    expected = (r0["x"].double() - r0["rm"].double()[:, None]) / (r0["rv"].double()[:, None] + 1e-5).sqrt()
    _close(r0["y"], expected, (1e-5, 1e-5), "eval with running statistics")
