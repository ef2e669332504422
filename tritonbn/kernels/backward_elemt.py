"""Backward elementwise pass: ``batch_norm_backward_elemt``.

With the global sums ``[sum_dz | sum_dz_xhat]`` (after the all-reduce) and the global count ``n``,

    dx = (dz - sum_dz / n - xhat * sum_dz_xhat / n) * invstd * weight

where ``dz = dy * act'(z)`` is the gradient before a fused activation (``dz = dy`` without one),
computed in the same pass; the fused residual's gradient is ``dz`` itself. In eval (statistics
that do not depend on x) the mean terms vanish: ``dx = dz * invstd * weight``.
"""

import torch
import triton
import triton.language as tl

from tritonbn.kernels._common import ACTIVATION_CODES, grad_z, split_mean, tile_index, tile_offsets
from tritonbn.kernels._layout import plan
from tritonbn.kernels.backward_reduce import aux_tensor
from tritonbn.kernels.elemt import empty_like_layout


@triton.jit
def _batch_norm_backward_elemt_kernel(
    # pointers
    dy_ptr,  # (N, C, *S)
    x_ptr,  # (N, C, *S)
    aux_ptr,  # (N, C, *S) residual or output y (fused activation), or unused
    dx_ptr,  # (N, C, *S) out, dtype of x, or unused
    dr_ptr,  # (N, C, *S) out: the residual's gradient, or unused
    mean_ptr,  # (C,) fp64
    invstd_ptr,  # (C,) fp32
    w_ptr,  # (C,) or unused
    b_ptr,  # (C,) or unused
    sums_ptr,  # (2, C) fp32 global [sum_dy | sum_dy_xhat] (training)
    count_ptr,  # (C,) fp64 global count (training)
    # sizes
    C,
    O1,
    O2,
    INNER,
    inner_tiles,
    tiles,
    tiles_per_prog,
    # strides of dy, x and dx
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
    sdx_c,
    sdx_o0,
    sdx_o1,
    sdx_o2,
    sdx_i,
    sdr_c,
    sdr_o0,
    sdr_o1,
    sdr_o2,
    sdr_i,
    slope,
    # meta-parameters
    TRAINING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    AUX: tl.constexpr,
    WRITE_DX: tl.constexpr,
    WRITE_DR: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_I: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """dx = (dz - mean(dz) - xhat * mean(dz * xhat)) * invstd * weight, and d(residual) = dz."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < C
    invstd = tl.load(invstd_ptr + cols, mask=c_mask, other=0.0)
    if HAS_WEIGHT:
        scale = invstd * tl.load(w_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
    else:
        scale = invstd
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
    hi, lo = split_mean(tl.load(mean_ptr + cols, mask=c_mask, other=0.0))
    if TRAINING:
        inv_n = 1.0 / tl.maximum(tl.load(count_ptr + cols, mask=c_mask, other=1.0), 1.0).to(tl.float32)
        mean_dy = tl.load(sums_ptr + cols, mask=c_mask, other=0.0) * inv_n
        # xhat * mean(dy * xhat) = (x - mean) * invstd^2 * mean(dy * xhat)
        k = tl.load(sums_ptr + C + cols, mask=c_mask, other=0.0) * inv_n * invstd
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
        dy_offs = tile_offsets(o0, o1, o2, cols, inner, sdy_c, sdy_o0, sdy_o1, sdy_o2, sdy_i)
        dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(tl.float32)
        if TRAINING or (ACTIVATION != 0 and AUX != 2):  # dx needs xhat, or z is recomputed from x
            x_offs = tile_offsets(o0, o1, o2, cols, inner, sx_c, sx_o0, sx_o1, sx_o2, sx_i)
            x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
            xc = (x - hi[:, None]) - lo[:, None]
        else:
            xc = dy
        aux = dy
        if ACTIVATION != 0 and AUX != 0:
            aux_offs = tile_offsets(o0, o1, o2, cols, inner, sa_c, sa_o0, sa_o1, sa_o2, sa_i)
            aux = tl.load(aux_ptr + aux_offs, mask=mask, other=0.0).to(tl.float32)
        dz = grad_z(dy, xc, scale, bias, aux, slope, ACTIVATION, AUX)
        if WRITE_DR:
            dr_offs = tile_offsets(o0, o1, o2, cols, inner, sdr_c, sdr_o0, sdr_o1, sdr_o2, sdr_i)
            tl.store(dr_ptr + dr_offs, dz.to(dr_ptr.dtype.element_ty), mask=mask)
        if WRITE_DX:
            if TRAINING:
                dx = (dz - mean_dy[:, None] - xc * k[:, None]) * scale[:, None]
            else:
                dx = dz * scale[:, None]
            dx_offs = tile_offsets(o0, o1, o2, cols, inner, sdx_c, sdx_o0, sdx_o1, sdx_o2, sdx_i)
            tl.store(dx_ptr + dx_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def batch_norm_backward_elemt(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    negative_slope: float = 0.01,
    residual: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    input_grad: bool = True,
    out_grad_residual: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Input gradient of batch norm (and of a fused residual add and activation).

    Args:
        grad_out: ``(N, C, *S)`` upstream gradient, any strides.
        x: the forward input, any strides.
        mean, invstd: ``(C,)`` statistics the forward normalized with.
        weight: ``(C,)`` or ``None``.
        sums: ``(2, C)`` fp32 ``[sum_dz | sum_dz_xhat]`` summed over the ranks that shared the
            statistics (from :func:`batch_norm_backward_reduce` plus an all-reduce). ``None`` means
            the statistics were constants (eval): ``dx = dz * invstd * weight``.
        count: ``(C,)`` fp64 global element count per channel (row 2 of the forward ``stats``);
            required with ``sums``.
        bias, activation, negative_slope, residual, output: the fused epilogue of the forward, as
            for :func:`batch_norm_backward_reduce`.
        input_grad: compute ``dx`` (else return ``None``, e.g. to fill only the residual's gradient).
        out_grad_residual: a tensor shaped like ``x`` to write the residual's gradient ``dz`` into.

    Returns:
        ``dx`` like ``x`` (same dtype and memory format), or ``None`` when ``input_grad`` is false.
    """
    training = sums is not None
    if training and count is None:
        raise ValueError("batch_norm_backward_elemt: sums needs count")
    aux, aux_kind = aux_tensor(activation, residual, output, negative_slope)
    dx = empty_like_layout(x) if input_grad else None
    if dx is None and out_grad_residual is None:
        return None
    layout = plan(x.shape, grad_out, x, *(t if t is not None else x for t in (aux, dx, out_grad_residual)))
    _batch_norm_backward_elemt_kernel[layout.grid](
        grad_out,
        x,
        aux if aux is not None else x,
        dx if dx is not None else x,
        out_grad_residual if out_grad_residual is not None else x,
        mean,
        invstd,
        weight if weight is not None else invstd,
        bias if bias is not None else invstd,
        sums if training else invstd,
        count if training else invstd,
        layout.C,
        layout.O1,
        layout.O2,
        layout.INNER,
        layout.inner_tiles,
        layout.tiles,
        layout.tiles_per_prog,
        *(s for strides in layout.strides for s in strides),
        float(negative_slope),
        TRAINING=training,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        ACTIVATION=ACTIVATION_CODES[activation],
        AUX=aux_kind,
        WRITE_DX=dx is not None,
        WRITE_DR=out_grad_residual is not None,
        BLOCK_C=layout.BLOCK_C,
        BLOCK_I=layout.BLOCK_I,
        USE_INT64=layout.use_int64,
        num_warps=layout.num_warps,
    )
    return dx
