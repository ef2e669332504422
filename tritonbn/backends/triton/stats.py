"""Forward statistics: ``batch_norm_stats``, one launch.

The kernel runs on a ``(channel blocks, reduction chunks)`` grid. Each program sums its chunk of
``x`` per lane of its ``[BLOCK_C, BLOCK_I]`` tile, shifted by a per-channel pivot ``p`` (the
channel's first element, the same in every program)::

    S1 = sum(x - p),   S2 = sum((x - p)^2)

in fp32 (fp64 for float64 inputs): one subtract, one add and one fused multiply-add per element.
The shift keeps the sums small when ``|mean| >> std``, so ``var = S2/n - (S1/n)^2`` does not cancel.
Each program merges its lanes in fp64 and writes one partial per channel; the partials are added in
a fixed order, in two levels past 16 programs (see :func:`tritonbn.backends.triton._common.merge_tree`), and
the one program left holding the sums removes the shift in fp64, and writes the packed,
sum-combinable buffer of ``2C + 1`` float64::

    stats[:C]   = sum(x)   = S1 + n p
    stats[C:2C] = sum(x^2) = S2 + 2 p S1 + n p^2
    stats[2C]   = n        (the same for every channel)

Summing that buffer over ranks (one all-reduce) gives the global statistics; the fp64 sums keep
``var = sum(x^2)/n - mean^2`` exact to ~1e-10 relative even at ``|mean| / std = 1e3``, and the count
exact far past 2^24.
"""

import torch
import triton
import triton.language as tl

from tritonbn.backends.triton._common import (
    acc_dtypes,
    channel_block,
    channel_view,
    lane_channels,
    merge_tree,
    per_lane,
    store_partials,
    tile_keep,
    tile_mask,
    tile_next,
    tile_offsets,
    tile_rows,
    tile_start,
)
from tritonbn.backends.triton._launch import Launch, refit_with
from tritonbn.backends.triton._plan import cache_put, launch_cache, plan
from tritonbn.backends.triton._workspace import workspace


@triton.jit
def _add_tile(s1, s2, kept, x, pivot, keep, ACC: tl.constexpr, HAS_MASK: tl.constexpr):
    """One tile into a program's per-lane shifted sums: ``d = x - pivot``, then ``(s1 + d, s2 + d * d, kept)``. Masked,
    a padded position adds exactly 0, whatever it holds, and ``kept`` counts the real ones."""
    d = x.to(ACC) - pivot
    if HAS_MASK:
        d = tl.where(keep, d, 0.0)
        kept += keep.to(tl.int32)
    return s1 + d, s2 + d * d, kept


