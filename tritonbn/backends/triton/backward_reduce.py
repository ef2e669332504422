"""Backward reduction: ``batch_norm_backward_reduce``, one launch.

The kernel runs on the same ``(channel blocks, reduction chunks)`` grid as the forward. Each program
sums, per lane, ``dz`` and ``dz * (x - mean_hi)``, where ``dz = dy * act'(z)`` is the gradient before
a fused activation (``dz = dy`` without one): two loads, one subtract, one add and one fused
multiply-add per element. It merges its lanes and writes one partial per channel; the partials are
added in a fixed order, in fp64, in two levels past 16 programs (see
:func:`tritonbn.backends.triton._common.merge_tree`), and the program left holding the sums writes the
packed buffer ``[sum_dz | sum_dz_xhat]`` that is all-reduced across ranks, with

    sum_dz_xhat = (sum(dz * (x - mean_hi)) - mean_lo * sum_dz) * invstd,

and the *local* ``grad_bias = sum_dz`` and ``grad_weight = sum_dz_xhat`` (DDP averages those, as
with ``torch.nn.SyncBatchNorm``).
"""

import torch
import triton
import triton.language as tl

from tritonbn._numerics import compute_dtype
from tritonbn.activations import check_output_gives_grad
from tritonbn.backends.launchers import Saved
from tritonbn.backends.triton._common import (
    ACTIVATION_CODES,
    AUX_NONE,
    AUX_OUTPUT,
    AUX_RESIDUAL,
    acc_dtypes,
    channel_block,
    channel_view,
    dense,
    grad_z,
    lane_channels,
    merge_tree,
    per_lane,
    rounded_for,
    split_mean,
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


# One compiled kernel whether a program gets one tile or many, one partial or many (Triton would
# specialize arguments equal to 1 and drop the loop).
@triton.jit
def _grad_terms(dy, x, aux, hi_l, lo_l, scale_l, bias_l, slope, ACC: tl.constexpr, ACTIVATION: tl.constexpr,
                AUX: tl.constexpr, READ_AUX: tl.constexpr):  # fmt: skip
    """One tile's ``(dz, dz * (x - mean_hi))``: ``dz = dy`` through the fused activation's derivative.
    Lanes that read ``dy = 0`` (masked) give exactly 0 to both."""
    xc = x.to(ACC) - hi_l
    dz = dy.to(ACC)
    if ACTIVATION != 0:
        if READ_AUX:
            a = aux.to(ACC)
        else:
            a = dz
        dz = grad_z(dz, xc - lo_l, scale_l, bias_l, a, slope, ACTIVATION, AUX)
    return dz, dz * xc


@triton.jit(do_not_specialize=["tiles_per_prog", "R", "G"])
def _batch_norm_backward_reduce_kernel(
    # pointers
    dy_ptr,  # (N, C, *S)
    x_ptr,  # (N, C, *S)
    aux_ptr,  # (N, C, *S) residual or output y (fused activation), or unused
    mean_ptr,  # (C,) fp64 saved mean
    invstd_ptr,  # (C,) ACC saved invstd
    w_ptr,  # (C,) or unused
    b_ptr,  # (C,) or unused
    part_ptr,  # (2, R, C) then (2, merge subtrees, C) fp64: each program's sum_dz, sum_dz_xc
    sums_ptr,  # (2, C) ACC out: [sum_dz | sum_dz_xhat]
    gw_ptr,  # (C,) out: local grad_weight, or unused
    gb_ptr,  # (C,) out: local grad_bias, or unused
    ticket_ptr,  # (channel blocks, merge subtrees + 1) int32, zero before and after
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
    # strides of dy, x and aux
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
    sm_c,  # strides of the mask
    sm_o0,
    sm_o1,
    sm_o2,
    sm_i,
    slope,
    # meta-parameters
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_GW: tl.constexpr,
    HAS_GB: tl.constexpr,
    ACTIVATION: tl.constexpr,
    AUX: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_R: tl.constexpr,
    VEC: tl.constexpr,
    PLANE: tl.constexpr,  # packed plans: lanes per channel (see _plan); 0 otherwise
    PACK: tl.constexpr,  # channels per program
    USE_INT64: tl.constexpr,
    UNROLL: tl.constexpr,  # tiles per step of the main loop: 1 or 2
    HAS_MASK: tl.constexpr,  # masked BatchNorm: padded positions add nothing (dz = 0 there)
):
    """Per-lane sums of dz and dz * (x - mean_hi); the last program merges every chunk."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols, c_mask = channel_block(pid_c, C, BLOCK_C, PACK)
    hi, lo = split_mean(tl.load(mean_ptr + cols, mask=c_mask, other=0.0), ACC)
    invstd = tl.load(invstd_ptr + cols, mask=c_mask, other=0.0).to(ACC)
    scale = invstd
    if HAS_WEIGHT:
        scale = invstd * tl.load(w_ptr + cols, mask=c_mask, other=1.0).to(ACC)
    bias = tl.zeros([BLOCK_C], dtype=ACC)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(ACC)
    lane_ch = lane_channels(BLOCK_I, PLANE)
    hi_l = per_lane(hi, lane_ch, PLANE)
    lo_l = per_lane(lo, lane_ch, PLANE)
    scale_l = per_lane(scale, lane_ch, PLANE)
    bias_l = per_lane(bias, lane_ch, PLANE)
    lanes = tl.arange(0, BLOCK_I)
    if USE_INT64:
        cols = cols.to(tl.int64)
        lanes = lanes.to(tl.int64)
    READ_AUX: tl.constexpr = ACTIVATION != 0 and AUX != 0
    OVEC: tl.constexpr = 1 if PLANE > 0 else VEC  # what tile_offsets multiplies the strides by
    rows, row_mask, inner_v = tile_rows(pid_c, cols, c_mask, C, INNER_V, PLANE, PACK, VEC)
    t_start = pid_r * tiles_per_prog
    t_end = tl.minimum(t_start + tiles_per_prog, tiles)
    o, it = tile_start(t_start, inner_tiles, USE_INT64)
    inner, mask = tile_mask(it, t_start < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
    # Masked lanes read dy = 0, so they add exactly 0 to both sums.
    dy = tl.load(
        dy_ptr + tile_offsets(o, rows, inner, O1, O2, sdy_c, sdy_o0, sdy_o1, sdy_o2, sdy_i, OVEC), mask=mask, other=0.0
    )
    x = tl.load(
        x_ptr + tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC), mask=mask, other=0.0
    )
    if READ_AUX:
        aux = tl.load(
            aux_ptr + tile_offsets(o, rows, inner, O1, O2, sa_c, sa_o0, sa_o1, sa_o2, sa_i, OVEC), mask=mask, other=0.0
        )
    else:
        aux = dy
    if HAS_MASK:
        keep = tile_keep(m_ptr, o, inner, t_start < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i, OVEC)
    if UNROLL == 2:  # two tiles a step: twice the bytes in flight, the accumulators and the merge unchanged
        o, it = tile_next(o, it, inner_tiles)
        inner, mask = tile_mask(it, t_start + 1 < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
        dy2 = tl.load(dy_ptr + tile_offsets(o, rows, inner, O1, O2, sdy_c, sdy_o0, sdy_o1, sdy_o2, sdy_i, OVEC),
                      mask=mask, other=0.0)  # fmt: skip
        x2 = tl.load(x_ptr + tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC), mask=mask,
                     other=0.0)  # fmt: skip
        aux2 = dy2
        if READ_AUX:
            aux2 = tl.load(aux_ptr + tile_offsets(o, rows, inner, O1, O2, sa_c, sa_o0, sa_o1, sa_o2, sa_i, OVEC),
                           mask=mask, other=0.0)  # fmt: skip
        if HAS_MASK:
            keep2 = tile_keep(m_ptr, o, inner, t_start + 1 < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i, OVEC)
    acc_dz = tl.zeros(mask.shape, dtype=ACC)
    acc_dzx = tl.zeros(mask.shape, dtype=ACC)
    for t in range(t_start, t_end, UNROLL):
        # Prefetch the next step's tiles (masked off past the chunk), then use the current ones.
        o, it = tile_next(o, it, inner_tiles)
        inner, mask = tile_mask(it, t + UNROLL < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
        dy_offs = tile_offsets(o, rows, inner, O1, O2, sdy_c, sdy_o0, sdy_o1, sdy_o2, sdy_i, OVEC)
        x_offs = tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC)
        dy_next = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0)
        x_next = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
        aux_next = dy_next
        if READ_AUX:
            a_offs = tile_offsets(o, rows, inner, O1, O2, sa_c, sa_o0, sa_o1, sa_o2, sa_i, OVEC)
            aux_next = tl.load(aux_ptr + a_offs, mask=mask, other=0.0)
        if HAS_MASK:
            keep_next = tile_keep(m_ptr, o, inner, t + UNROLL < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i,
                                  OVEC)  # fmt: skip
        if UNROLL == 2:
            o, it = tile_next(o, it, inner_tiles)
            inner, mask = tile_mask(it, t + 3 < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
            dy_offs = tile_offsets(o, rows, inner, O1, O2, sdy_c, sdy_o0, sdy_o1, sdy_o2, sdy_i, OVEC)
            x_offs = tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC)
            dy2_next = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0)
            x2_next = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
            aux2_next = dy2_next
            if READ_AUX:
                a_offs = tile_offsets(o, rows, inner, O1, O2, sa_c, sa_o0, sa_o1, sa_o2, sa_i, OVEC)
                aux2_next = tl.load(aux_ptr + a_offs, mask=mask, other=0.0)
            if HAS_MASK:
                keep2_next = tile_keep(m_ptr, o, inner, t + 3 < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i,
                                       OVEC)  # fmt: skip
        dz, dzx = _grad_terms(dy, x, aux, hi_l, lo_l, scale_l, bias_l, slope, ACC, ACTIVATION, AUX, READ_AUX)
        if HAS_MASK:  # a padded position adds exactly 0, whatever dy, x and aux hold there
            dz = tl.where(keep, dz, 0.0)
            dzx = tl.where(keep, dzx, 0.0)
            keep = keep_next
        acc_dz += dz
        acc_dzx += dzx
        dy, x, aux = dy_next, x_next, aux_next
        if UNROLL == 2:
            dz, dzx = _grad_terms(dy2, x2, aux2, hi_l, lo_l, scale_l, bias_l, slope, ACC, ACTIVATION, AUX, READ_AUX)
            if HAS_MASK:
                dz = tl.where(keep2, dz, 0.0)
                dzx = tl.where(keep2, dzx, 0.0)
                keep2 = keep2_next
            acc_dz += dz
            acc_dzx += dzx
            dy2, x2, aux2 = dy2_next, x2_next, aux2_next

    # This program's partials, its lanes merged in ACC.
    store_partials(part_ptr, pid_r, R, C, cols, c_mask, acc_dz, acc_dzx, pid_c, lanes, inner_v, PLANE, PACK, VEC, ACC)
    # The two-level merge in a fixed order (see merge_tree); one program ends with the sums over all R.
    last, sum_dz, sum_dzx_hi = merge_tree(part_ptr, ticket_ptr, pid_c, pid_r, R, G, C, cols, c_mask, BLOCK_R, BLOCK_C)
    if last:
        sum_dzx = (sum_dzx_hi - lo.to(tl.float64) * sum_dz) * invstd.to(tl.float64)
        tl.store(sums_ptr + cols, sum_dz.to(sums_ptr.dtype.element_ty), mask=c_mask)
        tl.store(sums_ptr + C + cols, sum_dzx.to(sums_ptr.dtype.element_ty), mask=c_mask)
        if HAS_GW:
            tl.store(gw_ptr + cols, rounded_for(sum_dzx, gw_ptr), mask=c_mask)
        if HAS_GB:
            tl.store(gb_ptr + cols, rounded_for(sum_dz, gb_ptr), mask=c_mask)


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


def launcher(options, grad_out: torch.Tensor, saved: Saved, weight_grad: bool, bias_grad: bool):
    """The backward sums (see :meth:`~tritonbn.backends.launchers.Launchers.batch_norm_backward_reduce`): ``(sums,
    grad_weight, grad_bias)``, one launch."""
    s = saved
    mask = None if s.mask is None else channel_view(s.mask, s.x)
    aux, aux_kind = aux_tensor(options.activation, s.residual, s.output, options.negative_slope)
    launch = find(options, grad_out, s, weight_grad, bias_grad, aux, aux_kind, mask)
    return run(launch, grad_out, s, weight_grad, bias_grad, aux, mask)


def find(options, grad_out, saved: Saved, weight_grad, bias_grad, aux, aux_kind, mask=None, own=False) -> Launch:
    """The launch for these arguments (``aux`` from :func:`aux_tensor`, ``mask`` as :func:`channel_view` gives it, not
    the one in ``saved``), from the cache keyed by what it depends on besides the pointers' alignment
    (``_prepared``'s launchers keep it for the calls of one layer like the last one). ``own``: ``mean``, ``invstd``
    and an ``output`` are the passes' own (allocated by the forward's elementwise launcher), whose alignment the
    launch need not read."""
    s, activation, negative_slope = saved, options.activation, options.negative_slope
    x, weight, bias = s.x, s.weight, s.bias
    key = (x.shape, x.stride(), x.dtype, x.device, grad_out.stride(), grad_out.dtype, s.mean.dtype, s.invstd.dtype, own)
    key += (None if weight is None else weight.dtype, None if bias is None else bias.dtype, weight_grad, bias_grad)
    key += (activation, negative_slope, None if aux is None else (aux_kind, aux.stride(), aux.dtype))
    if mask is not None:
        key = (*key, mask.stride())
    launch = _launches.get(key)
    if launch is None:
        flags = (weight_grad, bias_grad, activation, negative_slope, aux_kind)
        launch = cache_put(_launches, key, _launch((grad_out, x, weight, bias, aux, mask), flags, own=own))
    return launch


def new_sums(x: torch.Tensor) -> torch.Tensor:
    """The sums :func:`run` returns for ``x``: ``(2, C)`` of the compute dtype, uninitialized."""
    return torch.empty(2, x.shape[1], dtype=compute_dtype(x.dtype), device=x.device)  # sizes as ints: 0.5 us cheaper


def new_param_grad(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """A parameter's gradient :func:`run` returns: ``C`` of ``weight``'s dtype (the compute dtype without weight)."""
    return torch.empty(x.shape[1], dtype=compute_dtype(x.dtype) if weight is None else weight.dtype, device=x.device)


def run(launch: Launch, grad_out, saved: Saved, weight_grad, bias_grad, aux, mask=None, like=None):
    """:func:`launcher` with its launch found (:func:`find`): ``(sums, grad_weight, grad_bias)``. ``mask``: as
    :func:`find` takes it. ``like``: a :func:`new_sums` tensor and a :func:`new_param_grad` one kept for such calls,
    allocated again by ``torch.empty_like``."""
    x, weight, bias, invstd = saved.x, saved.weight, saved.bias, saved.invstd
    if like is None:
        sums = new_sums(x)
        grad_weight = new_param_grad(x, weight) if weight_grad else None
        grad_bias = new_param_grad(x, weight) if bias_grad else None
    else:
        sums = torch.empty_like(like[0])
        grad_weight = torch.empty_like(like[1]) if weight_grad else None
        grad_bias = torch.empty_like(like[1]) if bias_grad else None
    ws = workspace(x.device, launch.tickets, launch.scratch)
    weight, bias = dense(weight), dense(bias)
    launch(
        grad_out,
        x,
        aux if aux is not None else x,
        saved.mean,
        invstd,
        weight if weight is not None else invstd,
        bias if bias is not None else invstd,
        ws.scratch,
        sums,
        grad_weight if grad_weight is not None else sums,
        grad_bias if grad_bias is not None else sums,
        ws.tickets,
        x if mask is None else mask,
    )
    return sums, grad_weight, grad_bias


_launches = launch_cache()


def _unroll(x: torch.Tensor, layout) -> int:
    """Tiles per step of the main loop: 2 where one tile of fp16/bf16 leaves too few bytes in flight and
    a second one fits. Channels_last tiles and packed ones (which cannot widen, see ``_plan``) take
    two, except packed 7x7 planes, whose 64 channel slots of per-lane values took 130-132 registers;
    NCHW tiles stay at one: Triton 3.6 splits their loads to 64 bits at two (3.9 does not)."""
    if x.element_size() > 2:
        return 1
    if layout.PLANE:
        return 2 if layout.BLOCK_C <= 32 else 1
    return 2 if layout.channels_fastest else 1


def _launch(tensors: tuple, flags: tuple, per_sm=None, own=False) -> Launch:
    """The launch of the backward reduction on arguments like these (see the key in :func:`find`): ``tensors``
    ``(grad_out, x, weight, bias, aux, mask)``, ``flags`` ``(weight_grad, bias_grad, activation, negative_slope,
    aux_kind)``."""
    grad_out, x, weight, bias, aux, mask = tensors
    weight_grad, bias_grad, activation, negative_slope, aux_kind = flags
    layout = plan(x.shape, grad_out, x, aux if aux is not None else x, per_sm=per_sm, merges=True, mask=mask)
    R = layout.r_progs
    constexprs = dict(
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        HAS_GW=weight_grad,
        HAS_GB=bias_grad,
        ACTIVATION=ACTIVATION_CODES[activation],
        AUX=aux_kind,
        ACC=acc_dtypes(x)[0],
        BLOCK_C=layout.BLOCK_C,
        BLOCK_I=layout.BLOCK_I,
        BLOCK_R=layout.BLOCK_R,
        VEC=layout.VEC,
        PLANE=layout.PLANE,
        PACK=layout.PACK,
        USE_INT64=layout.use_int64,
        UNROLL=_unroll(x, layout),
        HAS_MASK=mask is not None,
    )
    tail = (*layout.size_args, R, layout.G, *layout.stride_args, float(negative_slope))
    refit = None if per_sm else refit_with(_launch, tensors, flags, device=x.device)
    return Launch(
        _batch_norm_backward_reduce_kernel,
        layout.grid,
        tail,
        constexprs,
        layout.num_warps,
        pointers=13,
        tickets=layout.merge_tickets,
        scratch=layout.merge_scratch,
        refit=refit,
        checked=_checked(weight, bias, aux, mask, own and aux_kind == AUX_OUTPUT, not own),
    )


def _checked(weight, bias, aux, mask, own_aux=False, given_stats=True) -> tuple[int, ...]:
    """The pointers whose alignment a launch reads (see :class:`Launch`): the call's own tensors (``mean`` and
    ``invstd`` where ``given_stats``, ``aux`` unless ``own_aux``), not the sums, gradients and workspace it
    allocates, nor the stand-ins for absent tensors (``x``, ``invstd``, the sums)."""
    given = {2: None if own_aux else aux, 3: given_stats or None, 4: given_stats or None, 5: weight, 6: bias, 12: mask}
    return (0, 1, *(i for i, t in given.items() if t is not None))
