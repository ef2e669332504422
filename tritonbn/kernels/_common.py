"""Triton helpers shared by the kernels: tile indexing and per-channel statistics."""

import triton
import triton.language as tl

from tritonbn.activations import ACTIVATIONS


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
        var = tl.maximum(s2 / nn - mean * mean, 0.0, propagate_nan=tl.PropagateNan.ALL)  # a NaN is kept
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


# Fused activations: the codes the kernels take as ACTIVATION (0: none, 1: relu, 2: leaky_relu, 3: silu).
ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}


@triton.jit
def activate(z, slope, ACTIVATION: tl.constexpr):
    """act(z) for ACTIVATION 0 (none), 1 (relu), 2 (leaky_relu with ``slope``), 3 (silu)."""
    if ACTIVATION == 1:
        z = tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) = NaN, as in torch
    elif ACTIVATION == 2:
        z = tl.where(z > 0, z, z * slope)
    elif ACTIVATION == 3:
        z = z * tl.sigmoid(z)
    return z


@triton.jit
def activation_grad(dy, z, slope, ACTIVATION: tl.constexpr):
    """dy * act'(z). For relu and leaky_relu with slope >= 0, ``z`` may be the output y (same sign)."""
    if ACTIVATION == 1:
        dy = tl.where(z > 0, dy, 0.0)
    elif ACTIVATION == 2:
        dy = tl.where(z > 0, dy, dy * slope)
    elif ACTIVATION == 3:
        s = tl.sigmoid(z)
        dy = dy * s * (1.0 + z * (1.0 - s))
    return dy


# What the backward kernels read to find act'(z): AUX_NONE recomputes z from x alone, AUX_RESIDUAL
# from x and the residual, AUX_OUTPUT reads the sign of the saved output y (relu, leaky_relu).
AUX_NONE, AUX_RESIDUAL, AUX_OUTPUT = 0, 1, 2


@triton.jit
def grad_z(dy, xc, scale, bias, aux, slope, ACTIVATION: tl.constexpr, AUX: tl.constexpr):
    """The gradient at z = xhat * w + b (+ residual), from dy at y = act(z); ``xc = x - mean``."""
    if ACTIVATION != 0:
        if AUX == 2:
            z = aux
        else:
            z = xc * scale[:, None] + bias[:, None]
            if AUX == 1:
                z += aux
        dy = activation_grad(dy, z, slope, ACTIVATION)
    return dy
