"""Triton helpers shared by the kernels: the tile walk, per-channel statistics, tickets, epilogues.

The tile walk. A program owns the contiguous chunk of tiles ``[t_start, t_end)`` (see
:mod:`tritonbn.backends.triton._plan`). It keeps the tile's outer index ``o`` and inner tile ``it`` and
steps them by one each iteration, without a division. Every loop issues the loads of the *next*
tile before it computes on the current one (software prefetch into registers), so each iteration's
loads are in flight together and overlap the previous tile's arithmetic.

The ticket. A kernel whose programs each write a partial result finishes in the same launch: each
program stores its partials, then takes a ticket with one atomic increment; the program that draws
the last ticket merges all the partials, in a fixed order (so the result is bitwise deterministic
whatever order the programs finish in), and puts the counter back to zero for the next launch (so
no memset is needed, and a CUDA graph can replay it). With many programs the merge is two-level
(:func:`merge_tree`), so the work left after the last main loop stays short.
"""

import torch
import triton
import triton.language as tl

from tritonbn._numerics import compute_dtype
from tritonbn.activations import ACTIVATIONS

INT32_MAX = 2**31 - 1


def acc_dtypes(x: torch.Tensor):
    """The kernels' arithmetic type for ``x`` as ``(triton dtype, torch dtype)``: float64 for float64
    inputs, else float32. Saved invstd, partials and backward sums are kept in it."""
    acc = compute_dtype(x.dtype)
    return (tl.float64 if acc is torch.float64 else tl.float32), acc


