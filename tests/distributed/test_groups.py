"""BatchNorm groups (``tritonbn.syncbn_group``) over 4 gloo ranks with ``group_size=2``.

One spawn of 4 ranks runs everything, for both backends in turn (4 processes on 2 cores are slow to
start): each group against the float64 oracle on that group's concatenated batch, the groups'
running statistics, ``check_bn_sync`` within groups, ``sync_running_stats`` over the world, the
collectives of a pass, a ``group_size`` that does not divide the world, and ``group_size=1``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import backend_env, load_ranks, save_rank, spawn
from oracle import PARAM_GRAD_TOL, TOLERANCES, Oracle
from torch import nn

import tritonbn
from tritonbn import diagnose

WORLD, GROUP = 4, 2
C, TAIL = 3, (3, 2, 3)  # (C, H, W): small, odd
SIZES = [3, 2, 1, 4]  # per-rank N: uneven within and between groups
STEPS = 2
BACKENDS = ("triton", "torch")


def _batch(step: int):
    """The world's batch of ``step``: group 1's ranks (2, 3) get data of another mean and scale."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn((sum(SIZES), *TAIL), generator=g)
    dy = torch.randn((sum(SIZES), *TAIL), generator=g)
    shift = torch.tensor([0.0 if r < GROUP else 3.0 for r in range(WORLD) for _ in range(SIZES[r])])
    scale = torch.tensor([1.0 if r < GROUP else 2.5 for r in range(WORLD) for _ in range(SIZES[r])])
    return x * scale.view(-1, 1, 1, 1) + shift.view(-1, 1, 1, 1), dy


def _rows(ranks):
    """The rows of the world's batch that ``ranks`` hold."""
    starts = [sum(SIZES[:r]) for r in range(WORLD)]
    return torch.cat([torch.arange(starts[r], starts[r] + SIZES[r]) for r in ranks])


def _params():
    g = torch.Generator().manual_seed(7)
    return torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g)


