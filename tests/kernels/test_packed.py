"""Packed plans: contiguous NCHW planes with no factor of 8 (7x7, 14x14, 3x3), read as runs of whole channels.

Each case checks first that the plan really is packed (so the test exercises that path), then runs
the module path against the float64 oracle. ``mid_tiles`` makes groups small enough that a layer has
several groups, a last pack that ``C`` cuts short, and several programs per group.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from oracle import PARAM_GRAD_TOL, TOLERANCES

import tritonbn
from tritonbn.kernels import _plan, batch_norm_stats
from tritonbn.kernels._common import segment_sums
from tritonbn.kernels._plan import plan, planned_as


@pytest.fixture
def mid_tiles(monkeypatch):
    monkeypatch.setattr(_plan, "_CPU_TILE", 2048)
    monkeypatch.setattr(_plan, "_CPU_PROGRAMS", 16)
    _plan.clear_caches()
    yield
    _plan.clear_caches()


# (shape, groups of the elementwise plan): 7x7 with a short last group, 14x14, 3x3 in one group, 3-D
CASES = [((3, 48, 7, 7), 2), ((2, 32, 14, 14), 4), ((4, 16, 3, 3), 1), ((2, 16, 3, 5, 7), 1)]


def _oracle(x, r, dy, w, b, act):
    x = x.detach().double().requires_grad_()
    w, b = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    C = x.shape[1]
    rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    z = F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5) + r.double()
    y = act(z)
    y.backward(dy.double())
    return y.detach(), x.grad, w.grad, b.grad, rm, rv


def _close(actual, expected, tol, what):
    atol, rtol = tol
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "groups"), CASES)
def test_grouped_plan_matches_oracle(mid_tiles, shape, groups, dtype):
    torch.manual_seed(0)
    C = shape[1]
    x = torch.randn(shape) * (torch.rand(C) * 3 + 0.1).view(1, C, *[1] * (len(shape) - 2)) + 2
    r, dy = torch.randn(shape), torch.randn(shape)
    x_in = x.to(dtype).requires_grad_()
    p = plan(x_in.shape, x_in, x_in, x_in)
    assert p.PLANE == torch.Size(shape[2:]).numel() and p.c_blocks == groups and p.r_progs > 1, p
    assert p.VEC >= 8 and p.INNER % 8 == 0  # runs start on 16 bytes

    bn = tritonbn.SyncBatchNorm(C, activation="silu")
    with torch.no_grad():
        bn.weight.copy_(torch.rand(C) + 0.5)
        bn.bias.copy_(torch.randn(C))
    y = bn(x_in, r.to(dtype))
    y.backward(dy.to(dtype))
    ref_y, ref_dx, ref_dw, ref_db, ref_rm, ref_rv = _oracle(x_in.detach(), r.to(dtype), dy.to(dtype),
                                                          bn.weight, bn.bias, F.silu)  # fmt: skip
    _close(y, ref_y, TOLERANCES[dtype], "y")
    _close(x_in.grad, ref_dx, TOLERANCES[dtype], "dx")
    _close(bn.weight.grad, ref_dw, PARAM_GRAD_TOL[dtype], "grad_weight")
    _close(bn.bias.grad, ref_db, PARAM_GRAD_TOL[dtype], "grad_bias")
    # Each channel's running statistics are updated exactly once, by the program that owns it.
    _close(bn.running_mean, ref_rm, (1e-6, 1e-5), "running_mean")
    _close(bn.running_var, ref_rv, (1e-6, 1e-5), "running_var")
    assert bn.num_batches_tracked.item() == 1

    bn.eval()
    with torch.no_grad():
        y_eval = bn(x_in.detach())
    ref_eval = F.batch_norm(x_in.detach().double(), ref_rm, ref_rv, bn.weight.double(), bn.bias.double(), False)
    _close(y_eval, F.silu(ref_eval), TOLERANCES[dtype], "eval y")


def test_grouped_statistics_keep_precision(mid_tiles):
    """Neighbouring channels of one group with scales 1e-3 to 1e3 and |mean| / std = 1e3: the lanes are
    reduced to channels by a scan that must restart at each channel, so that no channel's size leaks
    into the next one's variance (differences of prefix sums lose 4e-4 of it here)."""
    torch.manual_seed(1)
    C = 48
    scale = torch.logspace(-3, 3, C)[torch.randperm(C)].view(1, C, 1, 1)
    x = (torch.randn(4, C, 7, 7) + 1e3) * scale
    assert plan(x.shape, x, tile_scale=2).PLANE == 49
    bn = tritonbn.SyncBatchNorm(C, affine=False)
    y = bn(x)
    ref = F.batch_norm(x.double(), None, None, training=True)
    _close(y, ref, (1e-5, 1e-5), "y")
    var = x.double().var((0, 2, 3), unbiased=True)
    torch.testing.assert_close(bn.running_var.double(), 0.9 + 0.1 * var, rtol=1e-5, atol=0)


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "store"])
@pytest.mark.parametrize(("shape", "groups"), CASES)
def test_grouped_statistics_both_ways(mid_tiles, monkeypatch, shape, groups, gather):
    """A packed statistics kernel turns its lanes into channel partials with a gather (every target but sm_90,
    and the interpreter) or with a store from each channel's last lane (sm_90): both give sum(x), sum(x^2)
    and the count, over several groups, a last pack that C cuts short, and several programs per group."""
    monkeypatch.setattr(_plan, "_gathers", lambda kind: gather)
    _plan.clear_caches()
    torch.manual_seed(0)
    C = shape[1]
    x = torch.randn(shape) * (torch.rand(C) * 3 + 0.1).view(1, C, *[1] * (len(shape) - 2)) + 2
    p = plan(x.shape, x, tile_scale=2)
    assert p.PLANE > 0 and p.GATHER == gather and p.r_progs > 1, p
    stats = batch_norm_stats(x)
    dims = [0, *range(2, x.dim())]
    torch.testing.assert_close(stats[:C], x.double().sum(dims), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats[C : 2 * C], (x.double() ** 2).sum(dims), rtol=1e-6, atol=1e-6)
    assert stats[2 * C].item() == x.numel() // C


