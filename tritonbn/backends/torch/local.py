"""The PyTorch backend's local path: a training layer that synchronizes with nobody, in torch's own ops.

With no process group to sum over (one process, world size 1, or eval without running statistics),
the statistics need not be packed for an all-reduce. A layer with no residual, activation or mask then
makes the passes torch's own CPU BatchNorm makes (``benchmarks/cpu_train_step.py`` times it against
``nn.BatchNorm2d``), in one of two forms that compute the same numbers:

* :func:`recorded`, for an eager call that records autograd (the dispatch, :mod:`tritonbn._core.dispatch`):
  the ops are recorded by torch's autograd itself, with no ``autograd.Function``, so that the backward (and
  the double backward, and forward-mode AD) are torch's own nodes, as in ``nn.BatchNorm2d``;
* :func:`forward` and :func:`backward`, which the passes call (:mod:`tritonbn._core.passes`: the custom
  ops, and calls that record nothing), and which write ``y`` over the shifted copy.

``layer`` is the layer's settings: its ``momentum`` and ``eps`` are read. The caller passes no running
statistics for a forward that must not update them (an activation-checkpointing recompute).

The numerical promises are the backend's (see :mod:`tritonbn.backends.torch.plain`):

* float32 / float64: ``d = x - p`` first (``p`` each channel's first element; ``torch.sub``, exact
  where ``x`` is within a factor 2 of ``p``), then torch's training kernel over ``d``
  (``torch.native_batch_norm``: the mean, then the variance about it, summed as ``nn.BatchNorm2d`` sums
  them, in float64 or float32 by layout and torch version;
  ``y = d * alpha + beta`` with ``alpha = invstd * w``, ``beta = b - mean_d * alpha``) and its
  backward (``aten.native_batch_norm_backward`` over ``d``, with ``mean_d``). Every step sees numbers
  of the size of the standard deviation, so ``|mean| / std = 1e3`` keeps float32 precision. ``d`` has
  the gradient of ``x`` (``p`` is a constant to it: batch norm does not change when a channel is
  shifted). Both forms run the same kernels on the same ``d``, so eager and compiled calls agree bitwise.
* float16 / bfloat16: ``torch.native_batch_norm`` in training mode (statistics in float32) and its
  backward, on ``x`` itself: the affine form's error stays below 16-bit rounding (see the backend's
  module docstring).
* The running statistics of the arithmetic type are updated by torch's kernel (``momentum * value +
  (1 - momentum) * r``; the variance unbiased), the mean's less ``p`` and ``p`` added back (exact where
  the mean lies within a factor 2 of ``p``, the case that needs it); others (float32 buffers of a
  float64 layer, 16-bit buffers) in float64, rounded once. ``num_batches_tracked`` grows by one. Under
  ``accumulate_stats`` the packed sums ``[n mean | n (var + mean^2) | n]`` are added to the layer's sink
  instead, in float64.
"""

from __future__ import annotations

import torch

from tritonbn._numerics import compute_dtype
from tritonbn.backends.torch.steps import (
    _first,
    _in_layout_of,
    _native_layout,
    _per_channel,
    _subtract,
    _to,
)

_aten = torch.ops.aten


