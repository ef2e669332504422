"""Forward statistics: ``batch_norm_stats``.

Stage 1 (``_batch_norm_stats_kernel``) runs on a ``(channel blocks, reduction chunks)`` grid. Each
program keeps a Welford triple ``(count, mean, M2)`` per lane of its ``[BLOCK_C, BLOCK_I]`` tile,
over data shifted by the channel's first element so that fp32 keeps its precision when
``|mean| >> std``, then merges its lanes with Chan's formula and writes one fp64 partial per channel.

Stage 2 (``_batch_norm_stats_finalize_kernel``) merges the partials in a fixed order (so the result
is bitwise deterministic) into the sum-combinable packed buffer

    stats[0] = sum(x) = sum_r n_r * mean_r
    stats[1] = sum(x^2) = sum_r M2_r + n_r * mean_r^2
    stats[2] = count

in fp64. Summing that buffer over ranks (one all-reduce) gives the global statistics; the fp64 sums
keep ``var = sum(x^2)/n - mean^2`` exact to ~1e-10 relative even at ``|mean| / std = 1e3``, and
counts exact far past 2^24.
"""

import torch
import triton
import triton.language as tl

from tritonbn.kernels._common import tile_index, tile_offsets
from tritonbn.kernels._layout import _next_pow2, plan


@triton.jit
def _batch_norm_stats_kernel(
    # pointers
    x_ptr,  # (N, C, *S), any strides
    part_ptr,  # (3, R, C) fp64: count, mean, M2 of each program's chunk
    # sizes
    C,
    O1,
    O2,
    INNER,
    inner_tiles,
    tiles,
    tiles_per_prog,
    R,
    # strides of x
    sx_c,
    sx_o0,
    sx_o1,
    sx_o2,
    sx_i,
    # meta-parameters
    BLOCK_C: tl.constexpr,
    BLOCK_I: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """Per-program Welford/Chan partials of x over a contiguous chunk of tiles."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < C
    lanes = tl.arange(0, BLOCK_I)
    if USE_INT64:
        cols = cols.to(tl.int64)
        lanes = lanes.to(tl.int64)
    # The shift: each channel's first element (the same for every program of this rank).
    has_data = cols < tl.minimum(tiles, 1) * C
    shift = tl.load(x_ptr + cols * sx_c, mask=c_mask & has_data, other=0.0).to(tl.float32)

    cnt = tl.zeros([BLOCK_C, BLOCK_I], dtype=tl.int32)
    mean = tl.zeros([BLOCK_C, BLOCK_I], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_C, BLOCK_I], dtype=tl.float32)
    t_start = pid_r * tiles_per_prog
    t_end = tl.minimum(t_start + tiles_per_prog, tiles)
    for t in range(t_start, t_end):
        o0, o1, o2, i0 = tile_index(t, inner_tiles, O1, O2, BLOCK_I, USE_INT64)
        inner = i0 + lanes
        mask = c_mask[:, None] & (inner < INNER)[None, :]
        offs = tile_offsets(o0, o1, o2, cols, inner, sx_c, sx_o0, sx_o1, sx_o2, sx_i)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) - shift[:, None]
        cnt += mask.to(tl.int32)
        delta = x - mean
        mean += tl.where(mask, delta / tl.maximum(cnt, 1).to(tl.float32), 0.0)
        m2 += tl.where(mask, delta * (x - mean), 0.0)

    # Chan: merge the lanes of each channel.
    n = tl.sum(cnt, axis=1)
    cnt_f = cnt.to(tl.float32)
    mean_c = tl.sum(cnt_f * mean, axis=1) / tl.maximum(n, 1).to(tl.float32)
    d = tl.where(cnt > 0, mean - mean_c[:, None], 0.0)
    m2_c = tl.sum(m2 + cnt_f * d * d, axis=1)

    out = part_ptr + pid_r * C + cols
    tl.store(out, n.to(tl.float64), mask=c_mask)
    tl.store(out + R * C, mean_c.to(tl.float64) + shift.to(tl.float64), mask=c_mask)
    tl.store(out + 2 * R * C, m2_c.to(tl.float64), mask=c_mask)


@triton.jit
def _batch_norm_stats_finalize_kernel(
    part_ptr,  # (3, R, C) fp64 partials
    stats_ptr,  # (3, C) fp64 out: [sum_x | sum_x2 | count]
    R,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Fixed-order sum of the partials into the packed, sum-combinable buffer."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < C
    rows = tl.arange(0, BLOCK_R)
    s1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    s2 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    sn = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + rows
        mask = (r < R)[:, None] & c_mask[None, :]
        offs = r[:, None] * C + cols[None, :]
        n = tl.load(part_ptr + offs, mask=mask, other=0.0)
        mean = tl.load(part_ptr + R * C + offs, mask=mask, other=0.0)
        m2 = tl.load(part_ptr + 2 * R * C + offs, mask=mask, other=0.0)
        s1 += n * mean
        s2 += m2 + n * mean * mean
        sn += n
    tl.store(stats_ptr + cols, tl.sum(s1, axis=0), mask=c_mask)
    tl.store(stats_ptr + C + cols, tl.sum(s2, axis=0), mask=c_mask)
    tl.store(stats_ptr + 2 * C + cols, tl.sum(sn, axis=0), mask=c_mask)


def finalize_blocks(R: int, C: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_C)`` for the second-stage kernels."""
    block_c = min(_next_pow2(C), 128)
    block_r = max(1, min(_next_pow2(R), 4096 // block_c))
    return block_r, block_c


def batch_norm_stats(x: torch.Tensor) -> torch.Tensor:
    """Local per-channel statistics of ``x``, packed for one SUM all-reduce.

    Args:
        x: ``(N, C, *S)`` input of any rank >= 2, dtype fp32/fp16/bf16, any strides (contiguous,
            channels_last, permuted). ``N`` may be 0.

    Returns:
        ``stats``: ``(3, C)`` float64, contiguous, rows ``[sum(x) | sum(x^2) | count]``. Buffers from
        several ranks combine by summing; :func:`batch_norm_elemt` turns them into mean and var.
    """
    layout = plan(x.shape, x)
    C, R = layout.C, layout.r_progs
    part = torch.empty((3, R, C), dtype=torch.float64, device=x.device)
    stats = torch.empty((3, C), dtype=torch.float64, device=x.device)
    (sx,) = layout.strides[:1]
    _batch_norm_stats_kernel[layout.grid](
        x,
        part,
        C,
        layout.O1,
        layout.O2,
        layout.INNER,
        layout.inner_tiles,
        layout.tiles,
        layout.tiles_per_prog,
        R,
        *sx,
        BLOCK_C=layout.BLOCK_C,
        BLOCK_I=layout.BLOCK_I,
        USE_INT64=layout.use_int64,
        num_warps=layout.num_warps,
    )
    block_r, block_c = finalize_blocks(R, C)
    _batch_norm_stats_finalize_kernel[(triton.cdiv(C, block_c),)](part, stats, R, C, BLOCK_R=block_r, BLOCK_C=block_c)
    return stats
