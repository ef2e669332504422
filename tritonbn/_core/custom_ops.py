"""The compiled path: ``torch.library`` custom ops that ``torch.compile`` traces and keeps whole.

``tritonbn::batch_norm_forward`` and ``tritonbn::batch_norm_backward`` are
:func:`~tritonbn._core.passes.forward_pass` and :func:`~tritonbn._core.passes.backward_pass` as ops, with the
collectives inside. Their schemas are flat, as ``torch.library`` needs: a process group travels by name (a
string traces), and each op body rebuilds the layer's settings from its arguments (:func:`settings_of`).
:class:`SyncBatchNormFunction` gives them autograd: torch.library cannot register autograd on an op that
mutates its inputs (the running statistics).
"""

from __future__ import annotations

import torch

from tritonbn._compat import forward_ad_active, resolve_process_group
from tritonbn._core import higher_order
from tritonbn._core.call import LayerSettings, kept, settings_for, stats_shape
from tritonbn._core.passes import backward_pass, forward_pass
from tritonbn._numerics import compute_dtype
from tritonbn.backend import ops_for
from tritonbn.backends.launchers import Operands, Saved


def group_name(group) -> str:
    """The name a custom op takes for ``group`` (a resolved group or ``None``): ``""`` means no communication."""
    return "" if group is None else group.group_name


def settings_of(training, momentum, eps, activation, negative_slope, group_name, name) -> LayerSettings:
    """The layer's settings, from a custom op's flat arguments (the group by its name, ``""`` for none)."""
    group = resolve_process_group(group_name) if group_name else None
    return settings_for(training, momentum, eps, activation, negative_slope, group, debug_group=group, name=name)


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
    name: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`forward_pass` as one op, over the group named ``group_name`` ("" for none): ``(y, mean, invstd, stats)``.

    In eval, and on the PyTorch backend's local path (which packs no statistics: nothing reads them there),
    ``stats`` is left uninitialized (an op returns tensors). ``mask``: masked BatchNorm.
    """
    settings = settings_of(training, momentum, eps, activation, negative_slope, group_name, name)
    operands = Operands(x, weight, bias, running_mean, running_var, num_batches_tracked, residual, mask)
    y, mean, invstd, stats = forward_pass(ops_for(x), settings, operands, enclosing=True)
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
    mask: torch.Tensor | None,
    training: bool,
    eps: float,
    activation: str | None,
    negative_slope: float,
    group_name: str,
    name: str,
    input_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
    residual_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward_pass` as one op: ``(dx, dweight, dbias, dresidual)``; a gradient not asked for is empty. The
    layer's settings as the forward op's, but ``momentum``, which no backward reads."""
    settings = settings_of(training, None, eps, activation, negative_slope, group_name, name)
    saved = Saved(x, weight, bias, mean, invstd, stats, residual, output, mask)
    grads = backward_pass(ops_for(x), settings, grad_out, saved, (input_grad, weight_grad, bias_grad, residual_grad))
    return tuple(g if g is not None else x.new_empty(0) for g in grads)  # distinct: op outputs may not alias


@batch_norm_backward.register_fake
def _(grad_out, x, weight, bias, *args):
    input_grad, weight_grad, bias_grad, residual_grad = args[-4:]
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
    ``torch.compile`` traces it and keeps both ops whole, with the collectives inside. Its arguments are the
    forward op's, with the layer's settings spelled out for the schema (see :meth:`args`).
    """

    @staticmethod
    def args(settings: LayerSettings, operands: Operands) -> tuple:
        """``apply``'s arguments for one call: the differentiable tensors first, then the forward op's others."""
        t, s = operands, settings
        return (
            t.input,
            t.weight,
            t.bias,
            t.residual,
            t.running_mean,
            t.running_var,
            t.num_batches_tracked,
            s.batch_stats,
            s.momentum,
            s.eps,
            s.activation,
            float(s.negative_slope),
            group_name(s.group),
            s.name,
            t.mask,
        )

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        residual,
        running_mean,
        running_var,
        num_batches_tracked,
        training,
        momentum,
        eps,
        activation,
        negative_slope,
        group_name,
        name,
        mask,
    ):
        op_settings = (training, momentum, eps, activation, negative_slope, group_name, name)
        y, mean, invstd, stats = torch.ops.tritonbn.batch_norm_forward(
            x, weight, bias, running_mean, running_var, num_batches_tracked, residual, *op_settings[:-1], mask, name
        )
        ctx.save_for_backward(
            x, weight, bias, mean, invstd, stats, *kept(y, residual, activation, negative_slope), mask
        )
        ctx.op_settings, ctx.has_residual = op_settings, residual is not None
        if forward_ad_active():  # forward-mode AD is on: what jvp needs (inputs and statistics only)
            higher_order.check_unmasked(mask, "forward-mode AD")
            ctx.for_jvp = (x, weight, bias, mean, invstd, stats, residual)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        saved, training = Saved(*ctx.saved_tensors), ctx.op_settings[0]
        need_x, need_w, need_b, need_r = ctx.needs_input_grad[:4]
        needs = (need_x, need_w, need_b, need_r and ctx.has_residual)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True: see higher_order
            higher_order.check_unmasked(saved.mask, "double backward (create_graph=True)")
            return higher_order.backward(settings_of(*ctx.op_settings), grad_out, saved, needs) + (None,) * 11
        dx, dw, db, dr = torch.ops.tritonbn.batch_norm_backward(
            grad_out,
            saved.x,
            saved.weight,
            saved.bias,
            saved.mean,
            saved.invstd,
            saved.stats,
            saved.residual,
            saved.output,
            saved.mask,
            training,
            *ctx.op_settings[2:],
            *needs,
        )
        grads = tuple(g if need else None for g, need in zip((dx, dw, db, dr), needs, strict=True))
        return grads + (None,) * 11


class SyncBatchNormFunctionForwardAD(SyncBatchNormFunction):
    """:class:`SyncBatchNormFunction` with a ``jvp``, for forward-mode AD outside ``torch.compile``.

    Dynamo refuses to trace a Function that defines ``jvp``, so only uncompiled calls made while a
    forward-AD level is active (tensor subclasses, dispatch modes) take this one.
    """

    @staticmethod
    def jvp(ctx, tx, tw, tb, tr, *_):
        return higher_order.jvp(settings_of(*ctx.op_settings), *ctx.for_jvp, None, tx, tw, tb, tr)


def compiled_output(function, settings: LayerSettings, operands: Operands) -> torch.Tensor:
    """``y`` of a call through the custom ops: ``function`` is :class:`SyncBatchNormFunction` (what ``torch.compile``,
    dispatch modes and tensor subclasses at the dispatch level trace) or, under forward-mode AD uncompiled,
    :class:`SyncBatchNormFunctionForwardAD`."""
    return function.apply(*SyncBatchNormFunction.args(settings, operands))
