"""Forward elementwise pass: ``batch_norm_elemt``, one launch.

One kernel normalizes ``x``. In training it derives each channel's mean and var from the packed
global sums (see :mod:`tritonbn.backends.triton.stats`); in eval it reads the running statistics. With

    scale = weight * invstd,   invstd = 1 / sqrt(var + eps),   shift = bias - mean_lo * scale

it writes ``y = act((x - mean_hi) * scale + shift + residual)``, where ``mean_hi + mean_lo`` is the
fp64 mean split into two fp32 numbers, so that ``y`` keeps fp32 precision when ``|mean| >> std``
(float64 inputs compute in float64 throughout). The residual add and the activation (none, relu,
leaky_relu, silu) are optional and fused: no extra pass over the tensor.

The programs of the first reduction chunk write the saved ``mean`` (fp64) and ``invstd`` (fp32, or
fp64 for float64 inputs) of their channels for backward, and, in training with running statistics,
update ``running_mean`` and ``running_var`` (unbiased, from the global count) of those channels on
the device. ``num_batches_tracked`` is read by each of them and incremented by the last to draw a
ticket, so ``momentum=None`` (the cumulative factor ``1 / (num_batches_tracked + 1)``) needs neither
the host nor a serial loop. When the global count is 0 (every rank empty), the running statistics
and ``num_batches_tracked`` stay as they are.
"""

import functools
import struct

import torch
import triton
import triton.language as tl

