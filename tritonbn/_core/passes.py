"""The two passes: a backend's launchers plus one all-reduce per pass, each one plain function of tensors.

:func:`forward_pass` and :func:`backward_pass` hold the passes, over the four launchers of a backend
(:class:`tritonbn.backend.Backend`: the Triton kernels or the PyTorch backend), called with the layer's settings and
the call's :class:`Operands` or :class:`Saved` (:mod:`tritonbn.backends.launchers`); the sketches below name them as
:mod:`tritonbn.kernels` does. Eager calls run them from
an autograd Function directly (:mod:`tritonbn._core.eager`); ``torch.compile`` traces the ``torch.library``
custom ops (:mod:`tritonbn._core.custom_ops`), whose bodies call the same two functions.

Forward (training)::

    stats = batch_norm_stats(x)                 # local [sum_x | sum_x2 | count], (2C + 1,) fp64
    all_reduce(stats)                           # THE forward collective: 2C + 1 doubles, any world size, and
                                                # 2 identity slots (tritonbn.lockstep: ranks out of step raise)
    y, mean, invstd = batch_norm_elemt(...)     # also updates the running stats on the device

Backward (training)::

    sums, dw, db = batch_norm_backward_reduce(dy, x, mean, invstd, w)   # local, (2, C) fp32
    all_reduce(sums)                            # THE backward collective: 2*C sums, sent as 2C + 3 doubles
    dx = batch_norm_backward_elemt(dy, x, mean, invstd, w, sums, stats[-1:])

On the PyTorch backend the passes use its local path where nothing is summed (:mod:`tritonbn.backends.torch.local`):
a layer that synchronizes with nobody makes torch's own passes, and eval is one native pass (its backward torch's
own eval backward over the running statistics the forward saved in ``stats``).

Each launcher is one kernel launch. Float64 inputs compute in float64 throughout (saved invstd and
the backward sums too), so ``torch.autograd.gradcheck`` holds at its default tolerances.

Derivation. With ``xhat = (x - mean) * invstd`` over the global batch of ``n`` elements per
channel and ``y = xhat * w + b``, the gradient of any loss with respect to ``x`` is

    dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))

where the means run over the *global* batch: this is why backward needs the global
``sum(dy)`` and ``sum(dy * xhat)``, and nothing else, from the other ranks. ``dw = sum(dy * xhat)``
and ``db = sum(dy)`` stay local, as in ``torch.nn.SyncBatchNorm``: DDP averages them.

A fused epilogue ``y = act(z)``, ``z = xhat * w + b + residual``, changes only the upstream
gradient: every formula above takes ``dz = dy * act'(z)`` in place of ``dy``, and the residual's
gradient is ``dz``. The backward kernels compute ``dz`` on the fly, in the passes they make anyway.
What they need for ``act'(z)`` decides what is saved:

* no residual: nothing more; ``z`` is recomputed from the saved ``x`` and the statistics;
* a residual with relu, or leaky_relu with a slope >= 0: the output ``y`` (``z > 0`` exactly where
  ``y > 0``), which the next layer usually holds anyway;
* a residual with silu (or a negative slope): the residual itself, to recompute ``z``.

In eval (running statistics) mean and invstd are constants: ``dx = w * invstd * dz``, and nothing
communicates.

Gradients beyond first order go through :mod:`tritonbn._core.higher_order`: under ``create_graph=True``
(``torch.is_grad_enabled()`` inside backward) both autograd Functions' backward recompute the gradients with
differentiable torch ops and a differentiable all-reduce instead of the launchers, and forward-mode
AD uses their ``jvp``. The first-order path does none of this.
"""

from __future__ import annotations

import torch

from tritonbn._core.call import in_backward, synchronizes_with_nobody
from tritonbn._core.recompute import global_stats
from tritonbn._signature import check_signature, debug_enabled, signature
from tritonbn.backends.launchers import Saved
from tritonbn.lockstep import all_reduce_sums


