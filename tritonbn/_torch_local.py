"""The PyTorch backend's local path: a training layer that synchronizes with nobody, in a few native ops.

With no process group to sum over (one process, world size 1, or eval without running statistics),
the statistics need not be packed for an all-reduce: :func:`tritonbn._passes.forward_pass` and
:func:`~tritonbn._passes.backward_pass` hand such a layer (no residual, activation or mask) to
:func:`local_forward` and :func:`local_backward`, which make the
passes torch's own CPU BatchNorm makes, and about a third of the backend's per-channel ops, the fixed
cost small layers pay (``benchmarks/cpu_train_step.py``). Both paths (eager and the custom ops) take
them alike, so they still agree bitwise.

The numerical promises are the backend's (see :mod:`tritonbn._torch_backend`):

* float32 / float64: ``d = x - p`` first (``p`` each channel's first element; ``torch.sub``, exact
  where ``x`` is within a factor 2 of ``p``), then ``torch.var_mean`` of ``d`` (accumulated in float64
  on CPU) and ``y = (d - mean_d) * invstd * w + b`` by ``torch.native_batch_norm`` in eval mode over
  ``d`` itself. Every step sees numbers of the size of the standard deviation, so ``|mean| / std =
  1e3`` keeps float32 precision. The backward forms ``d`` again and runs
  ``aten.native_batch_norm_backward`` on it with the mean ``mean - p`` (float64, rounded once).
* float16 / bfloat16: ``torch.native_batch_norm`` in training mode (statistics in float32) and its
  backward, on ``x`` itself: the affine form's error stays below 16-bit rounding (see the backend's
  module docstring).
* The running statistics are updated in float64 and rounded once, as the kernels do (the variance
  unbiased); ``num_batches_tracked`` grows by one. Under ``accumulate_stats`` the packed sums
  ``[n mean | n (var + mean^2) | n]`` are added to the layer's sink instead, in float64.
"""

from __future__ import annotations

import torch

from tritonbn._numerics import compute_dtype
from tritonbn._torch_ops import _channel_sums, _constants_for, _in_layout_of, _scale_shift_, _subtract, _to

_aten = torch.ops.aten


def _as(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else _to(t, dtype)


def _first(x: torch.Tensor) -> torch.Tensor:
    """Each channel's first element, ``x[0, :, 0, ...]``: the shift."""
    return x.as_strided((x.shape[1],), (x.stride(1),))


def _update_running(running_mean, running_var, mean64, var64, n, momentum) -> None:
    """``r + momentum * (value - r)`` in float64, rounded once into each buffer; the variance unbiased."""
    torch.add(running_mean, mean64 - running_mean, alpha=momentum, out=running_mean)
    unbiased = var64.double().mul_(n / max(n - 1, 1))
    torch.add(running_var, unbiased.sub_(running_var), alpha=momentum, out=running_var)


def local_forward(layer, x, weight, bias, running_mean, running_var, num_batches_tracked, save_stats, stats_sink):
    """``(y, mean, invstd, None)`` of a training forward over ``x`` alone, or ``None`` where it does not apply
    (an empty input, or ``momentum=None`` with running statistics: the packed path computes its factor).

    ``stats_sink`` (:func:`tritonbn.accumulate_stats`): the packed ``[sum x | sum x^2 | n]`` of ``x`` is
    added into it, in float64, in place of the running-stat update.
    """
    C = x.shape[1]
    n = x.numel() // C
    if n == 0 or (layer.momentum is None and running_mean is not None and stats_sink is None):
        return None
    if stats_sink is not None:
        running_mean = running_var = num_batches_tracked = None
    acc = compute_dtype(x.dtype)
    if x.dtype == acc:
        p = _to(_first(x), acc)
        d = _subtract(x, p)
        s1, s2 = _channel_sums(d, d, _constants_for(C, acc, x.device)[0])  # sum(d), sum(d^2): one native pass
        mean_d = s1.div_(n)
        var = torch.addcmul(s2.div_(n), mean_d, mean_d, value=-1.0).clamp_min_(0.0)  # |mean_d| ~ std: no cancellation
        invstd = (var + layer.eps).rsqrt_()
        scale = invstd * _to(weight, acc) if weight is not None else invstd
        shift = torch.addcmul(_to(bias, acc), mean_d, scale, value=-1.0) if bias is not None else -mean_d * scale
        y = _scale_shift_(d, scale, shift)
        mean64 = mean_d.double().add_(p)
        native = False
    else:
        # torch's own training kernel, its mixed-type form (16-bit input, float32 parameters): statistics in
        # float32; it updates float32 running statistics itself (unbiased), others are updated below
        native = running_mean is not None and running_mean.dtype == acc
        y, mean, invstd = torch.native_batch_norm(
            x, _as(weight, acc), _as(bias, acc), running_mean if native else None, running_var if native else None,
            True, float(layer.momentum) if native else 0.0, layer.eps,
        )  # fmt: skip
        y = _in_layout_of(y, x)
        mean64 = mean.double()
        var = invstd.double().pow_(-2).sub_(layer.eps) if stats_sink is not None or running_mean is not None else None
    if stats_sink is not None:  # sum x = n mean, sum x^2 = n (var + mean^2), n
        stats_sink[:C].add_(mean64, alpha=n)
        stats_sink[C : 2 * C].add_(torch.addcmul(var.double(), mean64, mean64), alpha=n)
        stats_sink[2 * C :].add_(n)
    elif running_mean is not None:
        if not native:
            _update_running(running_mean, running_var, mean64, var, n, float(layer.momentum))
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
    if not save_stats:
        return y, None, None, None
    return y, mean64, invstd, None


def local_backward(grad_out, x, weight, mean, invstd, input_grad, weight_grad, bias_grad):
    """``(dx, dweight, dbias, None)`` of a layer whose statistics are ``x``'s own (see :func:`local_forward`)."""
    acc = compute_dtype(x.dtype)
    mask = [input_grad, weight_grad, bias_grad]
    w = _as(weight, acc)
    if x.dtype == acc:
        p = _first(x).double()
        xs = _subtract(x, _to(p, acc))  # d = x - p, as the forward
        mean = mean - p
    else:  # torch's mixed-type form: a 16-bit input with float32 statistics (a float32 one where dy is not 16-bit)
        xs = x if grad_out.dtype == x.dtype else x.float()
    dy = grad_out if grad_out.dtype == xs.dtype else grad_out.to(xs.dtype)
    dx, dw, db = _aten.native_batch_norm_backward(dy, xs, w, None, None, _to(mean, acc), _to(invstd, acc), True, 0.0,
                                                  mask)  # fmt: skip
    if input_grad and dx.dtype != x.dtype:
        dx = dx.to(x.dtype)
    if weight is not None and weight.dtype != acc:
        dw, db = _as(dw, weight.dtype), _as(db, weight.dtype)
    return (dx if input_grad else None), (dw if weight_grad else None), (db if bias_grad else None), None
