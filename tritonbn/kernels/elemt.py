"""Forward elementwise pass: ``batch_norm_elemt``.

One kernel normalizes ``x``. In training it derives each channel's mean and var from the packed
global sums (see :mod:`tritonbn.kernels.stats`); in eval it reads the running statistics. With

    scale = weight * invstd,   invstd = 1 / sqrt(var + eps)

it writes ``y = act(((x - mean_hi) - mean_lo) * scale + bias + residual)``, where
``mean_hi + mean_lo`` is the fp64 mean split into two fp32 numbers, so that ``y`` keeps fp32
precision when ``|mean| >> std``. The residual add and the activation (none, relu, leaky_relu,
silu) are optional and fused: no extra pass over the tensor.

The programs of the first reduction chunk also write the saved ``mean`` (fp64) and ``invstd``
(fp32) for backward. In training with running statistics, program ``(0, 0)`` updates
``running_mean``, ``running_var`` (unbiased, from the global count) and ``num_batches_tracked`` on
the device: ``momentum=None`` means the cumulative factor ``1 / (num_batches_tracked + 1)``, read
in-kernel, so nothing waits on the host. When the global count is 0 (every rank empty), the running
statistics and ``num_batches_tracked`` stay as they are.
"""

import torch
import triton
import triton.language as tl

from tritonbn.kernels._common import ACTIVATION_CODES, activate, channel_stats, split_mean, tile_index, tile_offsets
from tritonbn.kernels._layout import plan