def _as(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else _to(t, dtype)


def _update_running(running_mean, running_var, mean64, unbiased, momentum) -> None:
    """``r + momentum * (value - r)`` in float64, rounded once into each buffer (buffers torch's kernels cannot
    update: another dtype than the arithmetic one)."""
    torch.add(running_mean, mean64 - running_mean, alpha=momentum, out=running_mean)
    torch.add(running_var, unbiased.double() - running_var, alpha=momentum, out=running_var)


def _train_(d, weight, bias, rm, rv, momentum, eps):
    """``(y, mean, invstd)`` of ``d`` by torch's training kernel (the mean, then the variance about it), ``y`` written
    over ``d`` where its layout allows; ``rm`` / ``rv`` take ``momentum`` of the mean and unbiased variance."""
    if not _native_layout(d):  # the native kernels' strided path: y comes back contiguous
        y, mean, invstd = torch.native_batch_norm(d, weight, bias, rm, rv, True, momentum, eps)
        return _in_layout_of(y, d), mean, invstd
    empty = d.new_empty(0)  # resized by the call
    # each element is read before it is written over (as in _scale_shift_)
    return torch.native_batch_norm(d, weight, bias, rm, rv, True, momentum, eps, out=(d, empty, empty.clone()))


def applies(layer, x: torch.Tensor, running_mean: torch.Tensor | None, stats_sink) -> bool:
    """Whether the local path takes this training call: two values or more per channel, and no cumulative
    average of running statistics (``momentum=None``: the packed path computes its factor)."""
    return x.numel() > x.shape[1] and (layer.momentum is not None or running_mean is None or stats_sink is not None)


def _forward(layer, x, weight, bias, running_mean, running_var, num_batches_tracked, stats_sink, by_autograd):
    """``(y, mean, invstd)``: the local training forward (see the module docstring). ``by_autograd``: the ops are
    autograd's to record (``y`` a fresh tensor, and ``mean`` ``None`` where nothing reads it); otherwise ``y`` is
    written over the shifted copy."""
    C = x.shape[1]
    n = x.numel() // C
    if stats_sink is not None:
        running_mean = running_var = num_batches_tracked = None
    acc = compute_dtype(x.dtype)
    w, b = _as(weight, acc), _as(bias, acc)
    own = running_mean is not None and running_mean.dtype == acc  # buffers torch's kernels update themselves
    momentum = float(layer.momentum) if own else 1.0
    if x.dtype == acc:
        p = _first(x.detach())
        d = x - _per_channel(p, x) if by_autograd else _subtract(x, p)
        # without buffers of the arithmetic type: momentum 1 over zeros leaves the mean and the unbiased variance
        rm, rv = (torch.sub(running_mean, p), running_var) if own else torch.zeros(2, C, dtype=acc, device=x.device)
        if by_autograd:
            y, mean_d, invstd = torch.native_batch_norm(d, w, b, rm, rv, True, momentum, layer.eps)
        else:
            y, mean_d, invstd = _train_(d, w, b, rm, rv, momentum, layer.eps)
        if own:
            torch.add(rm, p, out=running_mean)
        # float64 (out of place: a float64 mean_d is that tensor itself); a by_autograd call with its buffers updated
        # reads it nowhere
        mean = None if by_autograd and own else torch.add(mean_d.detach().double(), p)
        unbiased = rv
    else:  # torch's training kernel in its mixed-type form (16-bit input, float32 parameters): float32 statistics
        y, mean, invstd = torch.native_batch_norm(
            x, w, b, running_mean if own else None, running_var if own else None, True, momentum, layer.eps
        )
        y, mean = (y if by_autograd else _in_layout_of(y, x)), (None if by_autograd and own else mean.detach().double())
        unbiased = None if own else invstd.detach().double().pow_(-2).sub_(layer.eps).mul_(n / (n - 1))
    if stats_sink is not None:  # sum x = n mean, sum x^2 = n (var + mean^2), n
        stats_sink[:C].add_(mean, alpha=n)
        stats_sink[C : 2 * C].add_(torch.addcmul(unbiased.double() * ((n - 1) / n), mean, mean), alpha=n)
        stats_sink[2 * C :].add_(n)
    elif running_mean is not None:
        if not own:
            _update_running(running_mean, running_var, mean, unbiased, float(layer.momentum))
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
    return y, mean, invstd


def recorded(layer, x, weight, bias, running_mean, running_var, num_batches_tracked, stats_sink):
    """``y`` of an eager training call whose ops autograd records (see the module docstring), or ``None`` where
    the local path does not apply or the layout is not one torch's kernels keep (the Function takes those)."""
    if not (applies(layer, x, running_mean, stats_sink) and _native_layout(x)):
        return None
    return _forward(layer, x, weight, bias, running_mean, running_var, num_batches_tracked, stats_sink, True)[0]


def forward(layer, x, weight, bias, running_mean, running_var, num_batches_tracked, save_stats, stats_sink):
    """``(y, mean, invstd, None)`` of a training forward over ``x`` alone (``mean`` float64), or ``None`` where
    the local path does not apply (:func:`applies`).

    ``stats_sink`` (:func:`tritonbn.accumulate_stats`): the packed ``[sum x | sum x^2 | n]`` of ``x`` is
    added into it, in float64, in place of the running-stat update.
    """
    if not applies(layer, x, running_mean, stats_sink):
        return None
    y, mean, invstd = _forward(
        layer, x, weight, bias, running_mean, running_var, num_batches_tracked, stats_sink, False
    )
    return (y, mean, invstd, None) if save_stats else (y, None, None, None)


def backward(grad_out, x, weight, mean, invstd, input_grad, weight_grad, bias_grad):
    """``(dx, dweight, dbias, None)`` of a layer whose statistics are ``x``'s own (see :func:`forward`)."""
    acc = compute_dtype(x.dtype)
    mask = [input_grad, weight_grad, bias_grad]
    w = _as(weight, acc)
    if x.dtype == acc:
        p = _first(x)
        xs, mean = _subtract(x, p), mean - p  # d = x - p and its mean, exactly the forward's
    else:  # torch's mixed-type form: a 16-bit input with float32 statistics (a float32 one where dy is not 16-bit)
        xs = x if grad_out.dtype == x.dtype else x.float()
    dy = grad_out if grad_out.dtype == xs.dtype else grad_out.to(xs.dtype)
    mean, invstd = _to(mean, acc), _to(invstd, acc)
    dx, dw, db = _aten.native_batch_norm_backward(dy, xs, w, None, None, mean, invstd, True, 0.0, mask)
    if input_grad and dx.dtype != x.dtype:
        dx = dx.to(x.dtype)
    if weight is not None and weight.dtype != acc:
        dw, db = _as(dw, weight.dtype), _as(db, weight.dtype)
    return (dx if input_grad else None), (dw if weight_grad else None), (db if bias_grad else None), None
