"""The PyTorch backend's local path: a training layer that synchronizes with nobody, in torch's own ops.

With no process group to sum over (one process, world size 1, or eval without running statistics),
the statistics need not be packed for an all-reduce. A layer without a mask then makes the passes torch's
own CPU BatchNorm makes, followed by its epilogue in torch's own ops (``y.add_(residual)``, then the activation,
in place on the output where autograd allows it: :func:`_epilogue`), as ``nn.BatchNorm2d`` followed by the same
modules would (``benchmarks/cpu_train_step.py`` times both), in one of two forms that compute the same numbers:

* :func:`recorded`, for an eager call that records autograd (the dispatch, :mod:`tritonbn._core.dispatch`):
  the ops are recorded by torch's autograd itself, with no ``autograd.Function``, so that the backward (and
  the double backward, and forward-mode AD) are torch's own nodes, as in ``nn.BatchNorm2d``;
* :func:`forward` and :func:`backward`, which the passes call (:mod:`tritonbn._core.passes`: the custom
  ops, and calls that record nothing), and which give ``y`` a tensor of its own. Backward reads act'(z)
  with the ops autograd records for the activation, from the output where the forward kept it, or else from
  ``z`` made again by the same kernel over the same input (:func:`_grad_z`): both forms agree bitwise.

In eval with running statistics nothing synchronizes either: :mod:`.local_eval` (imported here) holds that path.

``layer`` is the layer's settings: its ``momentum`` and ``eps`` are read. The caller passes no running
statistics for a forward that must not update them (an activation-checkpointing recompute).

The numerical promises are the backend's (see :mod:`tritonbn.backends.torch.plain`):

* float32 / float64 on CPU: torch's training kernel over ``x`` itself, as ``nn.BatchNorm2d``'s
  (``torch.native_batch_norm``: the mean, then the variance about it, summed as ``nn.BatchNorm2d`` sums them;
  ``y = x * alpha + beta`` with ``alpha = invstd * w``, ``beta = b - mean * alpha``), and its backward
  (``aten.native_batch_norm_backward`` over ``x``, which forms ``x - mean`` per element): the values and bits of
  ``nn.BatchNorm2d`` wherever every channel's ``|mean| * invstd`` is at most :data:`SHIFT_ABOVE` (16; one host read
  of the statistics, which on CPU waits for nothing). There ``x * alpha`` is rounded once at most about 20
  standard deviations' worth of ``w``: ``y`` within about 20 ulp. Farther from zero the affine form would err by
  about ``|mean| / std`` ulp, and torch's channels_last kernel sums the variance less precisely, so the call is made
  again over ``d = x - p`` (``p`` each channel's first element; ``torch.sub``, exact where ``x`` is within a factor
  2 of ``p``), and so is its backward, which makes the same decision from the same ``mean`` and ``invstd``: every
  step then sees numbers of the size of the standard deviation, so ``|mean| / std = 1e3`` and beyond keeps float32
  precision (``d`` has the gradient of ``x``; ``p`` is a constant to it: batch norm does not change when a channel
  is shifted), and buffers the first call updated are moved by ``momentum`` times the change of each statistic.
  On a GPU the call is always made over ``d`` (no host read). Both forms run the same kernels on the same
  tensors, so eager and compiled calls agree bitwise.
* float16 / bfloat16: ``torch.native_batch_norm`` in training mode (statistics in float32) and its
  backward, on ``x`` itself: the affine form's error stays below 16-bit rounding (see the backend's
  module docstring). The epilogue then runs on the 16-bit output, as torch's unfused modules would; a 16-bit
  layer with a residual and relu or leaky_relu takes the packed path instead (:func:`_rounds_a_kink`).
* The running statistics of the arithmetic type are updated by torch's kernel (``momentum * value +
  (1 - momentum) * r``; the variance unbiased; over ``d`` on a GPU, the mean's less ``p`` and ``p`` added back,
  exact where the mean lies within a factor 2 of ``p``, the case that needs it). 16-bit buffers of a 16-bit input
  (a model converted with ``.to(torch.bfloat16)``): by the same kernel over float32 copies of them, copied back,
  so in float32 arithmetic rounded to 16 bits, as ``nn.BatchNorm2d``'s 16-bit kernel computes its update: within
  one 16-bit rounding of the float64 update, in three small ops where that update took six (15-20% of a small
  layer's training step). Others (float32 buffers of a float64 layer, 16-bit buffers of a float32 input) in
  float64, rounded once. ``num_batches_tracked`` grows by one. Under
  ``accumulate_stats`` the packed sums ``[n mean | n (var + mean^2) | n]`` are added to the layer's sink
  instead, in float64.
"""