def forward_pass(backend, settings, operands, save_stats=True, enclosing=False):
    """The forward pass over ``backend``'s launchers: ``(y, mean, invstd, stats)``, ``stats`` ``None`` in eval (on
    the PyTorch backend with ``save_stats``, the running statistics as they are now, for the eval backward).

    Training: local stats, the one all-reduce over ``settings.group`` (``None``: no communication), then
    ``y = act(bn(x) + residual)`` and the in-place running-stat update. ``stats`` is the global packed
    ``[sum x | sum x^2 | count]``. A forward that runs inside a backward pass (an activation-checkpointing
    recompute) leaves the running statistics alone. ``save_stats=False`` (nothing will run backward) skips
    ``mean`` and ``invstd``.

    An activation-checkpointing recompute of a call that synchronizes takes its first forward's global statistics
    (:mod:`tritonbn._core.recompute`): no all-reduce, and no running statistics or sink updated. ``enclosing``: the
    call may run inside another autograd Function's forward (a reentrant checkpoint's, a compiled graph's), where its
    first forward keeps them.

    ``operands.sink`` (:func:`tritonbn.accumulate_stats`): a ``(2C + 1,)`` fp64 buffer that ``stats`` is added
    into, on the device, in place of the running-stat update. ``operands.mask`` (masked BatchNorm): a bool
    ``(N, *S)`` tensor, True at real positions; statistics and count cover those, and ``y`` is 0 at the others.
    """
    t = operands
    stats = running = None
    if not settings.batch_stats and t.mask is None and backend.local is not None:  # eval: one native pass
        rm, rv = t.running_mean, t.running_var
        out = backend.local.evaluated(settings, t.input, t.weight, t.bias, rm, rv, t.residual, save_stats)
        if out is not None:
            return out if save_stats else (out, None, None, None)
        if save_stats:  # the running statistics as they are now, for the eval backward (evaluated_backward)
            running = backend.local.running_stats(rm, rv)
    if settings.batch_stats:
        backward = in_backward()
        if backward:
            t = t.without_running_stats()
        local = backend.local  # the PyTorch backend's local path; None for the kernels
        if local is not None and synchronizes_with_nobody(settings, t.mask):
            rm, rv, nbt = t.running_mean, t.running_var, t.num_batches_tracked
            out = local.forward(settings, t.input, t.weight, t.bias, rm, rv, nbt, save_stats, t.sink, t.residual)
            if out is not None:
                return out
        if settings.group is None:
            stats = backend.stats(t.input, t.mask)
        else:  # the one all-reduce, or a recompute's copy of its first forward's result
            stats, replayed = global_stats(backend, settings, t, backward, enclosing)
            if replayed:
                t = t.without_running_stats()
                t.sink = None
        if t.sink is not None:  # tritonbn.accumulate_stats: pool the global sums, update nothing now
            t.sink.add_(stats)
            t = t.without_running_stats()
    y, mean, invstd = backend.elemt(settings, t, stats, save_stats)  # in eval (stats None), with the running ones
    nbt = t.num_batches_tracked
    if nbt is not None and settings.group is None and not t.input.numel() and t.running_mean is not None:
        nbt.add_(1)  # as torch counts an empty batch (the launchers count a step only where the global batch has one)
    return y, mean, invstd, (stats if running is None else running)


def forward_output(backend, settings, operands):
    """``y`` of a call that nothing will run backward for (inference, or nothing needs a gradient): the forward pass
    without the statistics backward reads. It may run inside another autograd Function's forward."""
    return forward_pass(backend, settings, operands, save_stats=False, enclosing=True)[0]


def backward_pass(backend, settings, grad_out, saved: Saved, needs):
    """The backward pass over ``backend``'s launchers: ``(dx, dweight, dbias, dresidual)``, ``None`` if not asked.

    ``needs`` is ``(input, weight, bias, residual)``: which gradients are asked for. Training: local reductions
    of ``dz``, the one all-reduce of ``[sum dz | sum dz*xhat]`` (only when the input needs a gradient), then dx
    and the residual's gradient in one pass. Eval: dx = dz * invstd * weight. ``saved.residual`` /
    ``saved.output`` are what the fused activation's gradient is read from (see the module docstring).
    ``saved.mask``: as in :func:`forward_pass`; both gradients are 0 at padded positions, and the sums cover
    the real ones.
    """
    s = saved
    input_grad, weight_grad, bias_grad, residual_grad = needs
    training, group = settings.batch_stats, settings.group
    if training and group is not None and debug_enabled():
        check_signature(group, "backward", signature(s.x, True, input_grad), name=settings.name)
    local = backend.local  # the PyTorch backend's local path; None for the kernels
    if local is not None and not training and s.mask is None and s.stats is not None:  # eval: torch's own backward
        kept = s.residual, s.output  # what the epilogue's act'(z) is read from
        grads = local.evaluated_backward(settings, grad_out, s.x, s.weight, s.bias, s.stats, *kept, needs)
        if grads is not None:
            return grads
    if local is not None and synchronizes_with_nobody(settings, s.mask):
        if s.x.numel():  # torch's kernels divide by the count: an empty input's are packed
            kept = s.residual, s.output  # what the epilogue's act'(z) is read from
            grads = local.backward(settings, grad_out, s.x, s.weight, s.bias, s.mean, s.invstd, *kept, needs)
            if grads is not None:
                return grads
    sums = dx = dw = db = dr = None
    if weight_grad or bias_grad or (input_grad and training):
        sums, dw, db = backend.backward_reduce(settings, grad_out, s, weight_grad, bias_grad)
    if input_grad or residual_grad:
        if input_grad and training and group is not None:
            sums = all_reduce_sums(sums, group, settings.name)  # checked: ranks out of step raise
        if residual_grad:
            dr = torch.empty_like(s.x)
        count = s.stats[-1:] if training else None
        dx = backend.backward_elemt(settings, grad_out, s, sums if training else None, count, input_grad, dr)
    return dx, dw, db, dr