from tritonbn._numerics import compute_dtype
from tritonbn.backends.launchers import Operands, check_elemt
from tritonbn.backends.triton._common import (
    ACTIVATION_CODES,
    acc_dtypes,
    activate,
    channel_block,
    channel_stats,
    channel_view,
    dense,
    lane_channels,
    per_lane,
    rounded_for,
    split_mean,
    take_ticket,
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


# One compiled kernel whether a program gets one tile or many (Triton would specialize a 1).
@triton.jit(do_not_specialize=["tiles_per_prog"])
def _batch_norm_elemt_kernel(
    # pointers
    x_ptr,  # (N, C, *S)
    y_ptr,  # (N, C, *S) out, dtype of x
    r_ptr,  # (N, C, *S) residual, or unused
    w_ptr,  # (C,) or unused
    b_ptr,  # (C,) or unused
    stats_ptr,  # (2C + 1,) fp64 [sum_x | sum_x2 | count] (training)
    rmean_ptr,  # (C,) running mean (eval: read; training: updated in place)
    rvar_ptr,  # (C,) running var
    nbt_ptr,  # () int64 num_batches_tracked
    ticket_ptr,  # (1,) int32 at zero: orders the num_batches_tracked update
    mean_ptr,  # (C,) fp64 out: saved mean, or unused
    invstd_ptr,  # (C,) ACC out: saved invstd, or unused
    m_ptr,  # masked BatchNorm: (N, *S) uint8 viewed as (N, C, *S), nonzero at real positions; else unused
    # sizes
    C,
    O1,
    O2,
    INNER_V,
    inner_tiles,
    tiles,
    tiles_per_prog,
    # strides of x, y and the residual
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
    sm_c,  # strides of the mask
    sm_o0,
    sm_o1,
    sm_o2,
    sm_i,
    # scalars: momentum and eps each as two fp32 numbers whose sum is the Python float (fp64)
    momentum,
    momentum_lo,
    eps,
    eps_lo,
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
    SAVE_STATS: tl.constexpr,  # write mean and invstd (for backward)
    ACC: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_I: tl.constexpr,
    VEC: tl.constexpr,
    PLANE: tl.constexpr,  # packed plans: lanes per channel (see _plan); 0 otherwise
    PACK: tl.constexpr,  # channels per program
    USE_INT64: tl.constexpr,
    HAS_MASK: tl.constexpr,  # masked BatchNorm: y = 0 at padded positions
):
    """y = act((x - mean) * invstd * weight + bias + residual), plus saved stats and the running-stat update."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    cols, c_mask = channel_block(pid_c, C, BLOCK_C, PACK)
    mean64, var64, n_all = channel_stats(stats_ptr, rmean_ptr, rvar_ptr, cols, c_mask, C, TRAINING)
    invstd64 = 1.0 / tl.sqrt(var64 + (tl.cast(eps, tl.float64) + tl.cast(eps_lo, tl.float64)))
    invstd = invstd64.to(ACC)
    if pid_r == 0:
        if SAVE_STATS:
            tl.store(mean_ptr + cols, mean64, mask=c_mask)
            tl.store(invstd_ptr + cols, invstd, mask=c_mask)
        if UPDATE_RUNNING:
            # The programs of the first chunk update their own channels. The cumulative factor
            # 1 / (num_batches_tracked + 1) needs the count from before this step: every such program
            # reads it, then takes a ticket, and the last one increments it. A step in which every
            # rank is empty leaves the running statistics alone.
            if HAS_NBT:
                nbt = tl.load(nbt_ptr)
            if CUMULATIVE:
                factor = 1.0 / (nbt + 1).to(tl.float64)
            else:
                factor = tl.cast(momentum, tl.float64) + tl.cast(momentum_lo, tl.float64)
            um = c_mask & (cols < tl.where(n_all > 0, C, 0))
            unbiased = var64 * n_all / tl.maximum(n_all - 1.0, 1.0)
            rm = tl.load(rmean_ptr + cols, mask=um, other=0.0).to(tl.float64)
            rv = tl.load(rvar_ptr + cols, mask=um, other=0.0).to(tl.float64)
            rm = rm * (1.0 - factor) + mean64 * factor
            rv = rv * (1.0 - factor) + unbiased * factor
            tl.store(rmean_ptr + cols, rounded_for(rm, rmean_ptr), mask=um)
            tl.store(rvar_ptr + cols, rounded_for(rv, rvar_ptr), mask=um)
            if HAS_NBT:
                if take_ticket(ticket_ptr) == tl.num_programs(0) - 1:
                    tl.store(nbt_ptr, nbt + tl.where(n_all > 0, 1, 0).to(tl.int64))
                    tl.store(ticket_ptr, 0)

    # y = (x - hi) * scale + shift, shift = bias - lo * scale: fp32 precision when |mean| >> std.
    hi, lo = split_mean(mean64, ACC)
    if HAS_WEIGHT:
        scale = invstd * tl.load(w_ptr + cols, mask=c_mask, other=1.0).to(ACC)
    else:
        scale = invstd
    shift = -lo * scale
    if HAS_BIAS:
        shift += tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(ACC)
    lane_ch = lane_channels(BLOCK_I, PLANE)
    hi = per_lane(hi, lane_ch, PLANE)
    scale = per_lane(scale, lane_ch, PLANE)
    shift = per_lane(shift, lane_ch, PLANE)

    lanes = tl.arange(0, BLOCK_I)
    if USE_INT64:
        cols = cols.to(tl.int64)
        lanes = lanes.to(tl.int64)
    OVEC: tl.constexpr = 1 if PLANE > 0 else VEC  # what tile_offsets multiplies the strides by
    rows, row_mask, inner_v = tile_rows(pid_c, cols, c_mask, C, INNER_V, PLANE, PACK, VEC)
    t_start = pid_r * tiles_per_prog
    t_end = tl.minimum(t_start + tiles_per_prog, tiles)
    o, it = tile_start(t_start, inner_tiles, USE_INT64)
    inner, mask = tile_mask(it, t_start < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
    x = tl.load(x_ptr + tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC), mask=mask)
    if HAS_RESIDUAL:
        res = tl.load(r_ptr + tile_offsets(o, rows, inner, O1, O2, sr_c, sr_o0, sr_o1, sr_o2, sr_i, OVEC), mask=mask)
    if HAS_MASK:
        keep = tile_keep(m_ptr, o, inner, t_start < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i, OVEC)
    for t in range(t_start, t_end):
        o_cur, inner_cur, y_mask = o, inner, mask
        # Prefetch the next tile (masked off past the chunk), then compute and store the current one.
        o, it = tile_next(o, it, inner_tiles)
        inner, mask = tile_mask(it, t + 1 < t_end, row_mask, lanes, inner_v, BLOCK_I, VEC)
        x_next = tl.load(x_ptr + tile_offsets(o, rows, inner, O1, O2, sx_c, sx_o0, sx_o1, sx_o2, sx_i, OVEC), mask=mask)
        if HAS_RESIDUAL:
            r_offs = tile_offsets(o, rows, inner, O1, O2, sr_c, sr_o0, sr_o1, sr_o2, sr_i, OVEC)
            res_next = tl.load(r_ptr + r_offs, mask=mask)
        if HAS_MASK:
            keep_next = tile_keep(m_ptr, o, inner, t + 1 < t_end, inner_v, O1, O2, sm_o0, sm_o1, sm_o2, sm_i, OVEC)
        y = (x.to(ACC) - hi) * scale + shift
        if HAS_RESIDUAL:
            y += res.to(ACC)
            res = res_next
        y = activate(y, slope, ACTIVATION)
        if HAS_MASK:
            y = tl.where(keep, y, 0.0)
            keep = keep_next
        y_offs = tile_offsets(o_cur, rows, inner_cur, O1, O2, sy_c, sy_o0, sy_o1, sy_o2, sy_i, OVEC)
        tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=y_mask)
        x = x_next


@functools.lru_cache(maxsize=256)
def split_float(v: float) -> tuple[float, float]:
    """``(hi, lo)``: two float32 numbers whose sum is ``v`` to float64 precision (Triton passes floats as fp32)."""
    hi = struct.unpack("f", struct.pack("f", float(v)))[0]
    return hi, float(v) - hi


def empty_like_layout(x: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor shaped like ``x`` in ``x``'s memory format (dim order kept, gaps dropped)."""
    return torch.empty_like(x, memory_format=torch.preserve_format)


def launcher(options, operands: Operands, stats, save_stats: bool):
    """Normalize (see :meth:`~tritonbn.backends.launchers.Launchers.batch_norm_elemt`): ``(y, mean, invstd)``, one
    launch."""
    mask = operands.mask
    if mask is not None:
        mask = channel_view(mask, operands.input)
    launch = find(options, operands, stats, save_stats, mask)
    return run(launch, operands, stats, save_stats, mask)


def find(options, operands: Operands, stats, save_stats: bool, mask=None, own=False) -> Launch:
    """The launch for these arguments (``mask`` as :func:`channel_view` gives it, not the one in ``operands``), from
    the cache keyed by what it depends on besides the pointers' alignment (``_prepared``'s launchers keep it for the
    calls of one layer like the last one). Raises where the arguments contradict each other. ``own``: ``stats`` is
    the passes' own (allocated by the statistics launcher, or a copy), whose alignment the launch need not read."""
    t, momentum = operands, options.momentum
    x, weight, bias, residual = t.input, t.weight, t.bias, t.residual
    check_elemt(t, stats, momentum)
    eps, activation, negative_slope = options.eps, options.activation, options.negative_slope
    # What the launch depends on besides the pointers' alignment: every pointer's dtype among the rest.
    key = (x.shape, x.stride(), x.dtype, x.device, save_stats, momentum, eps, activation, negative_slope, own)
    key += (None if stats is None else stats.dtype, None if weight is None else weight.dtype)
    key += (None if bias is None else bias.dtype, None if residual is None else (residual.stride(), residual.dtype))
    key += (
        None if t.running_mean is None else (t.running_mean.dtype, t.running_var.dtype),
        None if t.num_batches_tracked is None else t.num_batches_tracked.dtype,
    )
    if mask is not None:
        key = (*key, mask.stride())
    launch = _launches.get(key)
    if launch is None:
        tensors = (x, weight, bias, stats, t.running_mean, t.num_batches_tracked, residual, mask)
        launch = cache_put(
            _launches, key, _launch(tensors, (momentum, eps, activation, negative_slope, save_stats), own=own)
        )
    return launch


def new_saved(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, invstd)`` :func:`run` saves for ``x``: ``C`` float64 and ``C`` of the compute dtype, uninitialized."""
    C, device = x.shape[1], x.device
    mean = torch.empty(C, dtype=torch.float64, device=device)
    return mean, torch.empty(C, dtype=compute_dtype(x.dtype), device=device)


def run(launch: Launch, operands: Operands, stats, save_stats: bool, mask=None, like=None):
    """:func:`launcher` with its launch found (:func:`find`): ``(y, mean, invstd)``. ``mask``: as :func:`find` takes
    it. ``like``: a :func:`new_saved` pair kept for such calls, allocated again by ``torch.empty_like``."""
    t = operands
    x, residual, num_batches_tracked = t.input, t.residual, t.num_batches_tracked
    weight, bias, rm, rv = dense(t.weight), dense(t.bias), dense(t.running_mean), dense(t.running_var)
    y = torch.empty_like(x)  # preserve_format, the default (0.2 us cheaper than passing it)
    if save_stats:
        mean, invstd = new_saved(x) if like is None else (torch.empty_like(like[0]), torch.empty_like(like[1]))
        dummy = mean
    else:
        mean = invstd = None
        dummy = y
    launch(
        x,
        y,
        residual if residual is not None else x,
        weight if weight is not None else dummy,
        bias if bias is not None else dummy,
        stats if stats is not None else dummy,
        rm if rm is not None else dummy,
        rv if rv is not None else dummy,
        num_batches_tracked if num_batches_tracked is not None else dummy,
        workspace(x.device, 1).tickets if launch.tickets else dummy,
        dummy if mean is None else mean,
        dummy if invstd is None else invstd,
        x if mask is None else mask,
    )
    if rm is not t.running_mean:  # the update of a strided buffer, made in a dense copy
        t.running_mean.copy_(rm)
    if rv is not t.running_var:
        t.running_var.copy_(rv)
    return y, mean, invstd


_launches = launch_cache()


def _launch(tensors: tuple, flags: tuple, per_sm=None, own=False) -> Launch:
    """The launch of the elementwise kernel on arguments like these (see the key in :func:`find`): ``tensors``
    ``(x, weight, bias, stats, running_mean, num_batches_tracked, residual, mask)``, ``flags`` ``(momentum, eps,
    activation, negative_slope, save_stats)``."""
    x, weight, bias, stats, running_mean, num_batches_tracked, residual, mask = tensors
    momentum, eps, activation, negative_slope, save_stats = flags
    y = empty_like_layout(x)
    # 16-bit inputs take twice the tile, but for masked layers (whose tiles may not vectorize: more registers).
    scale = 2 if x.element_size() <= 2 and mask is None else 1
    layout = plan(x.shape, x, y, residual if residual is not None else x, tile_scale=scale, per_sm=per_sm, mask=mask)
    training = stats is not None
    update = training and running_mean is not None
    has_nbt = update and num_batches_tracked is not None
    constexprs = dict(
        TRAINING=training,
        UPDATE_RUNNING=update,
        CUMULATIVE=update and momentum is None,
        HAS_NBT=has_nbt,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        ACTIVATION=ACTIVATION_CODES[activation],
        SAVE_STATS=save_stats,
        ACC=acc_dtypes(x)[0],
        BLOCK_C=layout.BLOCK_C,
        BLOCK_I=layout.BLOCK_I,
        VEC=layout.VEC,
        PLANE=layout.PLANE,
        PACK=layout.PACK,
        USE_INT64=layout.use_int64,
        HAS_MASK=mask is not None,
    )
    tail = (
        *layout.size_args,
        *layout.stride_args,
        *split_float(0.0 if momentum is None else momentum),
        *split_float(eps),
        float(negative_slope),
    )
    refit = None if per_sm else refit_with(_launch, tensors, flags, device=x.device)
    checked = _checked(training and not own, weight, bias, num_batches_tracked, residual, mask)
    return Launch(
        _batch_norm_elemt_kernel,
        layout.grid,
        tail,
        constexprs,
        layout.num_warps,
        pointers=13,
        tickets=int(has_nbt),
        refit=refit,
        checked=checked,
    )


def _checked(given_stats, weight, bias, num_batches_tracked, residual, mask) -> tuple[int, ...]:
    """The pointers whose alignment a launch reads (see :class:`Launch`): the call's own tensors (``stats`` where
    ``given_stats``), not ``y``, the statistics it allocates, the workspace's tickets, nor the stand-ins for absent
    tensors (``x``, or one it allocated). The running statistics are always read: either may stand in for the
    other's absence."""
    given = {2: residual, 3: weight, 4: bias, 8: num_batches_tracked, 12: mask}
    return tuple(sorted({0, 6, 7, *(i for i, t in given.items() if t is not None), *((5,) if given_stats else ())}))