def test_packed_statistics_gather_on_every_target_but_sm90():
    """The plans of ResNet-50's 14x14 statistics: sm_90 keeps the audited store from each channel's last lane,
    sm_80, sm_89, sm_100 and AMD gather (ptxas holds the store at 128 registers and spills on sm_80/89, at
    150 on sm_100); the other kernels' plans never gather."""
    x = torch.empty(32, 256, 14, 14)
    for arch, gathers in ((90, False), (80, True), (89, True), (100, True), (0, True)):
        with planned_as("cuda", 132, warp_size=64 if arch == 0 else 32, arch=arch):
            assert plan(x.shape, x, tile_scale=2).GATHER is gathers, arch
            assert plan(x.shape, x, x, x).GATHER is gathers  # packed, but only the statistics read GATHER
            assert plan(x.shape, x.to(memory_format=torch.channels_last)).GATHER is False  # not packed


def test_grouped_empty_batch(mid_tiles):
    x = torch.empty(0, 48, 7, 7)
    assert plan(x.shape, x).PLANE == 49
    bn = tritonbn.SyncBatchNorm(48)
    before = bn.running_var.clone()
    y = bn(x)
    # torch's module counts the step (one process), and its running statistics do not move
    assert y.shape == x.shape and torch.equal(bn.running_var, before) and bn.num_batches_tracked.item() == 1


@pytest.mark.parametrize("shape", [(32, 2048, 7, 7), (32, 512, 7, 7), (32, 1024, 14, 14), (32, 256, 14, 14)])
def test_resnet50_odd_planes_plan_grouped_on_gpu(shape):
    """What a GPU plans for ResNet-50's 7x7 and 14x14 NCHW layers: 16-byte runs, under 5% idle lanes."""
    x = torch.empty(shape)
    with planned_as("cuda", 132):
        for p in (plan(x.shape, x, tile_scale=2), plan(x.shape, x, x, x)):
            assert p.PLANE == shape[2] * shape[3] and p.VEC >= 8
            assert 1 - p.INNER / p.BLOCK_I < 0.05, p
            assert p.BLOCK_C * p.PLANE >= p.BLOCK_I  # a slot for every lane's channel
    other = torch.empty(32, 24, 7, 7)  # C * 49 not a multiple of 16: the plane-by-plane walk
    with planned_as("cuda", 132):
        assert plan(other.shape, other).PLANE == 0


@triton.jit
def _segment_sums_kernel(v_ptr, s_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, segment_sums(tl.load(v_ptr + i), tl.load(s_ptr + i)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_segmented_scan_adds_left_to_right(dtype):
    """The packed plans' segmented sum (in NumPy under tests/helpers/fast_interpreter.py) restarts at each
    flagged lane and otherwise adds in lane order: the same bits as a plain left-to-right loop."""
    g = torch.Generator().manual_seed(3)
    values = (torch.randn(256, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    starts = (torch.rand(256, generator=g) < 0.1).to(torch.int32)
    starts[0] = 0  # the first lane starts a segment, flagged or not
    out = torch.empty_like(values)
    _segment_sums_kernel[(1,)](values, starts, out, 256)
    want = values.clone()
    for i in range(1, 256):
        if not starts[i]:
            want[i] = want[i - 1] + values[i]
    assert torch.equal(out, want)
