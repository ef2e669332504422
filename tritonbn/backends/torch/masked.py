"""Masked BatchNorm on the PyTorch backend: what its four launchers run for a mask, around :mod:`.plain`.

``mask`` is a bool ``(N, *S)`` tensor, True at real positions. What the kernels do in their loops
(:mod:`tritonbn.kernels`, ``HAS_MASK``) is done here around the unmasked launchers, every step on the
device (the count is a tensor, never read on the host):

* statistics: the kernels' shifted sums over the real positions: ``d = x - p`` with the padded positions
  made 0 (whatever they held, NaN included), the sums of ``d`` and ``d^2`` in one native pass, and the count
  of real positions; ``d`` goes on to the unmasked output launcher, which writes ``y`` over it (16-bit
  inputs: the unmasked launcher's sums of ``x`` itself, made 0 at padded positions);
* forward output, and both input gradients: the unmasked launcher's result with 0 written at padded
  positions (each output position depends only on its own input position and per-channel values);
* backward sums: the unmasked reduction over ``dy`` made 0 at padded positions, and ``x`` (and the
  residual or output) made finite there, so that padded positions add exactly 0. The reduction hands
  those copies to the elementwise launcher (:func:`_take_zeroed`), which then reuses the reduction's
  ``dz`` too.

Every zeroing is one bitwise ``and`` of the float's bits with a per-position mask of all ones or all zeros
(:func:`_zero_padded`): exact, NaN-safe, and several times faster than ``masked_fill`` with a broadcast bool
mask on CPU.
"""

from __future__ import annotations

import threading

import torch

import tritonbn.backends.torch.plain as _base
from tritonbn._numerics import compute_dtype
from tritonbn.backends.launchers import Operands, Saved
from tritonbn.backends.torch.steps import _channel_sums, _constants_for, _first, _subtract

_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # the integer type of each float width, for the bits
_zeroed = threading.local()  # the backward reduction's zeroed copies, for the elementwise launcher


def _zero_padded(t: torch.Tensor, mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` with 0 at the padded positions, in place (``out`` ``None``) or into ``out`` (laid out like ``t``):
    ``t``'s bits and-ed with those of ``(N, 1, *S)`` integers, -1 (all bits) at real positions and 0 at padded
    ones. A float whose bits are all 0 is +0.0, whatever ``t`` held there."""
    itype = _INTS[t.element_size()]
    keep = mask.unsqueeze(1).to(itype).neg_()
    target = t if out is None else out
    torch.bitwise_and(t.view(itype), keep, out=target.view(itype))
    return target


def _zeroed_copy(t: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else _zero_padded(t, mask, torch.empty_like(t))


def _version(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.is_inference() else t._version


def batch_norm_stats(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """See :func:`tritonbn.kernels.batch_norm_stats`: ``[sum x | sum x^2 | count]`` over the real positions.

    As the kernel: ``d = x - p`` in the arithmetic type, ``p`` each channel's value at the first position
    of the batch (0 when that position is padding), ``d`` 0 at padded positions, ``S1`` and ``S2`` in one
    native pass (as the unmasked launcher sums), the shift removed in float64 with the real count ``n``.
    ``d`` is left for :func:`elemt` to write ``y`` over.
    """
    C = x.shape[1]
    acc = compute_dtype(x.dtype)
    if x.numel() == 0:
        return torch.zeros(2 * C + 1, dtype=torch.float64, device=x.device)
    first = _first(x).to(acc)  # x[0, :, 0, ...]
    p = torch.where(mask.reshape(-1)[:1], first, 0)  # a padded first position (any value) gives the pivot 0
    n = mask.sum(dtype=torch.float64).reshape(1)
    if x.dtype != acc:  # 16-bit: as the unmasked launcher, sum(x) and sum(x (x - p)) of x zeroed at padded positions
        xz = _zeroed_copy(x, mask)
        sum_x, s2 = _channel_sums(xz, xz, p)  # torch's mixed-type path, in float32; padded positions add 0
        sum_x, s2, p = torch.stack((sum_x, s2, p)).double().unbind()
        return torch.cat((sum_x, torch.addcmul(s2, p, sum_x), n))
    d = _zero_padded(_subtract(x, p), mask)
    _base._hand_shifted(x, d, p)
    s1, s2 = _channel_sums(d, d, _constants_for(C, acc, x.device)[0])  # sum(d), sum(d^2): one native pass
    s1, s2, p = torch.stack((s1, s2, p)).double().unbind()
    return torch.cat((s1 + n * p, s2 + (2 * p) * s1 + n * p * p, n))


def elemt(options, operands: Operands, stats, save_stats: bool):
    """See :meth:`~tritonbn.backends.launchers.Launchers.batch_norm_elemt`: its output is 0 at padded positions."""
    y, mean, invstd = _base.elemt(options, operands, stats, save_stats)
    return _zero_padded(y, operands.mask), mean, invstd


def _key(*tensors) -> tuple:
    return tuple((t, _version(t)) for t in tensors)


def _same(key: tuple, other: tuple) -> bool:
    """Whether two :func:`_key` name the same tensors, each unchanged (``None`` for none); inference tensors,
    which have no version counter, never match."""
    return all(
        a is b and (a is None or (version is not None and version == other_version))
        for (a, version), (b, other_version) in zip(key, other, strict=True)
    )


def _take_zeroed(grad_out, x, mask, residual, output):
    """``(dy, x, residual, output)`` for the elementwise launcher: the copies zeroed at padded positions that
    :func:`backward_reduce` made of these very tensors (unchanged since), handed over once (the
    unmasked launchers then hand over ``dz`` too), or else the tensors themselves: each gradient position reads
    only its own, and the padded ones are zeroed at the end. Copies no elementwise launcher takes (a backward
    that asks no input or residual gradient) stay in the slot until the next masked reduction replaces them."""
    entry = getattr(_zeroed, "entry", None)
    _zeroed.entry = None
    if entry is not None and _same(_key(grad_out, x, mask, residual, output), entry[0]):
        return entry[1]
    return grad_out, x, residual, output


def backward_reduce(options, grad_out, saved: Saved, weight_grad: bool, bias_grad: bool):
    """See :meth:`~tritonbn.backends.launchers.Launchers.batch_norm_backward_reduce`: sums over the real positions
    only."""
    s, mask = saved, saved.mask
    zeroed = tuple(_zeroed_copy(t, mask) for t in (grad_out, s.x, s.residual, s.output))
    _zeroed.entry = (_key(grad_out, s.x, mask, s.residual, s.output), zeroed)
    dy, xz, rz, oz = zeroed
    unmasked = Saved(xz, s.weight, s.bias, s.mean, s.invstd, s.stats, rz, oz)
    return _base.backward_reduce(options, dy, unmasked, weight_grad, bias_grad)


def backward_elemt(options, grad_out, saved: Saved, sums, count, input_grad: bool, out_grad_residual):
    """See :meth:`~tritonbn.backends.launchers.Launchers.batch_norm_backward_elemt`: both gradients are 0 at padded
    positions."""
    s, mask, dr = saved, saved.mask, out_grad_residual
    dy, xz, rz, oz = _take_zeroed(grad_out, s.x, mask, s.residual, s.output)
    unmasked = Saved(xz, s.weight, s.bias, s.mean, s.invstd, s.stats, rz, oz)
    dx = _base.backward_elemt(options, dy, unmasked, sums, count, input_grad, dr)
    if dr is not None:
        _zero_padded(dr, mask)
    return None if dx is None else _zero_padded(dx, mask)