def channel_view(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Masked BatchNorm's bool ``(N, *S)`` mask as the kernels read it: bytes, ``(N, C, *S)`` with channel stride 0.

    The statistics kernel counts real positions in int32: a rank's ``N * S`` must stay below 2**31.
    """
    if x.numel() // max(1, x.shape[1]) > INT32_MAX:
        raise ValueError(
            f"tritonbn: a mask covers at most 2**31 - 1 positions (N * S) per rank, got input shape {tuple(x.shape)}"
        )
    return mask.view(torch.uint8).unsqueeze(1).expand(x.shape)


@triton.jit
def tile_start(t_start, inner_tiles, USE_INT64: tl.constexpr):
    """``(o, it)``: the outer index and the inner tile of tile number ``t_start``."""
    if USE_INT64:
        t_start = tl.cast(t_start, tl.int64)
    o = t_start // inner_tiles
    return o, t_start - o * inner_tiles


@triton.jit
def tile_next(o, it, inner_tiles):
    """The tile after ``(o, it)``."""
    it += 1
    wrap = it == inner_tiles
    return tl.where(wrap, o + 1, o), tl.where(wrap, 0, it)


@triton.jit
def tile_mask(it, valid, c_mask, lanes, INNER_V, BLOCK_I: tl.constexpr, VEC: tl.constexpr):
    """``(inner, mask)`` of the ``[BLOCK_C, BLOCK_I]`` tile at inner tile ``it``; ``valid``: the tile exists.

    The inner size is ``INNER_V * VEC``, so the mask is constant over runs of ``VEC`` lanes.
    """
    inner = it * BLOCK_I + lanes
    return inner, c_mask[:, None] & (inner < tl.where(valid, INNER_V, 0) * VEC)[None, :]


@triton.jit
def tile_offsets(o, cols, inner, O1, O2, s_c, s_o0, s_o1, s_o2, s_i, VEC: tl.constexpr):
    """Element offsets of a tile at outer index ``o`` in a tensor with the given strides.

    The channel and outer strides arrive divided by ``VEC`` (see ``_tiles.vector_hint``).
    """
    o2 = o % O2
    o1 = (o // O2) % O1
    o0 = o // (O2 * O1)
    base = (o0 * s_o0 + o1 * s_o1 + o2 * s_o2) * VEC
    return base + (cols * (s_c * VEC))[:, None] + (inner * s_i)[None, :]


@triton.jit
def tile_keep(m_ptr, o, inner, valid, inner_v, O1, O2, s_o0, s_o1, s_o2, s_i, VEC: tl.constexpr):
    """Masked BatchNorm: the mask over the lanes of the tile at ``(o, inner)``, ``[1, BLOCK_I]``, True at
    real positions (False past the tile, or when not ``valid``).

    The mask has no channel stride, so every row of the tile shares one row of it: one byte per lane
    is read, the tile's rows broadcast it: :func:`tile_offsets` of a single row.
    """
    offs = tile_offsets(o, tl.zeros([1], dtype=inner.dtype), inner, O1, O2, 0, s_o0, s_o1, s_o2, s_i, VEC)
    keep = tl.load(m_ptr + offs, mask=(inner < tl.where(valid, inner_v, 0) * VEC)[None, :], other=0)
    return keep != 0


@triton.jit
def channel_block(pid_c, C, BLOCK_C: tl.constexpr, PACK: tl.constexpr):
    """``(cols, c_mask)``: the ``BLOCK_C`` channel slots of program ``pid_c``, of which the first ``PACK``
    are its channels (all of them unless the plan is packed, see :mod:`tritonbn.backends.triton._plan`)."""
    k = tl.arange(0, BLOCK_C)
    cols = pid_c * PACK + k
    if PACK == BLOCK_C:
        return cols, cols < C
    else:
        return cols, (k < PACK) & (cols < C)


@triton.jit
def tile_rows(pid_c, cols, c_mask, C, INNER_V, PLANE: tl.constexpr, PACK: tl.constexpr, VEC: tl.constexpr):
    """``(rows, row_mask, inner_v)``: the rows of this program's tiles, their mask, and its inner size / VEC.

    The rows are the channels; in a packed plan (``PLANE > 0``) one row, the group, at element offset
    ``pid_c * PACK * PLANE`` (the plan gives it a channel stride of 1, and :func:`tile_offsets` then
    takes ``VEC=1``), whose run is ``PACK * PLANE`` elements, fewer for a last pack that ``C`` cuts
    short.
    """
    if PLANE > 0:
        rows = tl.zeros([1], dtype=cols.dtype) + pid_c * (PACK * PLANE)
        return rows, rows >= 0, tl.minimum(INNER_V, (C - pid_c * PACK) * PLANE // VEC)
    else:
        return cols, c_mask, INNER_V


@triton.jit
def lane_channels(BLOCK_I: tl.constexpr, PLANE: tl.constexpr):
    """The channel slot of each lane of a packed tile (the lanes themselves when not packed)."""
    lanes = tl.arange(0, BLOCK_I)
    if PLANE > 0:
        return lanes // PLANE
    else:
        return lanes


@triton.jit
def per_lane(v, lane_ch, PLANE: tl.constexpr):
    """A per-channel ``[BLOCK_C]`` value in the tile's shape: ``v[:, None]``, or in a packed plan each
    lane's channel's value, ``v[lane_ch][None, :]`` (a register gather, once per program)."""
    if PLANE > 0:
        return tl.gather(v, lane_ch, 0)[None, :]
    else:
        return v[:, None]


@triton.jit
def _segmented_add(start_a, a, start_b, b):
    """Combine of a segmented sum: a segment that starts in ``b`` drops what came before it."""
    return start_a | start_b, tl.where(start_b != 0, b, a + b)


@triton.jit
def segment_sums(v, starts):
    """Sums of ``v`` (1-D) over its segments, at each segment's last element.

    ``starts`` (int32, nonzero) marks each segment's first element."""
    _, s = tl.associative_scan((starts, v), 0, _segmented_add)
    return s


@triton.jit
def store_partials(part_ptr, pid_r, R, C, cols, c_mask, a0, a1, pid_c, lanes, inner_v,
                   PLANE: tl.constexpr, PACK: tl.constexpr, VEC: tl.constexpr, MERGE: tl.constexpr,
                   GATHER: tl.constexpr = False):  # fmt: skip
    """Store this program's two per-lane accumulators, their lanes merged in ``MERGE``, as row ``pid_r``
    of ``(2, R, C)`` fp64 partials.

    A packed tile's lanes are reduced to channels by a segmented scan that restarts at each channel's
    first lane: the value at a channel's last lane is its sum, untouched by its neighbours however
    different their sizes. That value is stored from the lane itself (a masked store over every lane),
    or, with ``GATHER``, gathered into the ``[BLOCK_C]`` channel slots and stored as the unpacked plans
    store theirs: no per-lane addresses and masks held across the scan (see ``_plan._gathers``).
    """
    part = part_ptr + pid_r * C
    if PLANE > 0 and GATHER:
        starts = (lanes % PLANE == 0).to(tl.int32)
        last = tl.minimum(tl.arange(0, cols.shape[0]) * PLANE + (PLANE - 1), a0.shape[1] - 1)  # idle slots: masked
        s0 = segment_sums(tl.reshape(a0, [a0.shape[1]]).to(MERGE), starts)
        tl.store(part + cols, tl.gather(s0, last, 0), mask=c_mask)
        s1 = segment_sums(tl.reshape(a1, [a1.shape[1]]).to(MERGE), starts)
        tl.store(part + R * C + cols, tl.gather(s1, last, 0), mask=c_mask)
    elif PLANE > 0:
        starts = (lanes % PLANE == 0).to(tl.int32)
        ends = (lanes % PLANE == PLANE - 1) & (lanes < inner_v * VEC)
        ch = pid_c * PACK + lanes // PLANE
        tl.store(part + ch, segment_sums(tl.reshape(a0, [a0.shape[1]]).to(MERGE), starts), mask=ends)
        tl.store(part + R * C + ch, segment_sums(tl.reshape(a1, [a1.shape[1]]).to(MERGE), starts), mask=ends)
    else:
        tl.store(part + cols, tl.sum(a0.to(MERGE), axis=1), mask=c_mask)
        tl.store(part + R * C + cols, tl.sum(a1.to(MERGE), axis=1), mask=c_mask)


@triton.jit
def take_ticket(ticket_ptr):
    """Draw this program's ticket: the number of programs sharing the counter that drew one before it.

    The barrier puts every thread's earlier stores (and loads) before the atomic, whose acq_rel
    order publishes them to the program that draws the last ticket.
    """
    tl.debug_barrier()
    return tl.atomic_add(ticket_ptr, 1)


@triton.jit
def merge_rows(part_ptr, R, start, count, C, cols, c_mask, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows ``[start, start + count)`` of ``(2, R, C)`` partials summed in a fixed order, in fp64: ``(sum0, sum1)``.

    The partials of other programs are read from L2 (``.cg``: never a stale L1 line; the ticket's
    acq_rel atomic ordered their stores before). Each step issues the next ``[BLOCK_R, BLOCK_C]``
    tile's loads before adding the current one.
    """
    rows = tl.arange(0, BLOCK_R)
    end = start + count
    r = start + rows
    pmask = (r < end)[:, None] & c_mask[None, :]
    poffs = r[:, None] * C + cols[None, :]
    a0 = tl.load(part_ptr + poffs, mask=pmask, other=0.0, cache_modifier=".cg").to(tl.float64)
    a1 = tl.load(part_ptr + R * C + poffs, mask=pmask, other=0.0, cache_modifier=".cg").to(tl.float64)
    m0 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    m1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    for r0 in range(start + BLOCK_R, end + BLOCK_R, BLOCK_R):
        r_next = r0 + rows  # not `r`: a loop-carried name must keep its type, and r0 may be wider
        nmask = (r_next < end)[:, None] & c_mask[None, :]
        noffs = r_next[:, None] * C + cols[None, :]
        n0 = tl.load(part_ptr + noffs, mask=nmask, other=0.0, cache_modifier=".cg").to(tl.float64)
        n1 = tl.load(part_ptr + R * C + noffs, mask=nmask, other=0.0, cache_modifier=".cg").to(tl.float64)
        m0 += a0
        m1 += a1
        a0 = n0
        a1 = n1
    return tl.sum(m0, axis=0), tl.sum(m1, axis=0)


@triton.jit
def merge_tree(part_ptr, ticket_ptr, pid_c, pid_r, R, G, C, cols, c_mask,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """After every program stored row ``pid_r`` of the ``(2, R, C)`` partials: the two-level merge.

    Returns ``(last, sum0, sum1)``: ``last`` is true in the one program of channel block ``pid_c``
    that holds the sums over all ``R`` rows. Programs form groups of ``G`` consecutive rows. Each
    takes a ticket on its group's counter; the last of a group merges the group's rows (in row
    order) into row ``g`` of the ``(2, NG, C)`` level-2 partials that follow the ``R`` rows, then
    takes a ticket on the block's top counter; the last group merges the ``NG`` level-2 rows (in
    group order). So the merge order is fixed whatever order programs finish in, and the serial
    tail after the last main loop reads about ``G + NG ~ 2 sqrt(R)`` rows instead of ``R``. Each
    counter is put back to zero by the program that consumed it. The counters of block ``pid_c``
    are ``ticket_ptr[pid_c * (NG + 1) + (0, 1 .. NG)]`` (top, groups).
    """
    NG = (R + G - 1) // G
    g = pid_r // G
    gsize = tl.minimum(G, R - g * G)
    tk = ticket_ptr + pid_c * (NG + 1)
    last = pid_r < 0
    s0 = tl.zeros([BLOCK_C], dtype=tl.float64)
    s1 = tl.zeros([BLOCK_C], dtype=tl.float64)
    if take_ticket(tk + 1 + g) == gsize - 1:
        s0, s1 = merge_rows(part_ptr, R, g * G, gsize, C, cols, c_mask, BLOCK_R, BLOCK_C)
        tl.store(tk + 1 + g, 0)  # ready for the next launch
        if NG > 1:
            level2 = part_ptr + 2 * R * C
            tl.store(level2 + g * C + cols, s0, mask=c_mask)
            tl.store(level2 + NG * C + g * C + cols, s1, mask=c_mask)
            if take_ticket(tk) == NG - 1:
                s0, s1 = merge_rows(level2, NG, 0, NG, C, cols, c_mask, BLOCK_R, BLOCK_C)
                tl.store(tk, 0)
                last = pid_r >= 0
        else:
            last = pid_r >= 0
    return last, s0, s1


@triton.jit
def rounded_for(v, ptr):
    """``v`` (fp32 or fp64) rounded to ``ptr``'s element type, for a store.

    fp64 reaches bf16 through fp32: Triton's interpreter (3.6 to 3.9) converts fp64 straight to bf16
    wrongly (tiny or NaN values), which would corrupt a bf16 module's running statistics and weight
    and bias gradients on CPU. Compiled, the two roundings agree but in the rarest ties, and torch
    itself computes a bf16 module's updates in fp32.
    """
    if ptr.dtype.element_ty == tl.bfloat16:
        return v.to(tl.float32).to(tl.bfloat16)
    return v.to(ptr.dtype.element_ty)


@triton.jit
def channel_stats(stats_ptr, rmean_ptr, rvar_ptr, cols, c_mask, C, TRAINING: tl.constexpr):
    """Per-channel ``(mean, biased var)`` in fp64, and the count (a scalar).

    Training reads the packed global sums ``stats = [sum_x (C) | sum_x2 (C) | count]``; eval reads
    the running statistics (count is then 0, unused). A NaN or Inf in a channel's sums reaches its
    mean and variance, as in torch: the clamp of the variance at 0 propagates NaN.
    """
    if TRAINING:
        s1 = tl.load(stats_ptr + cols, mask=c_mask, other=0.0)
        s2 = tl.load(stats_ptr + C + cols, mask=c_mask, other=0.0)
        n = tl.load(stats_ptr + 2 * C)
        inv_n = 1.0 / tl.maximum(n, 1.0)
        mean = s1 * inv_n
        var = tl.maximum(s2 * inv_n - mean * mean, 0.0, propagate_nan=tl.PropagateNan.ALL)
    else:
        mean = tl.load(rmean_ptr + cols, mask=c_mask, other=0.0).to(tl.float64)
        var = tl.load(rvar_ptr + cols, mask=c_mask, other=1.0).to(tl.float64)
        n = 0.0
    return mean, var, n


@triton.jit
def split_mean(mean64, ACC: tl.constexpr):
    """Split an fp64 mean into ``hi + lo`` in ``ACC``: ``(x - hi) - lo`` keeps fp32 precision far from zero.

    With ``ACC`` float64 (float64 inputs) ``hi`` is the mean and ``lo`` is 0.
    """
    hi = mean64.to(ACC)
    lo = (mean64 - hi.to(tl.float64)).to(ACC)
    return hi, lo


# Fused activations: the codes the kernels take as ACTIVATION (0: none, 1: relu, 2: leaky_relu, 3: silu).
ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}


@triton.jit
def activate(z, slope, ACTIVATION: tl.constexpr):
    """act(z) for ACTIVATION 0 (none), 1 (relu), 2 (leaky_relu with ``slope``), 3 (silu)."""
    if ACTIVATION == 1:
        z = tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as in torch
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
    """The gradient at z = xhat * w + b (+ residual), from dy at y = act(z); ``xc = x - mean``.

    ``scale`` and ``bias`` come in the tile's shape (see :func:`per_lane`)."""
    if ACTIVATION != 0:
        if AUX == 2:
            z = aux
        else:
            z = xc * scale + bias
            if AUX == 1:
                z += aux
        dy = activation_grad(dy, z, slope, ACTIVATION)
    return dy


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """A ``(C,)`` parameter or buffer as the kernels read it, one element after the other: ``t`` itself, or a
    contiguous copy of a strided one (a ``.data`` set to a slice by hand), or ``None``."""
    return t if t is None or t.is_contiguous() else t.contiguous()
