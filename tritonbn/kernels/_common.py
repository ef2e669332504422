"""Triton helpers shared by the kernels: tile indexing and per-channel statistics."""

import triton
import triton.language as tl


@triton.jit
def tile_index(t, inner_tiles, O1, O2, BLOCK_I: tl.constexpr, USE_INT64: tl.constexpr):
    """Split tile number ``t`` into its outer indices ``(o0, o1, o2)`` and first inner index."""
    if USE_INT64:
        t = tl.cast(t, tl.int64)
    o = t // inner_tiles
    i0 = (t - o * inner_tiles) * BLOCK_I
    o2 = o % O2
    o1 = (o // O2) % O1
    o0 = o // (O2 * O1)
    return o0, o1, o2, i0


@triton.jit
def tile_offsets(o0, o1, o2, cols, inner, s_c, s_o0, s_o1, s_o2, s_i):
    """Element offsets of a ``[BLOCK_C, BLOCK_I]`` tile in a tensor with the given strides."""
    return (o0 * s_o0 + o1 * s_o1 + o2 * s_o2) + cols[:, None] * s_c + inner[None, :] * s_i


@triton.jit
def channel_stats(stats_ptr, rmean_ptr, rvar_ptr, cols, c_mask, C, TRAINING: tl.constexpr):
    """Per-channel ``(mean, biased var, count)`` in fp64.

    Training reads the packed global sums ``stats = [sum_x | sum_x2 | count]`` of shape ``(3, C)``;
    eval reads the running statistics (count is then 0, unused).
    """
    if TRAINING:
        s1 = tl.load(stats_ptr + cols, mask=c_mask, other=0.0)
        s2 = tl.load(stats_ptr + C + cols, mask=c_mask, other=0.0)
        n = tl.load(stats_ptr + 2 * C + cols, mask=c_mask, other=0.0)
        nn = tl.maximum(n, 1.0)
        mean = s1 / nn
        var = tl.maximum(s2 / nn - mean * mean, 0.0)
    else:
        mean = tl.load(rmean_ptr + cols, mask=c_mask, other=0.0).to(tl.float64)
        var = tl.load(rvar_ptr + cols, mask=c_mask, other=1.0).to(tl.float64)
        n = tl.zeros_like(mean)
    return mean, var, n


@triton.jit
def split_mean(mean64):
    """Split an fp64 mean into fp32 ``hi + lo``: ``(x - hi) - lo`` keeps fp32 precision far from zero."""
    hi = mean64.to(tl.float32)
    lo = (mean64 - hi.to(tl.float64)).to(tl.float32)
    return hi, lo