from __future__ import annotations

import torch

from tritonbn._compat import foreach_add_, foreach_copy_, foreach_sub
from tritonbn._numerics import compute_dtype
from tritonbn.activations import output_gives_grad
from tritonbn.backends.torch.local_eval import (  # noqa: F401 (the eval half of the local path)
    evaluate,
    evaluated,
    evaluated_backward,
    evaluated_natively,
    evaluates_natively,
    recorded_eval,
    running_stats,
    takes_recorded_eval,
)
from tritonbn.backends.torch.steps import (
    _act_backward,
    _as,
    _epilogue,
    _first,
    _in_layout_of,
    _native_layout,
    _per_channel,
    _subtract,
    _to,
)

_aten = torch.ops.aten


def _update_running(running_mean, running_var, mean64, unbiased, momentum) -> None:
    """``r + momentum * (value - r)`` in float64, rounded once into each buffer (buffers of another dtype than the
    arithmetic one, but for 16-bit buffers of a 16-bit input, which :func:`_forward` has the kernel update). Both
    buffers in one call of each op (``value - r`` is float64: ``mean64`` and ``unbiased`` are; the in-place add
    computes in float64 and rounds once into the buffer)."""
    buffers = [running_mean, running_var]
    foreach_add_(buffers, foreach_sub([mean64, unbiased.double()], buffers), alpha=momentum)


def _train_(d, weight, bias, rm, rv, momentum, eps):
    """``(y, mean, invstd)`` of ``d`` by torch's training kernel (the mean, then the variance about it), ``y`` written
    over ``d`` where its layout allows; ``rm`` / ``rv`` take ``momentum`` of the mean and unbiased variance."""
    if not _native_layout(d):  # the native kernels' strided path: y comes back contiguous
        y, mean, invstd = torch.native_batch_norm(d, weight, bias, rm, rv, True, momentum, eps)
        return _in_layout_of(y, d), mean, invstd
    empty = d.new_empty(0)  # resized by the call
    # each element is read before it is written over (as in _scale_shift_)
    return torch.native_batch_norm(d, weight, bias, rm, rv, True, momentum, eps, out=(d, empty, empty.clone()))


# Where the unshifted training kernel's output is kept: every channel's |mean| * invstd at most this. Its affine form
# y = x * alpha + beta then rounds x * alpha (at most about this plus a few standard deviations' worth of w) once: a
# float32 y within about 20 ulp of |w|, as torch's own BatchNorm's. Beyond it, y comes from the shifted copy.
SHIFT_ABOVE = 16.0


def _needs_shift(mean: torch.Tensor, invstd: torch.Tensor) -> bool:
    """Whether a channel's mean lies more than :data:`SHIFT_ABOVE` standard deviations from zero (one host read: the
    CPU path alone, where it waits for nothing)."""
    return torch.mul(mean.detach(), invstd.detach()).abs_().max().item() > SHIFT_ABOVE


def _over_shifted_copy(x, p, w, b, rm, rv, momentum, eps, by_autograd):
    """``(y, mean_d, invstd)`` of torch's training kernel over ``d = x - p`` (``p`` per channel, a constant to
    autograd), ``y`` written over ``d`` where autograd does not record the ops (see :func:`_train_`)."""
    if by_autograd:
        return torch.native_batch_norm(x - _per_channel(p, x), w, b, rm, rv, True, momentum, eps)
    return _train_(_subtract(x, p), w, b, rm, rv, momentum, eps)


def applies(layer, x: torch.Tensor, running_mean: torch.Tensor | None, stats_sink, residual=None) -> bool:
    """Whether the local path takes this training call: two values or more per channel, no cumulative average of
    running statistics (``momentum=None``: the packed path computes its factor), and no kink of a 16-bit sum
    (:func:`_rounds_a_kink`)."""
    return (
        x.numel() > x.shape[1]
        and (layer.momentum is not None or running_mean is None or stats_sink is not None)
        and not _rounds_a_kink(layer, x, residual)
    )


def _rounds_a_kink(layer, x: torch.Tensor, residual) -> bool:
    """A 16-bit input with a residual and relu or leaky_relu: torch's kernels round the batch norm's output to 16
    bits before the residual is added, which moves act'(z) wherever ``|z|`` is below that rounding (a whole
    ``dy`` at such an element); the packed path forms ``z`` in float32, as the kernels do."""
    return residual is not None and x.dtype != compute_dtype(x.dtype) and layer.activation in ("relu", "leaky_relu")


