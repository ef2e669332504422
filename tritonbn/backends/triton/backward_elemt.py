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

from tritonbn.backends.launchers import Saved
from tritonbn.backends.triton._common import (
    ACTIVATION_CODES,
    AUX_OUTPUT,
    acc_dtypes,
    channel_block,
    channel_view,
    dense,
    grad_z,
    lane_channels,
    per_lane,
    split_mean,
    tile_keep,
    tile_mask,
    tile_next,
    tile_offsets,
    tile_rows,
    tile_start,
)
from tritonbn.backends.triton._launch import Launch, refit_with
from tritonbn.backends.triton._plan import cache_put, launch_cache, plan
from tritonbn.backends.triton.backward_reduce import aux_tensor
from tritonbn.backends.triton.elemt import empty_like_layout


# One compiled kernel whether a program gets one tile or many (Triton would specialize a 1).
@triton.jit(do_not_specialize=["tiles_per_prog"])
def _batch_norm_backward_elemt_kernel(
    # pointers
    dy_ptr,  # (N, C, *S)
    x_ptr,  # (N, C, *S)
    aux_ptr,  # (N, C, *S) residual or output y (fused activation), or unused
    dx_ptr,  # (N, C, *S) out, dtype of x, or unused
    dr_ptr,  # (N, C, *S) out: the residual's gradient, or unused
    mean_ptr,  # (C,) fp64
    invstd_ptr,  # (C,) ACC
    w_ptr,  # (C,) or unused
    b_ptr,  # (C,) or unused
    sums_ptr,  # (2, C) ACC global [sum_dy | sum_dy_xhat] (training)
    count_ptr,  # fp64, first element: the global count per channel (training)
    m_ptr,  # masked BatchNorm: (N, *S) uint8 viewed as (N, C, *S), nonzero at real positions; else unused
    # sizes
    C,
    O1,
    O2,
    INNER_V,
    inner_tiles,
    tiles,
    tiles_per_prog,
    # strides of dy, x, aux, dx and dr
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
    sm_c,  # strides of the mask
    sm_o0,
    sm_o1,
    sm_o2,
    sm_i,
    slope,
    # meta-parameters
    TRAINING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    AUX: tl.constexpr,
    WRITE_DX: tl.constexpr,
    WRITE_DR: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_I: tl.constexpr,
    VEC: tl.constexpr,
    PLANE: tl.constexpr,  # packed plans: lanes per channel (see _plan); 0 otherwise
    PACK: tl.constexpr,  # channels per program
    USE_INT64: tl.constexpr,
    HAS_MASK: tl.constexpr,  # masked BatchNorm: dx = d(residual) = 0 at padded positions
):
    """dx = (dz - mean(dz) - xhat * mean(dz * xhat)) * invstd * weight, and d(residual) = dz."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols, c_mask = channel_block(pid_c, C, BLOCK_C, PACK)
    invstd = tl.load(invstd_ptr + cols, mask=c_mask, other=0.0).to(ACC)
    if HAS_WEIGHT:
        scale = invstd * tl.load(w_ptr + cols, mask=c_mask, other=0.0).to(ACC)
    else:
        scale = invstd
    bias = tl.zeros([BLOCK_C], dtype=ACC)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(ACC)
    hi, lo = split_mean(tl.load(mean_ptr + cols, mask=c_mask, other=0.0), ACC)
    lane_ch = lane_channels(BLOCK_I, PLANE)
    if TRAINING:
        inv_n = (1.0 / tl.maximum(tl.load(count_ptr), 1.0)).to(ACC)
        mean_dy = tl.load(sums_ptr + cols, mask=c_mask, other=0.0).to(ACC) * inv_n
        # xhat * mean(dy * xhat) = (x - mean) * invstd^2 * mean(dy * xhat)
        k = tl.load(sums_ptr + C + cols, mask=c_mask, other=0.0).to(ACC) * inv_n * invstd
        # dx = (dz - k * (x - hi)) * scale + c, with c = (k * lo - mean_dy) * scale
        c = per_lane((k * lo - mean_dy) * scale, lane_ch, PLANE)
        k = per_lane(k, lane_ch, PLANE)
    hi = per_lane(hi, lane_ch, PLANE)
    lo = per_lane(lo, lane_ch, PLANE)
    scale = per_lane(scale, lane_ch, PLANE)
    bias = per_lane(bias, lane_ch, PLANE)
    lanes = tl.arange(0, BLOCK_I)
    if USE_INT64:
        cols = cols.to(tl.int64)
        lanes = lanes.to(tl.int64)
    NEED_X: tl.constexpr = TRAINING or (ACTIVATION != 0 and AUX != 2)  # dx needs xhat, or z is recomputed
    READ_AUX: tl.constexpr = ACTIVATION != 0 and AUX != 0
    OVEC: tl.constexpr = 1 if PLANE > 0 else VEC  # what tile_offsets multiplies the strides by
    rows, row_mask, inner_v = tile_rows(pid_c, cols, c_mask, C, INNER_V, PLANE, PACK, VEC)
    t_start = pid_r * tiles_per_prog
    t_end = tl.minimum(t_start + tiles_per_prog, tiles)
    o, it = tile_start(t_start, inner_tiles, USE_INT64)
    inner, mask = tile_mask(it, t_start < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
    dy = tl.load(dy_ptr + tile_offsets(o, rows, inner, O1, O2, sdy_c, sdy_o0, sdy_o1, sdy_o2, sdy_i, OVEC), mask=mask)
    if NEED_X:
        x = tl.load(x_ptr + tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC), mask=mask)
    if READ_AUX:
        aux = tl.load(aux_ptr + tile_offsets(o, rows, inner, O1, O2, sa_c, sa_o0, sa_o1, sa_o2, sa_i, OVEC), mask=mask)
    if HAS_MASK:
        keep = tile_keep(m_ptr, o, inner, t_start < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i, OVEC)
    for t in range(t_start, t_end):
        o_cur, inner_cur, out_mask = o, inner, mask
        # Prefetch the next tile (masked off past the chunk), then compute and store the current one.
        o, it = tile_next(o, it, inner_tiles)
        inner, mask = tile_mask(it, t + 1 < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
        dy_next = tl.load(
            dy_ptr + tile_offsets(o, rows, inner, O1, O2, sdy_c, sdy_o0, sdy_o1, sdy_o2, sdy_i, OVEC), mask=mask
        )
        if NEED_X:
            x_next = tl.load(
                x_ptr + tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC), mask=mask
            )
        if READ_AUX:
            a_offs = tile_offsets(o, rows, inner, O1, O2, sa_c, sa_o0, sa_o1, sa_o2, sa_i, OVEC)
            aux_next = tl.load(aux_ptr + a_offs, mask=mask)
        if HAS_MASK:
            keep_next = tile_keep(m_ptr, o, inner, t + 1 < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i, OVEC)
        # Every load of the next tile is issued; now the current one.
        dz = dy.to(ACC)
        if NEED_X:
            xc = x.to(ACC) - hi
            x = x_next
        else:
            xc = dz
        if READ_AUX:
            a = aux.to(ACC)
            aux = aux_next
        else:
            a = dz
        if ACTIVATION != 0:
            dz = grad_z(dz, xc - lo, scale, bias, a, slope, ACTIVATION, AUX)
        if HAS_MASK:  # the output is a constant 0 at padded positions: no gradient flows there
            dz = tl.where(keep, dz, 0.0)
        if WRITE_DR:
            dr_offs = tile_offsets(o_cur, rows, inner_cur, O1, O2, sdr_c, sdr_o0, sdr_o1, sdr_o2, sdr_i, OVEC)
            tl.store(dr_ptr + dr_offs, dz.to(dr_ptr.dtype.element_ty), mask=out_mask)
        if WRITE_DX:
            if TRAINING:
                dx = (dz - xc * k) * scale + c
            else:
                dx = dz * scale
            if HAS_MASK:
                dx = tl.where(keep, dx, 0.0)
            dx_offs = tile_offsets(o_cur, rows, inner_cur, O1, O2, sdx_c, sdx_o0, sdx_o1, sdx_o2, sdx_i, OVEC)
            tl.store(dx_ptr + dx_offs, dx.to(dx_ptr.dtype.element_ty), mask=out_mask)
        dy = dy_next
        if HAS_MASK:
            keep = keep_next


def launcher(options, grad_out, saved: Saved, sums, count, input_grad: bool, out_grad_residual):
    """The input gradient (see :meth:`~tritonbn.backends.launchers.Launchers.batch_norm_backward_elemt`): ``dx``, or
    ``None`` without ``input_grad``; one launch, none where no gradient is asked for."""
    s, dr = saved, out_grad_residual
    aux, aux_kind = aux_tensor(options.activation, s.residual, s.output, options.negative_slope)
    if not input_grad and dr is None:
        return None
    mask = None if s.mask is None else channel_view(s.mask, s.x)
    launch = find(options, grad_out, s, sums, count, aux, aux_kind, input_grad, dr, mask)
    return run(launch, grad_out, s, sums, count, aux, input_grad, dr, mask)


def find(options, grad_out, saved: Saved, sums, count, aux, aux_kind, input_grad, dr, mask=None, own=False) -> Launch:
    """The launch for these arguments (``aux`` from :func:`aux_tensor`, ``mask`` as :func:`channel_view` gives it, not
    the one in ``saved``), from the cache keyed by what it depends on besides the pointers' alignment
    (``_prepared``'s launchers keep it for the calls of one layer like the last one). ``own``: ``mean``, ``invstd``,
    an ``output``, ``sums``, ``count`` and ``dr`` (the residual's gradient) are the passes' own (``count`` a view of
    their ``stats`` at a multiple of 16 bytes), whose alignment the launch need not read."""
    s, activation, negative_slope = saved, options.activation, options.negative_slope
    x, weight, bias = s.x, s.weight, s.bias
    key = (x.shape, x.stride(), x.dtype, x.device, grad_out.stride(), grad_out.dtype, s.mean.dtype, s.invstd.dtype, own)
    key += (None if weight is None else weight.dtype, None if bias is None else bias.dtype, activation, input_grad)
    key += (None if sums is None else (sums.dtype, count.dtype), negative_slope, None if dr is None else dr.stride())
    key += (None if dr is None else dr.dtype, None if aux is None else (aux_kind, aux.stride(), aux.dtype))
    if mask is not None:
        key = (*key, mask.stride())
    launch = _launches.get(key)
    if launch is None:
        flags = (sums is not None, activation, negative_slope, aux_kind, input_grad)
        launch = cache_put(_launches, key, _launch((grad_out, x, weight, bias, aux, dr, mask), flags, own=own))
    return launch


def run(launch: Launch, grad_out, saved: Saved, sums, count, aux, input_grad, dr, mask=None):
    """:func:`launcher` with its launch found (:func:`find`): ``dx``, or ``None``. ``mask``: as :func:`find` takes
    it."""
    x, invstd, training = saved.x, saved.invstd, sums is not None
    dx = torch.empty_like(x) if input_grad else None  # preserve_format, the default
    weight, bias = dense(saved.weight), dense(saved.bias)
    launch(
        grad_out,
        x,
        aux if aux is not None else x,
        dx if dx is not None else x,
        dr if dr is not None else x,
        saved.mean,
        invstd,
        weight if weight is not None else invstd,
        bias if bias is not None else invstd,
        sums if training else invstd,
        count if training else invstd,
        x if mask is None else mask,
    )
    return dx


_launches = launch_cache()


def _launch(tensors: tuple, flags: tuple, per_sm=None, own=False) -> Launch:
    """The launch of the backward elementwise kernel on arguments like these (see the key in :func:`find`):
    ``tensors`` ``(grad_out, x, weight, bias, aux, dr, mask)``, ``flags`` ``(training, activation, negative_slope,
    aux_kind, input_grad)``."""
    grad_out, x, weight, bias, aux, dr, mask = tensors
    training, activation, negative_slope, aux_kind, input_grad = flags
    dx = empty_like_layout(x) if input_grad else None
    layout = plan(x.shape, grad_out, x, *(t if t is not None else x for t in (aux, dx, dr)), per_sm=per_sm, mask=mask)
    constexprs = dict(
        TRAINING=training,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        ACTIVATION=ACTIVATION_CODES[activation],
        AUX=aux_kind,
        WRITE_DX=dx is not None,
        WRITE_DR=dr is not None,
        ACC=acc_dtypes(x)[0],
        BLOCK_C=layout.BLOCK_C,
        BLOCK_I=layout.BLOCK_I,
        VEC=layout.VEC,
        PLANE=layout.PLANE,
        PACK=layout.PACK,
        USE_INT64=layout.use_int64,
        HAS_MASK=mask is not None,
    )
    tail = (*layout.size_args, *layout.stride_args, float(negative_slope))
    refit = None if per_sm else refit_with(_launch, tensors, flags, device=x.device)
    checked = _checked(weight, bias, training and not own, aux, aux_kind, dr, mask, own)
    return Launch(
        _batch_norm_backward_elemt_kernel,
        layout.grid,
        tail,
        constexprs,
        layout.num_warps,
        pointers=12,
        refit=refit,
        checked=checked,
    )


def _checked(weight, bias, given_sums, aux, aux_kind, dr, mask, own=False) -> tuple[int, ...]:
    """The pointers whose alignment a launch reads (see :class:`Launch`): the call's own tensors (``sums`` and
    ``count`` where ``given_sums``; not the statistics, an ``output`` and ``dr`` where they are the passes' ``own``),
    not ``dx`` (which it allocates), nor the stand-ins for absent tensors (``x``, ``invstd``)."""
    given = {4: None if own else dr, 7: weight, 8: bias, 11: mask}
    if not (own and aux_kind == AUX_OUTPUT):
        given[2] = aux
    read = {0, 1, *(i for i, t in given.items() if t is not None)}
    if not own:
        read |= {5, 6}
    if given_sums:
        read |= {9, 10}
    return tuple(sorted(read))