# One compiled kernel whether a program gets one tile or many, one partial or many (Triton would
# specialize arguments equal to 1 and drop the loop).
@triton.jit(do_not_specialize=["tiles_per_prog", "R", "G"])
def _batch_norm_stats_kernel(
    # pointers
    x_ptr,  # (N, C, *S), any strides
    part_ptr,  # (2, R, C) then (2, merge subtrees, C) fp64: each program's shifted sums S1, S2
    stats_ptr,  # (2C + 1,) fp64 out: [sum x | sum x^2 | count]
    ticket_ptr,  # (channel blocks, merge subtrees + 1) int32, then (masked) one count per block; zero after
    m_ptr,  # masked BatchNorm: (N, *S) uint8 viewed as (N, C, *S), nonzero at real positions; else unused
    # sizes
    C,
    O1,
    O2,
    INNER_V,
    inner_tiles,
    tiles,
    tiles_per_prog,
    R,
    G,  # programs per merge subtree (see merge_tree)
    count,  # elements per channel in x
    # strides of x
    sx_c,
    sx_o0,
    sx_o1,
    sx_o2,
    sx_i,
    # strides of the mask
    sm_c,
    sm_o0,
    sm_o1,
    sm_o2,
    sm_i,
    # meta-parameters
    ACC: tl.constexpr,  # float32, or float64 for float64 inputs
    BLOCK_C: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_R: tl.constexpr,
    VEC: tl.constexpr,
    PLANE: tl.constexpr,  # packed plans: lanes per channel (see _plan); 0 otherwise
    PACK: tl.constexpr,  # channels per program
    USE_INT64: tl.constexpr,
    UNROLL: tl.constexpr,  # tiles per step of the main loop: 1 or 2
    HAS_MASK: tl.constexpr,  # masked BatchNorm: sums and count over the real positions only
    GATHER: tl.constexpr,  # packed plans: how lanes become channel partials (see _common.store_partials)
):
    """Shifted per-lane sums of x over a chunk of tiles; the last program merges every chunk."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols, c_mask = channel_block(pid_c, C, BLOCK_C, PACK)
    lane_ch = lane_channels(BLOCK_I, PLANE)
    lanes = tl.arange(0, BLOCK_I)
    if USE_INT64:
        cols = cols.to(tl.int64)
        lanes = lanes.to(tl.int64)
    # The pivot: each channel's first element (the same for every program of this rank).
    has_data = c_mask & (cols < tl.minimum(tiles, 1) * C)
    if HAS_MASK:  # a padded first position (any value, NaN included) gives the pivot 0
        tl.static_assert(PLANE == 0, "masked plans are never packed")
        has_data = has_data & (tl.load(m_ptr + cols * 0, mask=has_data, other=0) != 0)
    if PLANE > 0:
        first = tl.load(x_ptr + cols * PLANE, mask=has_data, other=0.0)
    else:
        first = tl.load(x_ptr + cols * (sx_c * VEC), mask=has_data, other=0.0)
    pivot = first.to(ACC)
    pivot_l = per_lane(pivot, lane_ch, PLANE)
    # What masked lanes read: their channel's pivot, so that they add exactly 0 without a select (a
    # whole tile past the chunk, which the second tile of an unrolled step can be, included).
    first_l = pivot_l.to(first.dtype)

    OVEC: tl.constexpr = 1 if PLANE > 0 else VEC  # what tile_offsets multiplies the strides by
    rows, row_mask, inner_v = tile_rows(pid_c, cols, c_mask, C, INNER_V, PLANE, PACK, VEC)
    t_start = pid_r * tiles_per_prog
    t_end = tl.minimum(t_start + tiles_per_prog, tiles)
    o, it = tile_start(t_start, inner_tiles, USE_INT64)
    inner, mask = tile_mask(it, t_start < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
    offs = tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC)
    x = tl.load(x_ptr + offs, mask=mask, other=first_l)
    keep, keep2, kept = 0, 0, 0  # the mask's lanes and count: unused without one
    if HAS_MASK:
        keep = tile_keep(m_ptr, o, inner, t_start < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i, OVEC)
        kept = tl.zeros(keep.shape, dtype=tl.int32)  # real positions per lane
    if UNROLL == 2:  # two tiles a step: twice the bytes in flight, the accumulators and the merge unchanged
        o, it = tile_next(o, it, inner_tiles)
        inner, mask = tile_mask(it, t_start + 1 < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
        offs = tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC)
        x2 = tl.load(x_ptr + offs, mask=mask, other=first_l)
        if HAS_MASK:
            keep2 = tile_keep(m_ptr, o, inner, t_start + 1 < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i, OVEC)
    s1 = tl.zeros(x.shape, dtype=ACC)
    s2 = tl.zeros(x.shape, dtype=ACC)
    for t in range(t_start, t_end, UNROLL):
        # Prefetch the next step's tiles (masked off past the chunk), then use the current ones.
        o, it = tile_next(o, it, inner_tiles)
        inner, mask = tile_mask(it, t + UNROLL < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
        offs = tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC)
        x_next = tl.load(x_ptr + offs, mask=mask, other=first_l)
        if HAS_MASK:
            keep_next = tile_keep(m_ptr, o, inner, t + UNROLL < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i,
                                  OVEC)  # fmt: skip
        if UNROLL == 2:
            o, it = tile_next(o, it, inner_tiles)
            inner, mask = tile_mask(it, t + 3 < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
            offs = tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC)
            x2_next = tl.load(x_ptr + offs, mask=mask, other=first_l)
            if HAS_MASK:
                keep2_next = tile_keep(m_ptr, o, inner, t + 3 < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i,
                                       OVEC)  # fmt: skip
        s1, s2, kept = _add_tile(s1, s2, kept, x, pivot_l, keep, ACC, HAS_MASK)
        x = x_next
        if HAS_MASK:
            keep = keep_next
        if UNROLL == 2:
            s1, s2, kept = _add_tile(s1, s2, kept, x2, pivot_l, keep2, ACC, HAS_MASK)
            x2 = x2_next
            if HAS_MASK:
                keep2 = keep2_next

    # This program's partials, its lanes merged in fp64.
    store_partials(
        part_ptr, pid_r, R, C, cols, c_mask, s1, s2, pid_c, lanes, inner_v, PLANE, PACK, VEC, tl.float64, GATHER
    )
    if HAS_MASK:  # this block's count of real positions: exact in any order, an integer sum
        count_ptr = ticket_ptr + tl.num_programs(0) * ((R + G - 1) // G + 1) + pid_c
        tl.atomic_add(count_ptr, tl.sum(tl.sum(kept, axis=1), axis=0))
    # The two-level merge in a fixed order (see merge_tree); one program ends with the sums over all R.
    last, S1, S2 = merge_tree(part_ptr, ticket_ptr, pid_c, pid_r, R, G, C, cols, c_mask, BLOCK_R, BLOCK_C)
    if last:
        p = pivot.to(tl.float64)
        if HAS_MASK:
            n = tl.atomic_xchg(count_ptr, 0).to(tl.float64)  # read, and put back to zero for the next launch
        else:
            n = tl.cast(count, tl.float64)
        tl.store(stats_ptr + cols, S1 + n * p, mask=c_mask)
        tl.store(stats_ptr + C + cols, S2 + (2.0 * p) * S1 + n * p * p, mask=c_mask)
        if pid_c == 0:
            tl.store(stats_ptr + 2 * C, n)


def launcher(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The statistics of ``x`` (see :meth:`~tritonbn.backends.launchers.Launchers.batch_norm_stats`): one launch."""
    if mask is not None:
        mask = channel_view(mask, x)
    return run(find(x, mask), x, mask)


