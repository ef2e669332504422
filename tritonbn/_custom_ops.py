"""The compiled path: ``torch.library`` custom ops that ``torch.compile`` traces and keeps whole.

``tritonbn::batch_norm_forward`` and ``tritonbn::batch_norm_backward`` are :func:`forward_pass` and
:func:`backward_pass` as ops, with the collectives inside; a process group travels by name (a
string traces). :class:`SyncBatchNormFunction` gives them autograd: torch.library cannot register
autograd on an op that mutates its inputs (the running statistics).
"""

from __future__ import annotations

import torch

from tritonbn import higher_order
from tritonbn._compat import forward_ad_active, resolve_process_group
from tritonbn._numerics import compute_dtype
from tritonbn._passes import Layer, backward_pass, forward_pass, kept_for_backward, stats_shape
from tritonbn.backend import ops_for


def group_name(group) -> str:
    """The name a custom op takes for ``group`` (a resolved group or ``None``): ``""`` means no communication."""
    return "" if group is None else group.group_name


def _resolve_name(name: str):
    if not name:
        return None
    return resolve_process_group(name)


@torch.library.custom_op(
    "tritonbn::batch_norm_forward", mutates_args=("running_mean", "running_var", "num_batches_tracked")
)
def batch_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    residual: torch.Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
    activation: str | None,
    negative_slope: float,
    group_name: str,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`forward_pass` as one op, over the group named ``group_name`` ("" for none): ``(y, mean, invstd, stats)``.

    In eval, and on the PyTorch backend's local path (which packs no statistics: nothing reads them there),
    ``stats`` is left uninitialized (an op returns tensors). ``mask``: masked BatchNorm.
    """
    layer = Layer(training, momentum, eps, activation, negative_slope, _resolve_name(group_name))
    y, mean, invstd, stats = forward_pass(
        ops_for(x), layer, x, weight, bias, running_mean, running_var, num_batches_tracked, residual, mask=mask
    )
    if stats is None:
        stats = x.new_empty(stats_shape(x.shape[1]), dtype=torch.float64)
    return y, mean, invstd, stats


@batch_norm_forward.register_fake
def _(x, weight, bias, running_mean, running_var, num_batches_tracked, residual, training, momentum, eps, *_):
    C = x.shape[1]
    return (
        torch.empty_like(x),
        x.new_empty(C, dtype=torch.float64),
        x.new_empty(C, dtype=compute_dtype(x.dtype)),
        x.new_empty(stats_shape(C), dtype=torch.float64),
    )


@torch.library.custom_op("tritonbn::batch_norm_backward", mutates_args=())
def batch_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    stats: torch.Tensor,
    residual: torch.Tensor | None,
    output: torch.Tensor | None,
    training: bool,
    activation: str | None,
    negative_slope: float,
    input_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
    residual_grad: bool,
    group_name: str,
    name: str = "",
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward_pass` as one op: ``(dx, dweight, dbias, dresidual)``; a gradient not asked for is empty."""
    layer = Layer(training, None, 0.0, activation, negative_slope, _resolve_name(group_name), name=name)
    grads = backward_pass(
        ops_for(x), layer, grad_out, x, weight, bias, mean, invstd, stats,
        residual, output, input_grad, weight_grad, bias_grad, residual_grad, mask,
    )  # fmt: skip
    return tuple(g if g is not None else x.new_empty(0) for g in grads)  # distinct: op outputs may not alias


@batch_norm_backward.register_fake
def _(grad_out, x, weight, bias, mean, invstd, stats, residual, output, training, activation, negative_slope,
      input_grad, weight_grad, bias_grad, residual_grad, group_name, name="", mask=None):  # fmt: skip
    C = x.shape[1]
    gdtype = weight.dtype if weight is not None else compute_dtype(x.dtype)
    return (
        torch.empty_like(x) if input_grad else x.new_empty(0),
        x.new_empty(C, dtype=gdtype) if weight_grad else x.new_empty(0),
        x.new_empty(C, dtype=gdtype) if bias_grad else x.new_empty(0),
        torch.empty_like(x) if residual_grad else x.new_empty(0),
    )


class SyncBatchNormFunction(torch.autograd.Function):
    """Autograd for the two custom ops: the path ``torch.compile`` traces.

    torch.library cannot register autograd on an op that mutates its inputs, hence this Function.
    ``torch.compile`` traces it and keeps both ops whole, with the collectives inside.
    """

    @staticmethod
    def forward(
        ctx, x, weight, bias, residual, running_mean, running_var, num_batches_tracked, training, momentum, eps,
        activation, negative_slope, group_name, name, mask=None,
    ):  # fmt: skip
        y, mean, invstd, stats = torch.ops.tritonbn.batch_norm_forward(
            x, weight, bias, running_mean, running_var, num_batches_tracked, residual, training, momentum, eps,
            activation, negative_slope, group_name, mask,
        )  # fmt: skip
        keep_residual, keep_output = kept_for_backward(y, residual, Layer(training, momentum, eps, activation,
                                                                           negative_slope))  # fmt: skip
        ctx.save_for_backward(x, weight, bias, mean, invstd, stats, keep_residual, keep_output, mask)
        ctx.training, ctx.activation, ctx.negative_slope = training, activation, negative_slope
        ctx.group_name, ctx.has_residual, ctx.name, ctx.eps = group_name, residual is not None, name, eps
        if forward_ad_active():  # forward-mode AD is on: what jvp needs (inputs and statistics only)
            higher_order.check_unmasked(mask, "forward-mode AD")
            ctx.for_jvp = (x, weight, bias, mean, invstd, stats, residual)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, invstd, stats, residual, output, mask = ctx.saved_tensors
        need_x, need_w, need_b, need_r = ctx.needs_input_grad[:4]
        need_r = need_r and ctx.has_residual
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True: see higher_order
            higher_order.check_unmasked(mask, "double backward (create_graph=True)")
            grads = higher_order.backward(_ctx_layer(ctx), ctx.eps, grad_out, x, weight, bias, mean, invstd, residual,
                                          output, (need_x, need_w, need_b, need_r))  # fmt: skip
            return grads + (None,) * 11
        dx, dw, db, dr = torch.ops.tritonbn.batch_norm_backward(
            grad_out, x, weight, bias, mean, invstd, stats, residual, output, ctx.training, ctx.activation,
            ctx.negative_slope, need_x, need_w, need_b, need_r, ctx.group_name, ctx.name, mask,
        )  # fmt: skip
        grads = (dx if need_x else None, dw if need_w else None, db if need_b else None, dr if need_r else None)
        return grads + (None,) * 11


class SyncBatchNormFunctionForwardAD(SyncBatchNormFunction):
    """:class:`SyncBatchNormFunction` with a ``jvp``, for forward-mode AD outside ``torch.compile``.

    Dynamo refuses to trace a Function that defines ``jvp``, so only uncompiled calls made while a
    forward-AD level is active (tensor subclasses, dispatch modes) take this one.
    """

    @staticmethod
    def jvp(ctx, tx, tw, tb, tr, *_):
        return higher_order.jvp(_ctx_layer(ctx), ctx.eps, *ctx.for_jvp, None, tx, tw, tb, tr)


def _ctx_layer(ctx) -> Layer:
    """The :class:`Layer` that :mod:`tritonbn.higher_order` needs, from what the custom-op Function saved."""
    return Layer(ctx.training, None, ctx.eps, ctx.activation, ctx.negative_slope, _resolve_name(ctx.group_name))