@triton.jit
def _batch_norm_elemt_kernel(
    # pointers
    x_ptr,  # (N, C, *S)
    y_ptr,  # (N, C, *S) out, dtype of x
    r_ptr,  # (N, C, *S) residual, or unused
    w_ptr,  # (C,) or unused
    b_ptr,  # (C,) or unused
    stats_ptr,  # (3, C) fp64 [sum_x | sum_x2 | count] (training)
    rmean_ptr,  # (C,) running mean (eval: read; training: updated in place)
    rvar_ptr,  # (C,) running var
    nbt_ptr,  # () int64 num_batches_tracked
    mean_ptr,  # (C,) fp64 out: saved mean
    invstd_ptr,  # (C,) fp32 out: saved invstd
    # sizes
    C,
    O1,
    O2,
    INNER,
    inner_tiles,
    tiles,
    tiles_per_prog,
    # strides of x and y
    sx_c,
    sx_o0,
    sx_o1,
    sx_o2,
    sx_i,
    sy_c,
    sy_o0,
    sy_o1,
    sy_o2,
    sy_i,
    sr_c,
    sr_o0,
    sr_o1,
    sr_o2,
    sr_i,
    # scalars
    momentum,
    eps,
    slope,
    # meta-parameters
    TRAINING: tl.constexpr,
    UPDATE_RUNNING: tl.constexpr,
    CUMULATIVE: tl.constexpr,
    HAS_NBT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_I: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """y = act((x - mean) * invstd * weight + bias + residual), plus saved stats and the running-stat update."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < C
    mean64, var64, _ = channel_stats(stats_ptr, rmean_ptr, rvar_ptr, cols, c_mask, C, TRAINING)
    invstd = (1.0 / tl.sqrt(var64 + eps)).to(tl.float32)
    if pid_r == 0:
        tl.store(mean_ptr + cols, mean64, mask=c_mask)
        tl.store(invstd_ptr + cols, invstd, mask=c_mask)

    if UPDATE_RUNNING:
        if (pid_c == 0) & (pid_r == 0):
            # One program updates every channel, so num_batches_tracked is read before it is written.
            n_all = tl.load(stats_ptr + 2 * C)
            c_end = tl.where(n_all > 0, C, 0)  # every rank empty: leave the running stats alone
            if HAS_NBT:
                nbt = tl.load(nbt_ptr)
            if CUMULATIVE:
                factor = 1.0 / (nbt + 1).to(tl.float32)
            else:
                factor = momentum
            for c0 in range(0, C, BLOCK_C):
                cc = c0 + tl.arange(0, BLOCK_C)
                cm = cc < c_end
                m64, v64, n64 = channel_stats(stats_ptr, rmean_ptr, rvar_ptr, cc, cm, C, TRAINING)
                unbiased = (v64 * n64 / tl.maximum(n64 - 1.0, 1.0)).to(tl.float32)
                rm = tl.load(rmean_ptr + cc, mask=cm, other=0.0).to(tl.float32)
                rv = tl.load(rvar_ptr + cc, mask=cm, other=0.0).to(tl.float32)
                rm = rm * (1.0 - factor) + m64.to(tl.float32) * factor
                rv = rv * (1.0 - factor) + unbiased * factor
                tl.store(rmean_ptr + cc, rm.to(rmean_ptr.dtype.element_ty), mask=cm)
                tl.store(rvar_ptr + cc, rv.to(rvar_ptr.dtype.element_ty), mask=cm)
            if HAS_NBT:
                tl.store(nbt_ptr, nbt + tl.where(n_all > 0, 1, 0).to(tl.int64))

    hi, lo = split_mean(mean64)
    if HAS_WEIGHT:
        scale = invstd * tl.load(w_ptr + cols, mask=c_mask, other=1.0).to(tl.float32)
    else:
        scale = invstd
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)

    lanes = tl.arange(0, BLOCK_I)
    if USE_INT64:
        cols = cols.to(tl.int64)
        lanes = lanes.to(tl.int64)
    t_start = pid_r * tiles_per_prog
    t_end = tl.minimum(t_start + tiles_per_prog, tiles)
    for t in range(t_start, t_end):
        o0, o1, o2, i0 = tile_index(t, inner_tiles, O1, O2, BLOCK_I, USE_INT64)
        inner = i0 + lanes
        mask = c_mask[:, None] & (inner < INNER)[None, :]
        x = tl.load(x_ptr + tile_offsets(o0, o1, o2, cols, inner, sx_c, sx_o0, sx_o1, sx_o2, sx_i), mask=mask)
        x = x.to(tl.float32)
        y = ((x - hi[:, None]) - lo[:, None]) * scale[:, None] + bias[:, None]
        if HAS_RESIDUAL:
            r_offs = tile_offsets(o0, o1, o2, cols, inner, sr_c, sr_o0, sr_o1, sr_o2, sr_i)
            y += tl.load(r_ptr + r_offs, mask=mask).to(tl.float32)
        y = activate(y, slope, ACTIVATION)
        y_offs = tile_offsets(o0, o1, o2, cols, inner, sy_c, sy_o0, sy_o1, sy_o2, sy_i)
        tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def empty_like_layout(x: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor shaped like ``x`` in ``x``'s memory format (dim order kept, gaps dropped)."""
    return torch.empty_like(x, memory_format=torch.preserve_format)


def batch_norm_elemt(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    stats: torch.Tensor | None = None,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    num_batches_tracked: torch.Tensor | None = None,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    negative_slope: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalize ``x``, then add ``residual`` and apply ``activation``; in training, also update the running stats.

    Args:
        x: ``(N, C, *S)`` input, fp32/fp16/bf16, any strides.
        weight, bias: ``(C,)`` affine parameters, or ``None``.
        stats: the packed global sums ``(3, C)`` fp64 from :func:`batch_norm_stats` (summed over
            ranks). Given: training mode, normalize with the batch statistics. ``None``: eval mode,
            normalize with ``running_mean`` / ``running_var``, which are then required.
        running_mean, running_var: ``(C,)`` buffers. In training they are updated in place
            (unbiased var), unless both are ``None``.
        num_batches_tracked: ``()`` int64 buffer, incremented in place in training when given.
            Required when ``momentum`` is ``None`` (cumulative moving average).
        momentum: the running-stat update factor, or ``None`` for a cumulative average.
        eps: added to the variance.
        residual: a tensor shaped like ``x`` (any strides) added after the affine transform, or ``None``.
        activation: ``None``, ``"relu"``, ``"leaky_relu"`` (with ``negative_slope``) or ``"silu"``,
            applied last.

    Returns:
        ``(y, mean, invstd)``: ``y`` like ``x`` (same dtype and memory format), ``mean`` ``(C,)``
        fp64 and ``invstd`` ``(C,)`` fp32, the statistics ``y`` was normalized with.
    """
    training = stats is not None
    if not training and (running_mean is None or running_var is None):
        raise ValueError("batch_norm_elemt: eval mode (stats=None) needs running_mean and running_var")
    if momentum is None and training and running_mean is not None and num_batches_tracked is None:
        raise ValueError("batch_norm_elemt: momentum=None needs num_batches_tracked")
    y = empty_like_layout(x)
    layout = plan(x.shape, x, y, residual if residual is not None else x)
    C = layout.C
    mean = torch.empty(C, dtype=torch.float64, device=x.device)
    invstd = torch.empty(C, dtype=torch.float32, device=x.device)
    update = training and running_mean is not None
    dummy = mean
    _batch_norm_elemt_kernel[layout.grid](
        x,
        y,
        residual if residual is not None else x,
        weight if weight is not None else dummy,
        bias if bias is not None else dummy,
        stats if training else dummy,
        running_mean if running_mean is not None else dummy,
        running_var if running_var is not None else dummy,
        num_batches_tracked if num_batches_tracked is not None else dummy,
        mean,
        invstd,
        C,
        layout.O1,
        layout.O2,
        layout.INNER,
        layout.inner_tiles,
        layout.tiles,
        layout.tiles_per_prog,
        *layout.strides[0],
        *layout.strides[1],
        *layout.strides[2],
        0.0 if momentum is None else float(momentum),
        float(eps),
        float(negative_slope),
        TRAINING=training,
        UPDATE_RUNNING=update,
        CUMULATIVE=update and momentum is None,
        HAS_NBT=update and num_batches_tracked is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        ACTIVATION=ACTIVATION_CODES[activation],
        BLOCK_C=layout.BLOCK_C,
        BLOCK_I=layout.BLOCK_I,
        USE_INT64=layout.use_int64,
        num_warps=layout.num_warps,
    )
    return y, mean, invstd
