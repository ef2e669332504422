"""The launchers of tritonbn.kernels on their own, and the backend switch."""

import os

import pytest
import torch
from oracle import make_layout

import tritonbn
from tritonbn import backend
from tritonbn.kernels import plan


def test_plan_folds_layouts():
    x = torch.empty(4, 6, 5, 7)
    p = plan(x.shape, x)
    assert (p.outer, p.INNER, p.strides[0][4]) == (4, 35, 1)  # NCHW: outer N, inner H*W contiguous
    cl = x.contiguous(memory_format=torch.channels_last)
    p = plan(cl.shape, cl)
    assert (p.outer, p.INNER, p.strides[0][0], p.strides[0][4]) == (1, 140, 1, 6)  # one strided inner dim
    x2 = torch.empty(9, 6)
    p = plan(x2.shape, x2)
    assert (p.outer, p.INNER) == (1, 9)
    # joint folding: an NCHW x with a channels_last y cannot fold H*W for both
    p = plan(x.shape, x, cl)
    assert p.outer * p.INNER == 4 * 35 and p.outer > 1


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "permuted"])
def test_launchers_many_programs(backend_name, small_tiles, layout):
    """The launchers, step by step, with the per-program partials and their deterministic merge."""
    ops = backend.ops_for(torch.empty(0))
    torch.manual_seed(5)
    x = make_layout(torch.randn(3, 5, 4, 6) * 3 + 2, layout)
    assert backend_name == "torch" or plan(x.shape, x).r_progs > 1
    xd = x.double()
    stats = ops.batch_norm_stats(x)
    n = 3 * 4 * 6
    assert stats.shape == (2 * 5 + 1,) and stats.dtype == torch.float64
    torch.testing.assert_close(stats[:5], xd.sum((0, 2, 3)), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(stats[5:10], (xd * xd).sum((0, 2, 3)), atol=1e-5, rtol=1e-6)
    assert stats[10].item() == n

    w, b = torch.rand(5) + 0.5, torch.randn(5)
    y, mean, invstd = ops.batch_norm_elemt(x, w, b, stats=stats)
    var = xd.var((0, 2, 3), unbiased=False)
    torch.testing.assert_close(mean, xd.mean((0, 2, 3)), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(invstd.double(), (var + 1e-5).rsqrt(), atol=1e-6, rtol=1e-6)
    shape4 = (1, 5, 1, 1)
    y_ref = (xd - mean.view(shape4)) * (invstd.double() * w.double()).view(shape4) + b.double().view(shape4)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)

    dy = make_layout(torch.randn(3, 5, 4, 6), layout)
    sums, gw, gb = ops.batch_norm_backward_reduce(dy, x, mean, invstd, w)
    xhat = (xd - mean.view(shape4)) * invstd.double().view(shape4)
    torch.testing.assert_close(sums[0].double(), dy.double().sum((0, 2, 3)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums[1].double(), (dy.double() * xhat).sum((0, 2, 3)), atol=1e-4, rtol=1e-5)
    assert torch.equal(gw, sums[1]) and torch.equal(gb, sums[0])
    dx = ops.batch_norm_backward_elemt(dy, x, mean, invstd, w, sums, stats[-1:])
    k = (invstd.double() * w.double()).view(shape4)
    dx_ref = k * (dy.double() - sums[0].double().view(shape4) / n - xhat * sums[1].double().view(shape4) / n)
    torch.testing.assert_close(dx.double(), dx_ref, atol=1e-5, rtol=1e-5)
    assert dx.stride() == x.stride()


def test_empty_batch_leaves_running_stats(backend_name):
    ops = backend.ops_for(torch.empty(0))
    x = torch.empty(0, 3, 4)
    stats = ops.batch_norm_stats(x)
    assert torch.equal(stats, torch.zeros(2 * 3 + 1, dtype=torch.float64))
    rm, rv, nbt = torch.full((3,), 2.0), torch.full((3,), 3.0), torch.tensor(5)
    y, mean, invstd = ops.batch_norm_elemt(
        x, None, None, stats=stats, running_mean=rm, running_var=rv, num_batches_tracked=nbt, momentum=None
    )
    assert y.shape == x.shape
    assert torch.equal(rm, torch.full((3,), 2.0)) and torch.equal(rv, torch.full((3,), 3.0)) and nbt.item() == 5
    assert torch.isfinite(mean).all() and torch.isfinite(invstd).all()


def test_launchers_refuse_arguments_that_contradict_each_other(backend_name):
    """The public launchers (one signature for both backends, tritonbn/backends/launchers.py) name the argument a
    call lacks, and change no buffer, instead of reading a tensor that is not there."""
    ops = backend.ops_for(torch.empty(0))
    x = torch.randn(3, 2, 5)
    stats, rm, rv = ops.batch_norm_stats(x), torch.zeros(2), torch.ones(2)
    with pytest.raises(ValueError, match="eval mode .stats=None. needs running_mean and running_var"):
        ops.batch_norm_elemt(x, None, None, running_mean=rm)
    with pytest.raises(ValueError, match="momentum=None needs num_batches_tracked"):
        ops.batch_norm_elemt(x, None, None, stats=stats, running_mean=rm, running_var=rv, momentum=None)
    assert torch.equal(rm, torch.zeros(2)) and torch.equal(rv, torch.ones(2))
    y, mean, invstd = ops.batch_norm_elemt(x, None, None, stats=stats)
    sums = ops.batch_norm_backward_reduce(torch.ones_like(x), x, mean, invstd)[0]
    with pytest.raises(ValueError, match="sums needs count"):
        ops.batch_norm_backward_elemt(torch.ones_like(x), x, mean, invstd, None, sums)


def test_backend_switch(monkeypatch):
    cpu = torch.empty(0, device="cpu")
    monkeypatch.setenv("TRITONBN_BACKEND", "bogus")
    with pytest.raises(ValueError, match="TRITONBN_BACKEND must be one of auto, triton, torch, got 'bogus'"):
        tritonbn.sync_batch_norm(torch.randn(4, 3, device="cpu"), None, None, training=True)
    monkeypatch.setenv("TRITONBN_BACKEND", "auto")
    assert backend.name_for(cpu) == ("triton" if backend.interpreted() else "torch")
    monkeypatch.setattr(backend, "interpreted", lambda: False)
    assert backend.name_for(cpu) == "torch"  # CPU without the interpreter falls back
    monkeypatch.setenv("TRITONBN_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 .* or use TRITONBN_BACKEND=torch"):
        tritonbn.sync_batch_norm(torch.randn(4, 3, device="cpu"), None, None, training=True)


def test_environment_read_at_each_call(monkeypatch):
    """``TRITONBN_BACKEND`` and ``TRITONBN_DEBUG`` are read at each call, set or unset by any means (they are read
    from ``os.environ``'s own store, :func:`tritonbn._compat.environ_reader`)."""
    from tritonbn._signature import debug_enabled

    monkeypatch.delenv("TRITONBN_BACKEND", raising=False)
    monkeypatch.delenv("TRITONBN_DEBUG", raising=False)
    assert backend.selected() == "auto" and not debug_enabled()
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    monkeypatch.setenv("TRITONBN_DEBUG", "1")
    assert backend.selected() == "torch" and debug_enabled()
    assert backend.name_for(torch.empty(0)) == "torch"
    os.environ.update(TRITONBN_BACKEND=" Triton ", TRITONBN_DEBUG="off")
    assert backend.selected() == "triton" and not debug_enabled()
    del os.environ["TRITONBN_BACKEND"]
    assert backend.selected() == "auto"


def _odd_chunk(p) -> bool:
    """Whether some program of the plan walks an odd number of tiles."""
    return any(min(p.tiles_per_prog, p.tiles - k * p.tiles_per_prog) % 2 for k in range(p.r_progs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("shape", "layout", "cpu_tile"), [((5, 8, 9, 9), "channels_last", 8),
                                                           ((11, 32, 14, 14), "contiguous", 2048)])  # fmt: skip
def test_two_tiles_a_step(monkeypatch, dtype, shape, layout, cpu_tile):
    """The reductions' main loops that take two tiles a step (statistics always; the fp16/bf16 backward
    reduction on channels_last and packed 14x14 plans), over programs with an odd number of tiles (the
    last step's second tile lies past the chunk, masked whole): sums against float64."""
    from tritonbn.kernels import _plan, backward_reduce, batch_norm_backward_reduce, batch_norm_stats

    monkeypatch.setattr(_plan, "_CPU_TILE", cpu_tile)
    monkeypatch.setattr(_plan, "_CPU_PROGRAMS", 8)
    _plan.clear_caches()
    torch.manual_seed(7)
    x = make_layout((torch.randn(shape) * 2 + 5).to(dtype), layout)
    dy = make_layout(torch.randn(shape).to(dtype), layout)
    p = plan(x.shape, dy, x, x, merges=True)
    assert backward_reduce._unroll(x, p) == 2 and _odd_chunk(p) and p.tiles_per_prog > 1, p
    assert _odd_chunk(plan(x.shape, x, tile_scale=2, merges=True))
    xd, dims = x.double(), (0, *range(2, x.dim()))
    stats = batch_norm_stats(x)
    torch.testing.assert_close(stats[: shape[1]], xd.sum(dims), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(stats[shape[1] : -1], (xd * xd).sum(dims), atol=1e-6, rtol=1e-6)
    mean = xd.mean(dims)
    invstd = (xd.var(dims, unbiased=False) + 1e-5).rsqrt().float()
    sums, _, _ = batch_norm_backward_reduce(dy, x, mean, invstd, None)
    view = (1, shape[1], *[1] * (len(shape) - 2))
    xhat = (xd - mean.view(view)) * invstd.double().view(view)
    torch.testing.assert_close(sums[0].double(), dy.double().sum(dims), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(sums[1].double(), (dy.double() * xhat).sum(dims), atol=1e-5, rtol=1e-6)
    _plan.clear_caches()


@pytest.mark.parametrize(("C", "levels"), [(64, 2), (128, 1), (256, 1), (2048, 1)])
def test_reductions_merge_narrow_channel_blocks(C, levels):
    """As on an H100/H200 at the reductions' occupancy (3 programs of 8 warps per SM): a channels_last
    reduction takes 32-channel blocks (its partials, merged after the main loops, grow as the block
    squared), and merges them in one level while they are at most 64 KiB; the elementwise kernels keep
    128-channel blocks; NCHW plans, and plans for the interpreter, are not narrowed."""
    from tritonbn.kernels._plan import planned_as

    x = torch.empty(32, C, 56, 56, device="meta").to(memory_format=torch.channels_last)
    with planned_as("cuda", 132):
        p = plan(x.shape, x, tile_scale=2, per_sm=3, merges=True)
        assert p.BLOCK_C == 32 and p.c_blocks * p.r_progs <= 3 * 132, p
        assert (p.merge_subtrees > 1) == (levels == 2) and (p.G == p.r_progs) == (levels == 1), p
        assert (2 * 8 * p.r_progs * p.BLOCK_C <= 64 * 1024) == (levels == 1), p
        assert plan(x.shape, x, x, tile_scale=2, per_sm=3).BLOCK_C == min(C, 128)
        nchw = torch.empty(32, C, 16, 16, device="meta")
        assert plan(nchw.shape, nchw, per_sm=3, merges=True) == plan(nchw.shape, nchw, per_sm=3)
    assert plan(x.shape, x, tile_scale=2, merges=True).BLOCK_C == min(C, 128)  # the interpreter's plans: not narrowed


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_merge_in_several_steps(small_tiles, monkeypatch, levels, layout):
    """The merge loop over more rows than one step reads (2 rows a step here, up to 16 on a GPU): 9 to
    48 programs per channel block merged in one level (5 to 24 steps) or two (groups of 3 to 7, 2 to 4
    steps each): sums against float64."""
    from tritonbn.kernels import _plan, batch_norm_backward_reduce, batch_norm_stats

    monkeypatch.setattr(_plan, "_MERGE_ROWS", 2)
    monkeypatch.setattr(_plan, "_CPU_PROGRAMS", 48)
    monkeypatch.setattr(_plan, "_FLAT_MERGE", 1 << 30 if levels == 1 else 3)
    _plan.clear_caches()
    torch.manual_seed(11)
    x = make_layout(torch.randn(3, 5, 8, 12) * 3 + 2, layout)
    dy = make_layout(torch.randn(3, 5, 8, 12), layout)
    for p in (plan(x.shape, x, tile_scale=2, merges=True), plan(x.shape, dy, x, x, merges=True)):
        assert p.BLOCK_R == 2 and (p.merge_subtrees == 1) == (levels == 1), p
        assert p.r_progs > 2 * p.BLOCK_R if levels == 1 else p.G > p.BLOCK_R, p
    xd, dims = x.double(), (0, 2, 3)
    stats = batch_norm_stats(x)
    torch.testing.assert_close(stats[:5], xd.sum(dims), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(stats[5:10], (xd * xd).sum(dims), atol=1e-5, rtol=1e-6)
    mean = xd.mean(dims)
    invstd = (xd.var(dims, unbiased=False) + 1e-5).rsqrt().float()
    sums, _, _ = batch_norm_backward_reduce(dy, x, mean, invstd, None)
    xhat = (xd - mean.view(1, 5, 1, 1)) * invstd.double().view(1, 5, 1, 1)
    torch.testing.assert_close(sums[0].double(), dy.double().sum(dims), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(sums[1].double(), (dy.double() * xhat).sum(dims), atol=1e-5, rtol=1e-6)
