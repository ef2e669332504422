"""The PyTorch backend's four launchers, unmasked (:mod:`tritonbn.backends.launchers`): the same math as
:mod:`tritonbn.kernels`.

It runs wherever PyTorch runs (CPU without the Triton interpreter, or a device Triton cannot target),
keeps every result on the device (no host synchronization), and uses the same shifted statistics,
fp64 sums and split fp64 mean as the kernels, so both backends agree to rounding.

Speed. Each full-size pass is one of torch's fused native CPU operations (the ones
``nn.BatchNorm2d`` runs, with their contiguous and channels_last specializations), never a chain of
small ones, and the per-channel work is a few small ops on ``(C,)`` tensors:

* every per-channel sum: ``aten.native_batch_norm_backward`` with only the weight and bias
  gradients asked for (:func:`_channel_sums`). With ``mean = m`` and ``invstd = 1`` it returns
  ``sum(dy)`` and ``sum(dy * (x - m))`` in one read of ``dy`` and ``x``, and writes nothing
  activation-sized. With ``dy = x = x - p`` these are the forward statistics ``S1`` and ``S2``; with
  ``dy = dz`` and ``m = hi`` they are the kernels' backward sums.
* every per-channel scale and shift: ``torch.native_batch_norm`` in eval mode with given statistics,
  one pass (:func:`_scale_shift_`, in place);
* ``x - hi``: one ``torch.sub``, and ``dz - k * (x - hi)``: one ``torch.addcmul`` into that buffer.

A float32 / float64 training forward makes three passes and one activation-sized buffer: ``d = x - p``
(``torch.sub``, the statistics' shifted copy), the sums over ``d`` (one native reduction), and ``y`` written
over ``d`` by one native pass, ``y = d * scale + (bias - (mean - p) * scale)`` with the shift formed in
fp64 and rounded once (:func:`_take_shifted` hands ``d`` from the statistics to the output). The
backward makes four: the sums, then ``x - hi``, ``dz - k * (x - hi)`` and the scale and shift in place.

The per-channel work (``(C,)`` tensors) is what small layers pay: each such op costs a few µs of
dispatch, whatever ``C``. So the running statistics are one ``torch.addcmul`` per buffer (computed in
fp64, written into the buffer), the backward's ``(hi, lo)`` split of the saved mean is made once for
both launchers (:func:`_split_mean`), the weight and bias gradients are the sums themselves (not
copies of the packed buffer), and ``c = -m * scale`` is left to the native pass (its ``mean``).

Precision, the rule behind each choice: where ``|mean| / std`` may be large (float32 and float64
inputs; the tests go to 1e3), a difference of ``x`` and a per-channel value near the mean is formed
first, exactly as the kernels do (exact by Sterbenz wherever ``x`` is within a factor 2 of it), and
only that small difference is scaled: the affine form ``x * alpha + beta`` would round ``x * alpha``
and ``beta`` at ``|mean| / std`` times the precision of the result. The forward's value is the
statistics' shift ``p`` (each channel's first element): ``d * scale`` and ``(mean - p) * scale`` are
then of the size ``K = |p - mean| / std``, so ``y`` is exact to ``K`` roundings, where the kernels'
own shifted variance already carries ``K^2`` (the kernels take ``x - hi``; both agree to rounding
wherever the shifted statistics do). For float16 / bfloat16 inputs the forward takes the affine form
in float32 (one native pass): its error, ``2^-24 |mean| / std``, stays far below the output's own
rounding (``2^-8`` for bfloat16, ``2^-11`` for float16) at every ``|mean| / std`` that 8 or 11 bits
of input can resolve, so results agree with the kernels' to the output's rounding. The sums are
float32 (float64 for float64 inputs) as in the kernels, removed from their shift and summed across
ranks in float64.

The fused epilogue (residual and activation) takes the same fast steps, one native pass each: in the forward
``z.add_(residual)`` and the activation in place; in the backward ``dz = dy * act'(z)`` by the op autograd
records for the activation (``threshold_backward``, ``leaky_relu_backward``, ``silu_backward``), read from the
saved output, or from ``z`` made again by one native pass over ``x - hi`` (and written over it). The reduction
hands ``dz`` (and ``x - hi`` where it made it) to the elementwise launcher (:func:`_take_dz`), so a backward
makes them once.
"""

from __future__ import annotations

import threading

import torch