class _Calls:
    """Logs every collective and every process-group creation: (name, numel, dtype, group size)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter", "barrier",
             "new_group", "new_subgroups")  # fmt: skip

    def __enter__(self):
        self.calls, self.saved = [], {}
        for name in self.NAMES:
            self.saved[name] = fn = getattr(dist, name)

            def wrapper(*args, _name=name, _fn=fn, **kwargs):
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                group = kwargs.get("group")
                size = dist.get_world_size(group) if t is not None else None
                self.calls.append(
                    (_name, t.numel() if t is not None else None, t.dtype if t is not None else None, size)
                )
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def _rank(rank, world, out_dir):
    out = {}
    # A group_size that does not divide the world: the same error on every rank, before any communication.
    with _Calls() as log:
        calls = (
            lambda: tritonbn.syncbn_group(3),
            lambda: tritonbn.convert_sync_batchnorm(nn.BatchNorm2d(C), group_size=3),
        )
        for call in calls:
            try:
                call()
                out.setdefault("errors", []).append(None)
            except ValueError as e:
                out.setdefault("errors", []).append(str(e))
        out["calls_before_error"] = log.take()
    group = tritonbn.syncbn_group(GROUP)
    out["group_ranks"] = dist.get_process_group_ranks(group)
    out["cached"] = tritonbn.syncbn_group(GROUP) is group and tritonbn.syncbn_group(WORLD) is dist.group.WORLD
    weight, bias = _params()
    mine = _rows([rank])
    for backend in BACKENDS:
        with backend_env(backend):
            model = nn.Sequential(nn.BatchNorm2d(C))
            with torch.no_grad():
                model[0].weight.copy_(weight)
                model[0].bias.copy_(bias)
            model = tritonbn.convert_sync_batchnorm(model, group_size=GROUP)
            bn = model[0]
            steps = []
            for step in range(STEPS):
                x, dy = _batch(step)
                x = x[mine].requires_grad_()
                with _Calls() as log:
                    y = model(x)
                    forward = log.take()
                    y.backward(dy[mine])
                    backward = log.take()
                grads = {"y": y.detach(), "dx": x.grad, "dw": bn.weight.grad.clone(), "db": bn.bias.grad.clone()}
                buffers = [b.clone() for b in bn.buffers()]
                steps.append({**grads, "buffers": buffers, "forward": forward, "backward": backward})
                bn.weight.grad = bn.bias.grad = None
            found = diagnose.check_bn_sync(model)
            saved = bn.running_mean.clone()
            if rank == 3:  # one rank of the second group drifts
                bn.running_mean.add_(1.0)
            broken = diagnose.check_bn_sync(model)
            bn.running_mean.copy_(saved)
            across = diagnose.check_bn_sync(model, process_group=dist.group.WORLD)
            repaired = tritonbn.sync_running_stats(model)
            pooled = [b.clone() for b in bn.buffers()]
            after = diagnose.check_bn_sync(model, process_group=dist.group.WORLD)
            # group_size=1: local BatchNorm with tritonbn's kernels, no communication
            local = tritonbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(C)), group_size=1)
            x, _ = _batch(0)
            with _Calls() as log:
                y_local = local(x[mine])
                local_calls = log.take()
            # tritonbn.explain: whether each layer synchronizes, with how many ranks, on which route (a copy's
            # forward: the group's layer communicates, on every rank alike)
            explained = [
                (r.synchronizes, r.ranks, r.route) for m in (model, local) for r in tritonbn.explain(m, x[mine])
            ]
            out[backend] = {
                "explained": explained,
                "steps": steps,
                "report": (found.ok, found.groups, found.group_ok, str(found)),
                "report_world": (across.ok, across.groups, across.diverging),
                "report_broken": (broken.ok, broken.group_ok, broken.diverging, broken.layers[0].mean_abs, str(broken)),
                "repaired": repaired,
                "pooled": pooled,
                "report_after": (after.ok, after.groups),
                "local": (y_local.detach(), local_calls),
            }
    save_rank(out_dir, rank, out)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("groups")
    spawn(WORLD, _rank, str(out_dir))
    return load_ranks(str(out_dir), WORLD)


pytestmark = pytest.mark.distributed


def _close(actual, expected, tol, what):
    torch.testing.assert_close(actual.double(), expected, atol=tol[0], rtol=tol[1], msg=lambda m: f"{what}: {m}")


def _group_oracles():
    """Per group: an Oracle stepped on that group's concatenated batch, and each step's (y, dx, dw, db)."""
    weight, bias = _params()
    result = []
    for g in range(WORLD // GROUP):
        members = list(range(g * GROUP, (g + 1) * GROUP))
        oracle = Oracle(C, weight=weight, bias=bias)
        rows = _rows(members)
        outs = [oracle.step(_batch(step)[0][rows], _batch(step)[1][rows]) for step in range(STEPS)]
        result.append((members, oracle, outs))
    return result


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_group_matches_oracle_on_its_batch(ranks, backend):
    tol = TOLERANCES[torch.float32]
    assert [r["group_ranks"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["cached"] for r in ranks)
    for members, oracle, outs in _group_oracles():
        for step, (y_ref, dx_ref, dw_ref, db_ref) in enumerate(outs):
            seen = [ranks[r][backend]["steps"][step] for r in members]
            _close(torch.cat([s["y"] for s in seen]), y_ref, tol, f"group {members} y step {step}")
            _close(torch.cat([s["dx"] for s in seen]), dx_ref, tol, f"group {members} dx step {step}")
            _close(sum(s["dw"] for s in seen), dw_ref, PARAM_GRAD_TOL[torch.float32], f"group {members} dweight")
            _close(sum(s["db"] for s in seen), db_ref, PARAM_GRAD_TOL[torch.float32], f"group {members} dbias")
            for other in seen[1:]:  # identical buffers within a group
                assert all(torch.equal(a, b) for a, b in zip(seen[0]["buffers"], other["buffers"], strict=True))
        running_mean, running_var, nbt = ranks[members[0]][backend]["steps"][-1]["buffers"]
        _close(running_mean, oracle.running_mean, (1e-5, 1e-5), f"group {members} running_mean")
        _close(running_var, oracle.running_var, (1e-5, 1e-5), f"group {members} running_var")
        assert nbt.item() == STEPS


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_differ_then_sync_running_stats_pools_them(ranks, backend):
    (_, first, _), (_, second, _) = _group_oracles()
    last = [r[backend]["steps"][-1]["buffers"] for r in ranks]
    assert (last[0][0] - last[2][0]).abs().min() > 0.5, "the groups' running means must differ: their data differ"
    assert (last[0][1] - last[2][1]).abs().min() > 0.5, "the groups' running vars must differ"
    # The pooled statistics of the four ranks (two per group, so each group weighs the same).
    mean = (first.running_mean + second.running_mean) / 2
    var = (first.running_var + first.running_mean**2 + second.running_var + second.running_mean**2) / 2 - mean**2
    for r in ranks:
        assert r[backend]["repaired"] == 1
        pooled_mean, pooled_var, nbt = r[backend]["pooled"]
        _close(pooled_mean, mean, (1e-5, 1e-5), "pooled running_mean")
        _close(pooled_var, var, (1e-5, 1e-5), "pooled running_var")
        assert nbt.item() == STEPS
        for a, b in zip(r[backend]["pooled"], ranks[0][backend]["pooled"], strict=True):
            assert torch.equal(a, b), "after sync_running_stats all four ranks hold identical buffers"


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_bn_sync_compares_within_groups(ranks, backend):
    for r in ranks:
        ok, groups, group_ok, text = r[backend]["report"]
        assert ok, text
        assert groups == [[0, 1], [2, 3]] and group_ok == [True, True]
        assert "in sync within groups" in text and "within each of 2 groups of 2 ranks: 0-1 | 2-3" in text, text
        ok, group_ok, diverging, mean_abs, text = r[backend]["report_broken"]
        assert not ok and group_ok == [True, False] and diverging == ["0"], text
        assert mean_abs == pytest.approx(1.0) and "diverge within groups: 0; in group 2-3" in text, text
        ok, groups, diverging = r[backend]["report_world"]
        assert not ok and groups == [[0, 1, 2, 3]] and diverging == ["0"], "across the world the groups differ"
        assert r[backend]["report_after"] == (True, [[0, 1, 2, 3]]), "sync_running_stats makes the world agree"


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_collective_per_pass_within_the_group(ranks, backend):
    """The same single all-reduce per pass, of the same size, as over the world at world 2 and 3
    (tests/distributed/test_sync.py): independent of the world and of the group size; sent over the group."""
    for r in ranks:
        for step in r[backend]["steps"]:
            assert step["forward"] == [("all_reduce", 2 * C + 3, torch.float64, GROUP)], step["forward"]
            assert step["backward"] == [("all_reduce", 2 * C + 3, torch.float64, GROUP)], step["backward"]


def test_non_dividing_group_size_same_error_before_any_collective(ranks):
    errors = [r["errors"] for r in ranks]
    assert all(e == errors[0] for e in errors), "every rank raises the same error"
    message = errors[0][0]
    assert message is not None and "group_size 3" in message and "world size 4" in message, message
    assert errors[0][1] == message, "convert_sync_batchnorm(group_size=3) raises the same error"
    assert all(r["calls_before_error"] == [] for r in ranks), "no collective and no group creation before the error"


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_size_1_is_local_batchnorm(ranks, backend):
    x, _ = _batch(0)
    for rank, r in enumerate(ranks):
        y, calls = r[backend]["local"]
        y_ref, *_ = Oracle(C, weight=torch.ones(C), bias=torch.zeros(C)).step(x[_rows([rank])], None)
        _close(y, y_ref, TOLERANCES[torch.float32], f"rank {rank} local y")
        assert calls == [], "group_size=1 communicates nothing"


@pytest.mark.parametrize("backend", BACKENDS)
def test_explain_tells_who_synchronizes(ranks, backend):
    """``tritonbn.explain`` on a model of ``syncbn_group`` layers (whose group a copy shares) and a local one: the
    group's layer synchronizes with its ``GROUP`` ranks through the eager Function; the local layer with nobody, on
    the PyTorch backend through torch's own training ops."""
    local = "local training" if backend == "torch" else "eager function"
    for r in ranks:
        assert r[backend]["explained"] == [(True, GROUP, "eager function"), (False, 1, local)]


# --- one process: argument errors -------------------------------------------------------------------


def test_group_size_arguments():
    bn = nn.Sequential(nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match="process_group or group_size, not both"):
        tritonbn.convert_sync_batchnorm(bn, object(), group_size=2)
    with pytest.raises(ValueError, match="process_group or group_size, not both"):
        tritonbn.SyncBatchNorm.convert_sync_batchnorm(bn, object(), group_size=2)
    with pytest.raises(ValueError, match="process_group or group_size, not both"):
        diagnose.check_bn_sync(bn, object(), group_size=2)
    with pytest.raises(ValueError, match="group_size must be a positive int or None, got 0"):
        tritonbn.syncbn_group(0)
    with pytest.raises(TypeError, match="group_size must be a positive int or None, got True"):
        tritonbn.syncbn_group(True)
    with pytest.raises(ValueError, match="group_size 2 does not divide the world size 1"):
        tritonbn.convert_sync_batchnorm(bn, group_size=2)
    assert tritonbn.syncbn_group(None) is None and tritonbn.syncbn_group(1) is None  # one process: nothing to sync
    converted = tritonbn.convert_sync_batchnorm(bn, group_size=1)
    assert isinstance(converted[0], tritonbn.SyncBatchNorm) and converted[0].process_group is None