def _forward(layer, x, weight, bias, running_mean, running_var, num_batches_tracked, stats_sink, by_autograd):
    """``(y, mean, invstd)``: the local training forward (see the module docstring). ``by_autograd``: the ops are
    autograd's to record (``y`` a fresh tensor, and ``mean`` ``None`` where nothing reads it); otherwise ``y`` is
    in ``x``'s layout (written over the shifted copy where one is made)."""
    C = x.shape[1]
    n = x.numel() // C
    if stats_sink is not None:
        running_mean = running_var = num_batches_tracked = None
    acc = compute_dtype(x.dtype)
    w, b = _as(weight, acc), _as(bias, acc)
    own = running_mean is not None and running_mean.dtype == acc  # buffers torch's kernels update themselves
    # 16-bit buffers of a 16-bit input: the kernel updates float32 copies of them, copied back (see the docstring)
    copied = not own and running_mean is not None and x.dtype != acc and running_mean.dtype == x.dtype
    momentum = float(layer.momentum) if own or copied else 1.0
    if x.dtype == acc and x.device.type != "cpu":  # a GPU tensor: no host read of the statistics, always shifted
        p = _first(x.detach())
        # without buffers of the arithmetic type: momentum 1 over zeros leaves the mean and the unbiased variance
        rm, rv = (torch.sub(running_mean, p), running_var) if own else torch.zeros(2, C, dtype=acc, device=x.device)
        y, mean_d, invstd = _over_shifted_copy(x, p, w, b, rm, rv, momentum, layer.eps, by_autograd)
        if own:
            torch.add(rm, p, out=running_mean)
        # float64 (out of place: a float64 mean_d is that tensor itself); a by_autograd call with its buffers updated
        # reads it nowhere
        mean = None if by_autograd and own else torch.add(mean_d.detach().double(), p)
    else:  # torch's training kernel over x itself, as nn.BatchNorm's (16-bit x: its mixed-type form, float32
        # statistics), updating buffers of the arithmetic type, or float32 copies of 16-bit buffers of a 16-bit x;
        # others: momentum 1 over zeros leaves the mean and the unbiased variance
        if own:
            rm, rv = running_mean, running_var
        elif copied:
            rm, rv = _to(running_mean, acc), _to(running_var, acc)
        else:
            rm, rv = x.new_zeros(C, dtype=acc), x.new_zeros(C, dtype=acc)
        y, mean, invstd = torch.native_batch_norm(x, w, b, rm, rv, True, momentum, layer.eps)
        if copied:  # rounded into the 16-bit buffers
            foreach_copy_((running_mean, running_var), (rm, rv))
        if x.dtype == acc and _needs_shift(mean, invstd):  # far from zero: again, over the shifted copy (see the
            # module docstring)
            first_mean, first_invstd = mean.detach(), invstd.detach()
            p = _first(x.detach())
            rm, rv = x.new_zeros(C, dtype=acc), x.new_zeros(C, dtype=acc)
            y, mean_d, invstd = _over_shifted_copy(x, p, w, b, rm, rv, 1.0, layer.eps, by_autograd)
            mean = torch.add(mean_d.detach().double(), p)  # float64: a float64 mean_d is that tensor itself
            if own:  # the first call's update moved by momentum times the change of each statistic, in float64
                to_var = n / (n - 1)
                var_change = invstd.detach().double().pow(-2).sub_(first_invstd.double().pow(-2)).mul_(to_var)
                running_mean.add_(mean - first_mean.double(), alpha=momentum)
                running_var.add_(var_change, alpha=momentum)
        else:  # float64; a by_autograd call with its buffers updated reads it nowhere
            mean = None if by_autograd and (own or copied) else mean.detach().double()
        if not by_autograd:
            y = _in_layout_of(y, x)
    unbiased = rv
    if stats_sink is not None:  # sum x = n mean, sum x^2 = n (var + mean^2), n
        stats_sink[:C].add_(mean, alpha=n)
        stats_sink[C : 2 * C].add_(torch.addcmul(unbiased.double() * ((n - 1) / n), mean, mean), alpha=n)
        stats_sink[2 * C :].add_(n)
    elif running_mean is not None:
        if not (own or copied):
            _update_running(running_mean, running_var, mean, unbiased, float(layer.momentum))
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
    return y, mean, invstd


def takes_recorded(layer, x, running_mean, stats_sink, residual) -> bool:
    """Whether :func:`recorded` takes an eager training call: the local path applies (:func:`applies`) and the layout
    is one torch's kernels keep (the Function takes the others)."""
    return applies(layer, x, running_mean, stats_sink, residual) and _native_layout(x)