from tritonbn._numerics import compute_dtype
from tritonbn.backends.launchers import Operands, Saved, check_elemt
from tritonbn.backends.torch.steps import (
    _activate_,
    _channel_sums,
    _constants_for,
    _epilogue_grad,
    _first,
    _in_layout_of,
    _per_channel,
    _scale_shift_,
    _subtract,
    _to,
)

_aten = torch.ops.aten
_shifted = threading.local()  # batch_norm_stats's x - p, for elemt to write y over (_take_shifted)
_split: list = [None]  # the last (mean, version, acc, hi, lo) of _split_mean: backward's two launchers share it
_grads = threading.local()  # backward_reduce's dz (and x - hi), for backward_elemt (_take_dz)


def _split_mean(mean64: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hi, lo)`` in ``acc`` with ``hi + lo = mean64`` to fp64 precision; ``lo`` is ``None`` (0) for fp64.

    The last split is kept (``_split``, keyed by the tensor itself and its version): both backward
    launchers split the same saved mean.
    """
    if acc == torch.float64:
        return mean64, None
    last, version = _split[0], _version(mean64)
    if last is not None and last[0] is mean64 and version is not None and last[1] == version and last[2] == acc:
        return last[3], last[4]
    hi = mean64.to(acc)
    lo = (mean64 - hi).to(acc)
    _split[0] = (mean64, version, acc, hi, lo)
    return hi, lo


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change); ``None`` for an inference tensor, which has
    none (made under ``torch.inference_mode``): such tensors are never handed over."""
    return None if t.is_inference() else t._version


def batch_norm_stats(x: torch.Tensor) -> torch.Tensor:
    """See :func:`tritonbn.kernels.batch_norm_stats`.

    As the kernel: ``d = x - p`` with ``p`` each channel's first element, ``S1 = sum(d)`` and
    ``S2 = sum(d^2)`` from one native reduction (:func:`_channel_sums` with ``dy = x = d``), then
    the packed fp64 ``[S1 + n p | S2 + p (S1 + sum x) | n]``. The shift keeps ``S2 / n - (S1 / n)^2``
    free of cancellation when ``|mean| >> std``; removing it in fp64 is exact to ~1e-16. 16-bit
    inputs skip the shifted copy (see below): one native pass over ``x`` itself.
    """
    C = x.shape[1]
    n = x.numel() // C if C else 0
    if n == 0:
        return torch.zeros(2 * C + 1, dtype=torch.float64, device=x.device)  # count 0
    acc = compute_dtype(x.dtype)
    p = _to(_first(x), acc)  # each channel's first element (x[0, :, 0, ...])
    if x.dtype == acc:
        d = _subtract(x, p)  # torch.sub: exact near p, and |d| ~ std keeps the sums free of cancellation
        _hand_shifted(x, d, p)  # elemt writes y over d (see _take_shifted)
        # native_batch_norm_backward(dy=d, x=d, mean=0, invstd=1): S1 = sum(d), S2 = sum(d * d), one read of d
        s1, s2 = _channel_sums(d, d, _constants_for(C, acc, x.device)[0])
        s1, s2, p = torch.stack((s1, s2, p)).double().unbind()  # the shift comes off in fp64, as in the kernel
        sum_x = torch.add(s1, p, alpha=n)
        sum_x2 = torch.addcmul(s2, p, s1 + sum_x)
    else:
        # 16-bit: native_batch_norm_backward(dy=x, x=x, mean=p, invstd=1), torch's mixed-type path, no
        # copy of x: sum(x) and sum(x * (x - p)) in float32, then sum(x^2) = sum(x * (x - p)) + p sum(x) in
        # fp64. Unshifted, sum(x) loses about 2^-24 sqrt(n) |mean| / std of a std: far below 16-bit
        # rounding at every |mean| / std that 8 or 11 bits resolve.
        sum_x, s2 = _channel_sums(x, x, p)
        sum_x, s2, p = torch.stack((sum_x, s2, p)).double().unbind()
        sum_x2 = torch.addcmul(s2, p, sum_x)
    return torch.cat((sum_x, sum_x2, sum_x.new_full((1,), n)))


def _hand_shifted(x: torch.Tensor, d: torch.Tensor, p: torch.Tensor) -> None:
    """Leave ``d = x - p`` (``p`` per channel, in the arithmetic type of ``d``) for :func:`_take_shifted`."""
    _shifted.entry = (x, _version(x), d, p)


