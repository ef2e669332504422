"""Masked BatchNorm on the PyTorch backend: what its four launchers run for ``mask=``, around :mod:`.plain`.

``mask`` is a bool ``(N, *S)`` tensor, True at real positions. What the kernels do in their loops
(:mod:`tritonbn.kernels`, ``HAS_MASK``) is done here around the unmasked launchers, every step on the
device (the count is a tensor, never read on the host):

* statistics: the kernels' shifted sums over the real positions, written out in torch (one
  ``torch.where`` puts 0 at padded positions, whatever they hold, NaN included), and the count of
  real positions;
* forward output, and both input gradients: the unmasked launcher's result with 0 written at padded
  positions (each output position depends only on its own input position and per-channel values);
* backward sums: the unmasked reduction over ``dy`` made 0 at padded positions, and ``x`` (and the
  residual) made finite there, so that padded positions add exactly 0.

Masked calls are rarer than plain ones and this path is not tuned: it makes a few more passes than the
unmasked one (each ``masked_fill`` is one).
"""

from __future__ import annotations

import torch

import tritonbn.backends.torch.plain as _base
from tritonbn._numerics import compute_dtype
from tritonbn.backends.torch.steps import _channel_sums, _constants_for, _first, _per_channel


def _padded(mask: torch.Tensor) -> torch.Tensor:
    """``(N, 1, *S)``: True at the padded positions, broadcasting over the channels."""
    return ~mask.unsqueeze(1)


def _finite(t: torch.Tensor | None, padded: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.masked_fill(padded, 0)


def batch_norm_stats(x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
    """See :func:`tritonbn.kernels.batch_norm_stats`: ``[sum x | sum x^2 | count]`` over the real positions.

    As the kernel: ``d = x - p`` in the arithmetic type, ``p`` each channel's value at the first position
    of the batch (0 when that position is padding), ``d`` 0 at padded positions, ``S1`` and ``S2`` in one
    native pass (as the unmasked launcher sums), the shift removed in float64 with the real count ``n``.
    """
    C = x.shape[1]
    acc = compute_dtype(x.dtype)
    if x.numel() == 0:
        return torch.zeros(2 * C + 1, dtype=torch.float64, device=x.device)
    first = _first(x).to(acc)  # x[0, :, 0, ...]
    p = torch.where(mask.reshape(-1)[:1], first, 0)  # a padded first position (any value) gives the pivot 0
    d = torch.where(mask.unsqueeze(1), x.to(acc) - _per_channel(p, x), 0)
    s1, s2 = _channel_sums(d, d, _constants_for(C, acc, x.device)[0])  # sum(d), sum(d^2): one native pass
    s1, s2, p = torch.stack((s1, s2, p)).double().unbind()
    n = mask.sum(dtype=torch.float64).reshape(1)
    return torch.cat((s1 + n * p, s2 + (2 * p) * s1 + n * p * p, n))


def batch_norm_elemt(x, weight, bias, *, mask: torch.Tensor, **kwargs):
    """See :func:`tritonbn.kernels.batch_norm_elemt`: its output is 0 at padded positions."""
    y, mean, invstd = _base.batch_norm_elemt(x, weight, bias, **kwargs)
    return y.masked_fill_(_padded(mask), 0), mean, invstd


def batch_norm_backward_reduce(
    grad_out, x, mean, invstd, weight=None, *, mask: torch.Tensor, residual=None, output=None, **kwargs
):
    """See :func:`tritonbn.kernels.batch_norm_backward_reduce`: sums over the real positions only."""
    padded = _padded(mask)
    return _base.batch_norm_backward_reduce(
        grad_out.masked_fill(padded, 0),
        x.masked_fill(padded, 0),
        mean,
        invstd,
        weight,
        residual=_finite(residual, padded),
        output=_finite(output, padded),
        **kwargs,
    )


def batch_norm_backward_elemt(
    grad_out,
    x,
    mean,
    invstd,
    weight=None,
    sums=None,
    count=None,
    *,
    mask: torch.Tensor,
    residual=None,
    output=None,
    out_grad_residual=None,
    **kwargs,
):
    """See :func:`tritonbn.kernels.batch_norm_backward_elemt`: both gradients are 0 at padded positions."""
    padded = _padded(mask)
    dx = _base.batch_norm_backward_elemt(
        grad_out,
        x.masked_fill(padded, 0),
        mean,
        invstd,
        weight,
        sums,
        count,
        residual=_finite(residual, padded),
        output=_finite(output, padded),
        out_grad_residual=out_grad_residual,
        **kwargs,
    )
    if out_grad_residual is not None:
        out_grad_residual.masked_fill_(padded, 0)
    return None if dx is None else dx.masked_fill_(padded, 0)