def recorded(layer, call, update=True):
    """``y`` of an eager training call whose ops autograd records (see the module docstring), one that
    :func:`takes_recorded`. ``call``: its tensors (``input``, ``weight``, ``bias``, ``running_mean``, ``running_var``,
    ``num_batches_tracked``, ``residual``, ``sink``); ``update=False`` leaves the running statistics alone (a
    checkpoint's recompute)."""
    t = call
    rm, rv, nbt = (t.running_mean, t.running_var, t.num_batches_tracked) if update else (None, None, None)
    y = _forward(layer, t.input, t.weight, t.bias, rm, rv, nbt, t.sink, True)[0]
    return _epilogue(layer, y, t.residual, True)


def forward(
    layer, x, weight, bias, running_mean, running_var, num_batches_tracked, save_stats, stats_sink, residual=None
):
    """``(y, mean, invstd, None)`` of a training forward over ``x`` alone (``mean`` float64), or ``None`` where
    the local path does not apply (:func:`applies`).

    ``stats_sink`` (:func:`tritonbn.accumulate_stats`): the packed ``[sum x | sum x^2 | n]`` of ``x`` is
    added into it, in float64, in place of the running-stat update.
    """
    if not applies(layer, x, running_mean, stats_sink, residual):
        return None
    y, mean, invstd = _forward(
        layer, x, weight, bias, running_mean, running_var, num_batches_tracked, stats_sink, False
    )
    y = _epilogue(layer, y, residual, False)
    return (y, mean, invstd, None) if save_stats else (y, None, None, None)


def _grad_z(layer, grad_out, xs, w, b, residual, output):
    """``dz = dy * act'(z)`` as autograd computes it over :func:`recorded`'s ops: from the output where its sign
    gives act'(z), else from ``z`` made again exactly as the forward made it (the same training kernel over the
    same ``d``, plus the residual), so that both forms agree bitwise."""
    activation, slope = layer.activation, layer.negative_slope
    if activation is None:
        return grad_out
    if output is not None and output_gives_grad(activation, slope):
        return _act_backward(grad_out, output, activation, slope, True)
    z = torch.native_batch_norm(xs, w, b, None, None, True, 0.0, layer.eps)[0]
    if residual is not None:
        z.add_(residual)
    return _act_backward(grad_out, z, activation, slope, False)  # act'(z) from z's sign: as from y's, same bits


def backward(layer, grad_out, x, weight, bias, mean, invstd, residual, output, needs):
    """``(dx, dweight, dbias, dresidual)`` of a layer whose statistics are ``x``'s own (see :func:`forward`);
    ``needs``: which of the four are asked for. ``residual`` and ``output``: what the forward kept for the
    epilogue's act'(z) (:func:`tritonbn._core.call.kept`). ``None`` where ``z`` would be made again from a 16-bit
    batch-norm output, across a kink (:func:`_rounds_a_kink`): the packed path's backward takes those."""
    if _rounds_a_kink(layer, x, residual):
        return None
    input_grad, weight_grad, bias_grad, residual_grad = needs
    acc = compute_dtype(x.dtype)
    mask = [input_grad, weight_grad, bias_grad]
    w = _as(weight, acc)
    if x.dtype == acc and x.device.type == "cpu" and not _needs_shift(_to(mean, acc), invstd):
        xs = z_of = x  # the forward's kernel was over x itself (mean and invstd its own: the same decision)
    elif x.dtype == acc:
        p = _first(x)
        xs, mean = _subtract(x, p), mean - p  # d = x - p and its mean, exactly the forward's
        z_of = xs
    else:  # torch's mixed-type form: a 16-bit input with float32 statistics (a float32 one where dy is not 16-bit)
        xs, z_of = (x if grad_out.dtype == x.dtype else x.float()), x
    dz = _grad_z(layer, grad_out, z_of, w, _as(bias, acc), residual, output)
    dr = (dz.clone() if dz is grad_out else dz) if residual_grad else None  # an op's outputs may not alias its inputs
    if not any(mask):
        return None, None, None, dr
    dy = dz if dz.dtype == xs.dtype else dz.to(xs.dtype)
    mean, invstd = _to(mean, acc), _to(invstd, acc)
    dx, dw, db = _aten.native_batch_norm_backward(dy, xs, w, None, None, mean, invstd, True, 0.0, mask)
    if input_grad and dx.dtype != x.dtype:
        dx = dx.to(x.dtype)
    if weight is not None and weight.dtype != acc:
        dw, db = _as(dw, weight.dtype), _as(db, weight.dtype)
    return (dx if input_grad else None), (dw if weight_grad else None), (db if bias_grad else None), dr