def _take_shifted(x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d, p)``: the ``d = x - p`` that :func:`batch_norm_stats` made from this very ``x`` (unchanged since), or
    ``(None, None)``.

    Handed over once, through a per-thread slot: :func:`elemt` writes ``y`` over it, in place,
    so the forward allocates one activation-sized buffer, as ``nn.BatchNorm2d``'s does. Any other
    sequence (stats of several tensors, then their elemts) finds no match and forms ``x - hi`` itself.
    """
    entry = getattr(_shifted, "entry", None)
    if entry is None:
        return None, None
    _shifted.entry = None
    src, version, d, p = entry
    return (d, p) if src is x and version is not None and version == _version(x) else (None, None)


def _update_running(running_mean, running_var, num_batches_tracked, mean64, var64, n, momentum) -> None:
    """The running-stat update in fp64, as the kernels: ``r + factor * (value - r)``, the variance unbiased.

    One ``torch.addcmul`` per buffer, written into it: its operands promote to fp64 (``value`` is
    fp64), so the update is computed in fp64 and rounded once into the buffer's dtype. ``factor`` is
    0 when every rank was empty (count 0), which leaves the buffers as they were, and
    ``num_batches_tracked`` grows by 1 only when the count is positive.
    """
    if momentum is None:
        factor = n.clamp(max=1.0).div_(num_batches_tracked + 1)
    else:
        factor = n.clamp(max=1.0).mul_(float(momentum))
    torch.addcmul(running_mean, factor, mean64 - running_mean, out=running_mean)
    unbiased = var64 * (n / (n - 1.0).clamp_min_(1.0))
    torch.addcmul(running_var, factor, unbiased - running_var, out=running_var)
    if num_batches_tracked is not None:
        num_batches_tracked.add_(n > 0.0)


def elemt(options, operands: Operands, stats: torch.Tensor | None, save_stats: bool):
    """See :meth:`~tritonbn.backends.launchers.Launchers.batch_norm_elemt`: ``(y, mean, invstd)``.

    ``y = act((x - hi) * scale + shift + residual)`` with ``shift = bias - lo * scale``, as the kernel:
    ``x - hi`` formed first (one pass), then :func:`_scale_shift_` in place (one pass). In training, when
    :func:`batch_norm_stats` left this ``x``'s shifted copy ``d = x - p`` (float32 / float64), ``y`` is
    :func:`_scale_shift_` over ``d`` itself with ``shift = bias - (mean - p) * scale`` (fp64, rounded
    once): one pass, no new buffer. 16-bit inputs without an epilogue take one native pass instead,
    ``torch.native_batch_norm`` in eval mode with ``weight = scale``, ``bias = shift``, ``mean = hi``,
    ``var = 1``, ``eps = 0`` (``alpha = scale``, ``beta = shift - hi * scale``: exact enough for 16-bit
    outputs, see the module docstring).
    """
    t, momentum = operands, options.momentum
    check_elemt(t, stats, momentum)
    x, weight, bias, residual, activation = t.input, t.weight, t.bias, t.residual, options.activation
    running_mean, running_var = t.running_mean, t.running_var
    training = stats is not None
    acc = compute_dtype(x.dtype)
    C = x.shape[1]
    if training:
        n = stats[2 * C]
        mean64, ex2 = (stats[: 2 * C].view(2, C) / n.clamp_min(1.0)).unbind()
        var64 = torch.addcmul(ex2, mean64, mean64, value=-1.0).clamp_min_(0.0)  # NaN stays NaN
        if running_mean is not None:
            _update_running(running_mean, running_var, t.num_batches_tracked, mean64, var64, n, momentum)
    else:  # copies: the saved mean is an output of its own, never the running buffer
        mean64, var64 = running_mean.to(torch.float64, copy=True), running_var.to(torch.float64)
    invstd = _to((var64 + options.eps).rsqrt_(), acc)
    scale = invstd * _to(weight, acc) if weight is not None else invstd
    d, p = _take_shifted(x) if training else (None, None)
    if d is not None:
        # d = x - p from the statistics: y = d * scale + (bias - (mean - p) * scale), the shift in fp64 and
        # rounded once, by native_batch_norm in eval mode over d itself (see the module docstring)
        m = mean64 - p
        shift = torch.addcmul(bias, m, scale, value=-1.0) if bias is not None else m.mul_(scale).neg_()
        z = _scale_shift_(d, scale, _to(shift, acc))
    else:
        hi, lo = _split_mean(mean64, acc)
        shift = _to(bias, acc) if bias is not None else _constants_for(C, acc, x.device)[0]
        if lo is not None:
            shift = torch.addcmul(shift, lo, scale, value=-1.0)
        if x.dtype != acc and residual is None and activation is None and x.numel():
            # 16-bit: native_batch_norm in eval mode, y = x * scale + (shift - hi * scale) in fp32, rounded once
            ones = _constants_for(C, acc, x.device)[1]
            y = torch.native_batch_norm(x, scale, shift, hi, ones, False, 0.0, 0.0)[0]
            y = _in_layout_of(y, x)
            return (y, None, None) if not save_stats else (y, mean64, invstd)
        z = _scale_shift_(_subtract(x, hi), scale, shift)  # torch.sub (exact near hi), then native_batch_norm
    if residual is not None:  # a 16-bit residual in float32 first: torch's mixed-type add is the slower pass
        z.add_(residual if residual.dtype == z.dtype else residual.to(z.dtype))
    z = _activate_(z, activation, options.negative_slope)
    y = z if z.dtype == x.dtype else torch.empty_like(x).copy_(z)
    if not save_stats:
        return y, None, None
    return y, mean64, invstd


def _grad_z(grad_out, x, hi, lo, invstd, weight, options, bias, residual, output):
    """``(dz, xc)``: ``dz = dy * act'(z)``, each step one native pass (:func:`~tritonbn.backends.torch.steps.
    _epilogue_grad`), and ``xc = x - hi`` in the arithmetic type where it was made (to make ``z`` again), else
    ``None``. ``dz`` is in the arithmetic type where ``xc`` was made, else in ``x``'s (read from the output: a
    16-bit ``dz`` is ``dy``, 0, or ``dy * slope`` rounded once, and the reductions take it as they take ``dy``)."""
    acc = compute_dtype(x.dtype)
    xc = None
    if output is None or grad_out.dtype != x.dtype:
        xc = _subtract(x, hi)
    scale = invstd * _to(weight, acc) if weight is not None else invstd
    shift = _to(bias, acc) if bias is not None else _constants_for(x.shape[1], acc, x.device)[0]
    if lo is not None:
        shift = torch.addcmul(shift, lo, scale, value=-1.0)
    dz = _epilogue_grad(grad_out, x, xc, scale, shift, options.activation, options.negative_slope, residual, output)
    return dz, xc


def _take_dz(grad_out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dz, xc)`` that :func:`backward_reduce` made from these very ``grad_out`` and ``x`` (unchanged
    since), or ``(None, None)``: handed over once, through a per-thread slot, as :func:`_take_shifted` does. A
    backward that asks no input or residual gradient never takes it: the next reduction with an epilogue
    replaces it (until then the slot keeps that layer's ``dz``)."""
    entry = getattr(_grads, "entry", None)
    _grads.entry = None
    if entry is None:
        return None, None
    dy, dy_version, src, version, dz, xc = entry
    if dy is grad_out and src is x and None not in (dy_version, version):
        if dy_version == _version(grad_out) and version == _version(x):
            return dz, xc
    return None, None


def backward_reduce(options, grad_out: torch.Tensor, saved: Saved, weight_grad: bool, bias_grad: bool):
    """See :meth:`~tritonbn.backends.launchers.Launchers.batch_norm_backward_reduce`: ``(sums, grad_weight,
    grad_bias)``.

    As the kernel: ``sum(dz)`` and ``sum(dz * (x - hi))`` (:func:`_channel_sums`, one native pass),
    then ``sum(dz * xhat) = (sum(dz * (x - hi)) - lo * sum(dz)) * invstd`` in the arithmetic type (its
    operands are the native op's float32 sums: float64 here would add no precision).
    """
    s, activation = saved, options.activation
    x, weight = s.x, s.weight
    acc = compute_dtype(x.dtype)
    hi, lo = _split_mean(s.mean, acc)
    invstd = _to(s.invstd, acc)
    if activation is None and grad_out.dtype == x.dtype:
        # native_batch_norm_backward(dy, x, mean=hi, invstd=1): sum(dy) and sum(dy * (x - hi)), x - hi per element
        sum_dz, sum_dzx = _channel_sums(grad_out, x, hi)
    else:  # dz = dy * act'(z) in acc (handed to the elemt launcher), reduced against x - hi
        dz, xc = _grad_z(grad_out, x, hi, lo, invstd, weight, options, s.bias, s.residual, s.output)
        if activation is not None:
            _grads.entry = (grad_out, _version(grad_out), x, _version(x), dz, xc)
        if xc is None:
            sum_dz, sum_dzx = _channel_sums(dz, x, hi)
        else:
            sum_dz, sum_dzx = _channel_sums(dz, xc, _constants_for(x.shape[1], acc, x.device)[0])
    sum_dzxhat = sum_dzx.mul_(invstd) if lo is None else torch.addcmul(sum_dzx, lo, sum_dz, value=-1.0).mul_(invstd)
    sums = torch.stack((sum_dz, sum_dzxhat))  # a copy: the all-reduce changes it, the gradients keep their own
    gdtype = weight.dtype if weight is not None else acc
    grad_weight = _to(sum_dzxhat, gdtype) if weight_grad else None
    grad_bias = _to(sum_dz, gdtype) if bias_grad else None
    return sums, grad_weight, grad_bias


def backward_elemt(options, grad_out, saved: Saved, sums, count, input_grad: bool, out_grad_residual):
    """See :meth:`~tritonbn.backends.launchers.Launchers.batch_norm_backward_elemt`: ``dx``, or ``None``.

    As the kernel: ``dx = (dz - k * (x - hi)) * scale + c`` with ``k = mean(dz * xhat) * invstd`` and
    ``c = (k * lo - mean(dz)) * scale``: ``x - hi`` formed first (one pass, one allocation), then
    ``dz - k * t`` (one ``addcmul`` in place) and the scale and shift (:func:`_scale_shift_` in place);
    16-bit inputs take these steps on float32 copies and round once at the end. In eval,
    ``dx = dz * scale``: one native pass.
    """
    s, activation = saved, options.activation
    x, weight = s.x, s.weight
    acc = compute_dtype(x.dtype)
    invstd = _to(s.invstd, acc)
    scale = invstd * _to(weight, acc) if weight is not None else invstd
    hi, lo = _split_mean(s.mean, acc)
    xc = None
    if activation is not None:
        dz, xc = _take_dz(grad_out, x)
        if dz is None:
            dz, xc = _grad_z(grad_out, x, hi, lo, invstd, weight, options, s.bias, s.residual, s.output)
    else:
        dz = grad_out
    if out_grad_residual is not None:
        out_grad_residual.copy_(dz)
    if not input_grad:
        return None
    if sums is None:
        # native_batch_norm_backward in eval mode: dz * weight / sqrt(var + eps), one pass. Not on an empty x: torch's
        # CPU kernels divide by its batch size (SIGFPE at N = 0); torch.mul below gives its empty gradient
        if dz.dtype == x.dtype and x.numel():
            zeros, ones = _constants_for(x.shape[1], acc, x.device)[:2]
            dx = _aten.native_batch_norm_backward(
                dz, x, scale, zeros, ones, None, None, False, 0.0, [True, False, False]
            )[0]
            return dx if dx.stride() == x.stride() else torch.empty_like(x).copy_(dx)
        return torch.mul(dz, _per_channel(scale, x), out=torch.empty_like(x))
    mean_dz, k = (sums * count.clamp_min(1.0).reciprocal_().to(acc)).unbind()
    k = k.mul_(invstd)
    m = torch.addcmul(mean_dz, k, lo, value=-1.0) if lo is not None else mean_dz  # c = -m * scale
    if xc is not None:  # x - hi from the reduction (or made for dz above): written over below
        t, dz = xc, _to(dz, acc)
    elif x.dtype == acc:
        t = _subtract(x, hi)  # torch.sub: exact near hi, as the kernel's x - hi
    else:  # 16-bit: in float32 copies (mixed-dtype TensorIterator ops are many times slower than two casts)
        t = x.to(acc).sub_(_per_channel(hi, x))
        dz = dz.to(acc)
    torch.addcmul(dz, t, _per_channel(k, x), value=-1.0, out=t)  # dz - k * (x - hi), in place
    # (.) * scale - m * scale: native_batch_norm in eval mode over its own input, mean = m, var = 1, eps = 0
    if t.numel():
        zeros, ones, e1, e2 = _constants_for(x.shape[1], acc, x.device)
        torch.native_batch_norm(t, scale, zeros, m, ones, False, 0.0, 0.0, out=(t, e1, e2))
    return t if t.dtype == x.dtype else t.to(x.dtype)