def find(x: torch.Tensor, mask: torch.Tensor | None = None) -> Launch:
    """The launch for ``x`` (and ``mask``, as :func:`channel_view` gives it), from the cache keyed by what it depends
    on (``_prepared``'s launchers keep it for the calls of one layer like the last one)."""
    if mask is not None:
        key = (x.shape, x.stride(), x.dtype, x.device, mask.stride())
    else:
        key = (x.shape, x.stride(), x.dtype, x.device)
    return _launches.get(key) or cache_put(_launches, key, _launch(x, mask))


def new_stats(x: torch.Tensor) -> torch.Tensor:
    """The statistics' tensor :func:`run` returns for ``x``: ``2 C + 1`` float64, uninitialized."""
    return torch.empty(2 * x.shape[1] + 1, dtype=torch.float64, device=x.device)


def run(launch: Launch, x: torch.Tensor, mask: torch.Tensor | None = None, like=None) -> torch.Tensor:
    """:func:`batch_norm_stats` with its launch found (:func:`find`). ``like``: a :func:`new_stats` tensor kept for
    such calls, allocated again by ``torch.empty_like`` (see :mod:`~tritonbn.backends.triton._prepared`)."""
    ws = workspace(x.device, launch.tickets, launch.scratch)
    stats = new_stats(x) if like is None else torch.empty_like(like)
    launch(x, ws.scratch, stats, ws.tickets, x if mask is None else mask)
    return stats


_launches = launch_cache()


def _launch(x: torch.Tensor, mask: torch.Tensor | None = None, per_sm: int | None = None) -> Launch:
    """The launch of the statistics kernel on inputs like ``x`` (its shape, strides, dtype and device) and
    ``mask`` (its strides), planned for ``per_sm`` programs per SM (see :mod:`tritonbn.backends.triton._launch`)."""
    # A masked layer reads one tile a step, of the unscaled size: its masks and counters, with the scalar loads of
    # tiles that cannot vectorize, took the doubled tile to 128-144 registers (kernel_audit.py --masked).
    layout = plan(x.shape, x, tile_scale=2 if mask is None else 1, per_sm=per_sm, merges=True, mask=mask)
    C, R = layout.C, layout.r_progs
    constexprs = dict(
        ACC=acc_dtypes(x)[0],
        BLOCK_C=layout.BLOCK_C,
        BLOCK_I=layout.BLOCK_I,
        BLOCK_R=layout.BLOCK_R,
        VEC=layout.VEC,
        PLANE=layout.PLANE,
        PACK=layout.PACK,
        USE_INT64=layout.use_int64,
        UNROLL=2 if mask is None else 1,
        HAS_MASK=mask is not None,
        GATHER=layout.GATHER,
    )
    tail = (*layout.size_args, R, layout.G, x.numel() // C, *layout.stride_args)
    # A masked launch counts each channel block's real positions in one more counter per block.
    tickets = layout.merge_tickets + (layout.c_blocks if mask is not None else 0)
    return Launch(
        _batch_norm_stats_kernel,
        layout.grid,
        tail,
        constexprs,
        layout.num_warps,
        pointers=5,
        tickets=tickets,
        scratch=layout.merge_scratch,
        checked=(0,) if mask is None else (0, 4),
        refit=None if per_sm else refit_with(_launch, x, mask, device=x.device),
    )
