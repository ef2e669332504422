"""The data path: the launchers plus one all-reduce per pass, in two plain functions of tensors.

:func:`forward_pass` and :func:`backward_pass` hold the passes, over the four launchers of a backend
(:mod:`tritonbn.kernels` or :mod:`tritonbn._torch_backend`). Eager calls run them from an autograd
Function directly (:mod:`tritonbn._eager`); ``torch.compile`` traces the ``torch.library`` custom ops
(:mod:`tritonbn._custom_ops`), whose bodies call the same two functions.

Forward (training)::

    stats = batch_norm_stats(x)                 # local [sum_x | sum_x2 | count], (2C + 1,) fp64
    all_reduce(stats)                           # THE forward collective: 2C + 1 doubles, any world size
    y, mean, invstd = batch_norm_elemt(...)     # also updates the running stats on the device

Backward (training)::

    sums, dw, db = batch_norm_backward_reduce(dy, x, mean, invstd, w)   # local, (2, C) fp32
    all_reduce(sums)                            # THE backward collective: 2*C floats
    dx = batch_norm_backward_elemt(dy, x, mean, invstd, w, sums, stats[-1:])

On the PyTorch backend a layer that synchronizes with nobody (no process group, residual, activation or
mask) takes its local path instead, torch's own passes without the packed statistics
(:mod:`tritonbn._torch_local`): here for the custom ops and calls that record no autograd; an eager call
that records autograd runs the same ops before any Function (:func:`tritonbn.functional.run`).

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

Gradients beyond first order go through :mod:`tritonbn.higher_order`: under ``create_graph=True``
(``torch.is_grad_enabled()`` inside backward) both autograd Functions' backward recompute the gradients with
differentiable torch ops and a differentiable all-reduce instead of the launchers, and forward-mode
AD uses their ``jvp``. The first-order path does none of this.
"""

from __future__ import annotations

import torch

from tritonbn._checks import signature
from tritonbn._compat import current_graph_task_id
from tritonbn.activations import output_gives_grad
from tritonbn.distributed import all_reduce_sum, check_signature, debug_enabled


class Layer:
    """A layer's settings and process groups: what its calls need besides their tensors.

    The module builds one when it is first called and keeps it until a setting changes (see
    :class:`tritonbn.SyncBatchNorm`); the functional form and the custom ops build one per call.
    ``group`` is what training synchronizes over (``None``: this rank alone; always ``None`` in eval),
    ``debug_group`` what ``TRITONBN_DEBUG=1`` checks signatures over, and ``name`` the layer's
    identity in those checks (a string). ``world`` is the default process group the groups were resolved
    against, so that a module built before ``init_process_group`` resolves them again.
    """

    __slots__ = ("training", "momentum", "eps", "activation", "negative_slope", "group", "debug_group", "name",
                 "world")  # fmt: skip

    def __init__(self, training, momentum, eps, activation=None, negative_slope=0.01, group=None, debug_group=None,
                 name="", world=None):  # fmt: skip
        self.training = training
        self.momentum = momentum
        self.eps = eps
        self.activation = activation
        self.negative_slope = negative_slope
        self.group = group
        self.debug_group = group if debug_group is None else debug_group
        self.name = name
        self.world = world


def stats_shape(C: int) -> tuple[int, ...]:
    """Shape of the packed forward statistics: ``[sum x (C) | sum x^2 (C) | count (1)]``."""
    return (2 * C + 1,)


def in_backward() -> bool:
    """Whether this forward runs inside a backward pass: an activation-checkpointing recompute."""
    return current_graph_task_id() != -1


def kept_for_backward(y, residual, layer):
    """``(residual, output)``: what backward reads act'(z) from (see the module docstring), or ``None``."""
    if layer.activation is None or residual is None:
        return None, None
    if output_gives_grad(layer.activation, layer.negative_slope):
        return None, y
    return residual, None


def synchronizes_with_nobody(layer, residual, mask) -> bool:
    """Whether a call can take the PyTorch backend's local path (:mod:`tritonbn._torch_local`): training with no
    process group, and no residual, activation or mask."""
    return layer.training and layer.group is None and layer.activation is None and residual is None and mask is None


