"""Backward reduction: ``batch_norm_backward_reduce``.

Stage 1 runs on the same ``(channel blocks, reduction chunks)`` grid as the forward and writes
per-program fp32 partials of ``sum(dz)`` and ``sum(dz * xhat)``, ``xhat = (x - mean) * invstd``,
where ``dz = dy * act'(z)`` is the gradient before a fused activation (``dz = dy`` without one).
Stage 2 sums them in a fixed order into the packed buffer ``[sum_dy | sum_dy_xhat]`` that is
all-reduced across ranks, and into the *local* ``grad_bias = sum_dy`` and
``grad_weight = sum_dy_xhat`` (DDP averages those, as with ``torch.nn.SyncBatchNorm``).
"""

import torch
import triton
import triton.language as tl

from tritonbn.activations import check_output_gives_grad
from tritonbn.kernels._common import (
    ACTIVATION_CODES,
    AUX_NONE,
    AUX_OUTPUT,
    AUX_RESIDUAL,
    grad_z,
    split_mean,
    tile_index,
    tile_offsets,
)
from tritonbn.kernels._layout import plan
from tritonbn.kernels.stats import finalize_blocks


@triton.jit
def _batch_norm_backward_reduce_kernel(
    # pointers
    dy_ptr,  # (N, C, *S)
    x_ptr,  # (N, C, *S)
    aux_ptr,  # (N, C, *S) residual or output y (fused activation), or unused
    mean_ptr,  # (C,) fp64 saved mean
    invstd_ptr,  # (C,) fp32 saved invstd
    w_ptr,  # (C,) or unused
    b_ptr,  # (C,) or unused
    part_ptr,  # (2, R, C) fp32 out: sum_dz, sum_dz_xhat of each program's chunk
    # sizes
    C,
    O1,
    O2,
    INNER,
    inner_tiles,
    tiles,
    tiles_per_prog,
    R,
    # strides of dy and x
    sdy_c,
    sdy_o0,
    sdy_o1,
    sdy_o2,
    sdy_i,
    sx_c,
    sx_o0,
    sx_o1,
    sx_o2,
    sx_i,
    sa_c,
    sa_o0,
    sa_o1,
    sa_o2,
    sa_i,
    slope,
    # meta-parameters
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    AUX: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_I: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """Per-program partial sums of dz and dz * xhat."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < C
    hi, lo = split_mean(tl.load(mean_ptr + cols, mask=c_mask, other=0.0))
    invstd = tl.load(invstd_ptr + cols, mask=c_mask, other=0.0)
    scale = invstd
    if HAS_WEIGHT:
        scale = invstd * tl.load(w_ptr + cols, mask=c_mask, other=1.0).to(tl.float32)
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
    lanes = tl.arange(0, BLOCK_I)
    if USE_INT64:
        cols = cols.to(tl.int64)
        lanes = lanes.to(tl.int64)
    acc_dy = tl.zeros([BLOCK_C, BLOCK_I], dtype=tl.float32)
    acc_dyx = tl.zeros([BLOCK_C, BLOCK_I], dtype=tl.float32)
    t_start = pid_r * tiles_per_prog
    t_end = tl.minimum(t_start + tiles_per_prog, tiles)
    for t in range(t_start, t_end):
        o0, o1, o2, i0 = tile_index(t, inner_tiles, O1, O2, BLOCK_I, USE_INT64)
        inner = i0 + lanes
        mask = c_mask[:, None] & (inner < INNER)[None, :]
        dy_offs = tile_offsets(o0, o1, o2, cols, inner, sdy_c, sdy_o0, sdy_o1, sdy_o2, sdy_i)
        x_offs = tile_offsets(o0, o1, o2, cols, inner, sx_c, sx_o0, sx_o1, sx_o2, sx_i)
        dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, (x - hi[:, None]) - lo[:, None], 0.0)
        aux = dy
        if ACTIVATION != 0 and AUX != 0:
            aux_offs = tile_offsets(o0, o1, o2, cols, inner, sa_c, sa_o0, sa_o1, sa_o2, sa_i)
            aux = tl.load(aux_ptr + aux_offs, mask=mask, other=0.0).to(tl.float32)
        dz = tl.where(mask, grad_z(dy, xc, scale, bias, aux, slope, ACTIVATION, AUX), 0.0)
        acc_dy += dz
        acc_dyx += dz * xc
    out = part_ptr + pid_r * C + cols
    tl.store(out, tl.sum(acc_dy, axis=1), mask=c_mask)
    tl.store(out + R * C, tl.sum(acc_dyx, axis=1) * invstd, mask=c_mask)


@triton.jit
def _batch_norm_backward_finalize_kernel(
    part_ptr,  # (2, R, C) fp32 partials
    sums_ptr,  # (2, C) fp32 out: [sum_dy | sum_dy_xhat]
    gw_ptr,  # (C,) out: local grad_weight, or unused
    gb_ptr,  # (C,) out: local grad_bias, or unused
    R,
    C,
    HAS_GW: tl.constexpr,
    HAS_GB: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Fixed-order sum of the partials; also writes the local weight and bias gradients."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < C
    rows = tl.arange(0, BLOCK_R)
    s_dy = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    s_dyx = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + rows
        mask = (r < R)[:, None] & c_mask[None, :]
        offs = r[:, None] * C + cols[None, :]
        s_dy += tl.load(part_ptr + offs, mask=mask, other=0.0)
        s_dyx += tl.load(part_ptr + R * C + offs, mask=mask, other=0.0)
    sum_dy = tl.sum(s_dy, axis=0)
    sum_dyx = tl.sum(s_dyx, axis=0)
    tl.store(sums_ptr + cols, sum_dy, mask=c_mask)
    tl.store(sums_ptr + C + cols, sum_dyx, mask=c_mask)
    if HAS_GW:
        tl.store(gw_ptr + cols, sum_dyx.to(gw_ptr.dtype.element_ty), mask=c_mask)
    if HAS_GB:
        tl.store(gb_ptr + cols, sum_dy.to(gb_ptr.dtype.element_ty), mask=c_mask)


def aux_tensor(activation, residual, output, negative_slope) -> tuple[torch.Tensor | None, int]:
    """The tensor the backward kernels read to find act'(z), and its AUX code."""
    if activation is None:
        return None, AUX_NONE
    if output is not None:
        check_output_gives_grad(activation, negative_slope)
        return output, AUX_OUTPUT
    if residual is not None:
        return residual, AUX_RESIDUAL
    return None, AUX_NONE


def batch_norm_backward_reduce(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    weight_grad: bool = True,
    bias_grad: bool = True,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    negative_slope: float = 0.01,
    residual: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Local per-channel reductions for the backward pass.

    Args:
        grad_out: ``(N, C, *S)`` upstream gradient ``dy``, any strides (a stride-0 expanded
            gradient works).
        x: the forward input, any strides.
        mean, invstd: ``(C,)`` saved statistics from :func:`batch_norm_elemt`.
        weight: ``(C,)`` parameter or ``None``; gives the dtype of ``grad_weight``/``grad_bias``.
        weight_grad, bias_grad: whether to return ``grad_weight`` / ``grad_bias``.
        bias, activation, negative_slope, residual, output: for a forward with a fused activation,
            ``dy`` is taken at ``y = act(z)`` and the sums are over ``dz = dy * act'(z)``. ``act'`` is
            read from the sign of ``output`` (y) when given (relu, or leaky_relu with a slope >= 0),
            else from ``z = xhat * weight + bias (+ residual)`` recomputed from ``x``.

    Returns:
        ``(sums, grad_weight, grad_bias)``: ``sums`` is ``(2, C)`` fp32 contiguous,
        ``[sum(dz) | sum(dz * xhat)]``, to be summed over ranks; ``grad_weight = sum(dz * xhat)``
        and ``grad_bias = sum(dz)`` are this rank's own, or ``None`` when not asked for.
    """
    aux, aux_kind = aux_tensor(activation, residual, output, negative_slope)
    layout = plan(x.shape, grad_out, x, aux if aux is not None else x)
    C, R = layout.C, layout.r_progs
    part = torch.empty((2, R, C), dtype=torch.float32, device=x.device)
    sums = torch.empty((2, C), dtype=torch.float32, device=x.device)
    gdtype = weight.dtype if weight is not None else torch.float32
    grad_weight = torch.empty(C, dtype=gdtype, device=x.device) if weight_grad else None
    grad_bias = torch.empty(C, dtype=gdtype, device=x.device) if bias_grad else None
    _batch_norm_backward_reduce_kernel[layout.grid](
        grad_out,
        x,
        aux if aux is not None else x,
        mean,
        invstd,
        weight if weight is not None else invstd,
        bias if bias is not None else invstd,
        part,
        C,
        layout.O1,
        layout.O2,
        layout.INNER,
        layout.inner_tiles,
        layout.tiles,
        layout.tiles_per_prog,
        R,
        *layout.strides[0],
        *layout.strides[1],
        *layout.strides[2],
        float(negative_slope),
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        ACTIVATION=ACTIVATION_CODES[activation],
        AUX=aux_kind,
        BLOCK_C=layout.BLOCK_C,
        BLOCK_I=layout.BLOCK_I,
        USE_INT64=layout.use_int64,
        num_warps=layout.num_warps,
    )
    block_r, block_c = finalize_blocks(R, C)
    _batch_norm_backward_finalize_kernel[(triton.cdiv(C, block_c),)](
        part,
        sums,
        grad_weight if grad_weight is not None else sums,
        grad_bias if grad_bias is not None else sums,
        R,
        C,
        HAS_GW=grad_weight is not None,
        HAS_GB=grad_bias is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
    )
    return sums, grad_weight, grad_bias