def forward_pass(ops, layer, x, weight, bias, running_mean, running_var, num_batches_tracked, residual,
                 save_stats=True, stats_sink=None, mask=None):  # fmt: skip
    """The forward pass over the launchers in ``ops``: ``(y, mean, invstd, stats)``, ``stats`` ``None`` in eval.

    Training: local stats, the one all-reduce over ``layer.group`` (``None``: no communication),
    then ``y = act(bn(x) + residual)`` and the in-place running-stat update. ``stats`` is the global
    packed ``[sum x | sum x^2 | count]``. A forward that runs inside a backward pass (an
    activation-checkpointing recompute) leaves the running statistics alone. ``save_stats=False``
    (nothing will run backward) skips ``mean`` and ``invstd``.

    ``stats_sink`` (:func:`tritonbn.accumulate_stats`): a ``(2C + 1,)`` fp64 buffer that ``stats``
    is added into, on the device, in place of the running-stat update.

    ``mask`` (masked BatchNorm): a bool ``(N, *S)`` tensor, True at real positions. Statistics and count
    cover those; ``y`` is 0 at the others.
    """
    if not layer.training:
        y, mean, invstd = ops.batch_norm_elemt(
            x, weight, bias, running_mean=running_mean, running_var=running_var, eps=layer.eps, residual=residual,
            activation=layer.activation, negative_slope=layer.negative_slope, save_stats=save_stats, mask=mask,
        )  # fmt: skip
        return y, mean, invstd, None
    if current_graph_task_id() != -1:  # in_backward(), inline: the hot path
        running_mean = running_var = num_batches_tracked = None
    local = ops.local_forward  # the PyTorch backend's local path (tritonbn/_torch_local.py); None for the kernels
    if local is not None and synchronizes_with_nobody(layer, residual, mask):
        out = local(layer, x, weight, bias, running_mean, running_var, num_batches_tracked, save_stats, stats_sink)
        if out is not None:
            return out
    stats = ops.batch_norm_stats(x, mask=mask)
    if layer.group is not None:
        all_reduce_sum(stats, layer.group)
    if stats_sink is not None:  # tritonbn.accumulate_stats: pool the global sums, update nothing now
        stats_sink.add_(stats)
        running_mean = running_var = num_batches_tracked = None
    y, mean, invstd = ops.batch_norm_elemt(
        x, weight, bias, stats=stats, running_mean=running_mean, running_var=running_var,
        num_batches_tracked=num_batches_tracked, momentum=layer.momentum, eps=layer.eps, residual=residual,
        activation=layer.activation, negative_slope=layer.negative_slope, save_stats=save_stats, mask=mask,
    )  # fmt: skip
    return y, mean, invstd, stats


def backward_pass(ops, layer, grad_out, x, weight, bias, mean, invstd, stats, residual, output, input_grad,
                  weight_grad, bias_grad, residual_grad, mask=None):  # fmt: skip
    """The backward pass over the launchers in ``ops``: ``(dx, dweight, dbias, dresidual)``, ``None`` if not asked for.

    Training: local reductions of ``dz``, the one all-reduce of ``[sum dz | sum dz*xhat]`` (only
    when the input needs a gradient), then dx and the residual's gradient in one pass. Eval:
    dx = dz * invstd * weight. ``residual`` / ``output`` are what the fused activation's gradient
    is read from (see the module docstring). ``mask``: as in :func:`forward_pass`; both gradients are 0
    at padded positions, and the sums cover the real ones.
    """
    training, group, activation, slope = layer.training, layer.group, layer.activation, layer.negative_slope
    if training and group is not None and debug_enabled():
        check_signature(group, "backward", signature(x, True, input_grad), name=layer.name)
    local = ops.local_backward  # the PyTorch backend's local path (tritonbn/_torch_local.py); None for the kernels
    if local is not None and synchronizes_with_nobody(layer, residual, mask):
        if not residual_grad and x.numel():  # torch's kernels divide by the count: an empty input's are the packed
            return local(grad_out, x, weight, mean, invstd, input_grad, weight_grad, bias_grad)
    sums = dx = dw = db = dr = None
    if weight_grad or bias_grad or (input_grad and training):
        sums, dw, db = ops.batch_norm_backward_reduce(
            grad_out, x, mean, invstd, weight, weight_grad=weight_grad, bias_grad=bias_grad, bias=bias,
            activation=activation, negative_slope=slope, residual=residual, output=output, mask=mask,
        )  # fmt: skip
    if input_grad or residual_grad:
        if input_grad and training and group is not None:
            all_reduce_sum(sums, group)
        if residual_grad:
            dr = torch.empty_like(x)
        dx = ops.batch_norm_backward_elemt(
            grad_out, x, mean, invstd, weight, sums if training else None, stats[-1:] if training else None,
            bias=bias, activation=activation, negative_slope=slope, residual=residual, output=output,
            input_grad=input_grad, out_grad_residual=dr, mask=mask,
        )  # fmt: skip
    return dx, dw, db, dr
