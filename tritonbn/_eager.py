"""The eager path: an autograd Function straight over :func:`forward_pass` / :func:`backward_pass`, no custom-op
dispatch (DESIGN.md: eager calls need not pay it). The custom ops (:mod:`tritonbn._custom_ops`) call the same two
functions, and ``tests/autograd/test_eager_path.py`` shows that both paths agree.
"""

from __future__ import annotations

import torch

from tritonbn import higher_order
from tritonbn._compat import dispatch_stack_len, forward_ad_active, functorch_transforms_active
from tritonbn._passes import backward_pass, forward_pass, kept_for_backward


class EagerBatchNormFunction(torch.autograd.Function):
    """Autograd over :func:`forward_pass` / :func:`backward_pass` for eager calls.

    ``nondiff`` is ``(ops, layer, running_mean, running_var, num_batches_tracked, stats_sink, mask)``: what the
    passes need besides the differentiable tensors.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, residual, nondiff):
        ops, layer, running_mean, running_var, num_batches_tracked, sink, mask = nondiff
        y, mean, invstd, stats = forward_pass(
            ops, layer, x, weight, bias, running_mean, running_var, num_batches_tracked, residual, stats_sink=sink,
            mask=mask,
        )  # fmt: skip
        if residual is None or layer.activation is None:
            ctx.save_for_backward(x, weight, bias, mean, invstd, stats)
        else:
            ctx.save_for_backward(x, weight, bias, mean, invstd, stats, *kept_for_backward(y, residual, layer))
        ctx.nondiff = nondiff
        if forward_ad_active():  # forward-mode AD is on: what jvp needs (inputs and statistics only)
            ctx.for_jvp = (x, weight, bias, mean, invstd, stats, residual)
        return y

    @staticmethod
    def jvp(ctx, tx, tw, tb, tr, _):
        layer = ctx.nondiff[1]
        higher_order.check_unmasked(ctx.nondiff[6], "forward-mode AD")
        return higher_order.jvp(layer, layer.eps, *ctx.for_jvp, None, tx, tw, tb, tr)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, invstd, stats, *kept = ctx.saved_tensors
        residual, output = kept or (None, None)
        ops, layer = ctx.nondiff[:2]
        need_x, need_w, need_b, need_r, _ = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: differentiable recompute (see higher_order)
            higher_order.check_unmasked(ctx.nondiff[6], "double backward (create_graph=True)")
            grads = higher_order.backward(layer, layer.eps, grad_out, x, weight, bias, mean, invstd, residual, output,
                                          (need_x, need_w, need_b, need_r))  # fmt: skip
            return (*grads, None)
        dx, dw, db, dr = backward_pass(
            ops, layer, grad_out, x, weight, bias, mean, invstd, stats, residual, output, need_x, need_w, need_b,
            need_r, ctx.nondiff[6],
        )  # fmt: skip
        return dx, dw, db, dr, None


def is_eager(x: torch.Tensor) -> bool:
    """Whether a call may skip the custom ops: a plain tensor, no functorch transform or dispatch mode active.

    Anything else (a tensor subclass such as a FakeTensor, ``make_fx``, ``vmap``) takes the custom
    ops, which those know how to trace. The caller has checked ``torch.compiler.is_compiling()``.
    """
    return type(x) is torch.Tensor and not functorch_transforms_active() and dispatch_stack_len() == 0


# ``Function.apply`` without its Python wrapper, which only adds what functorch transforms and
# ``setup_context`` need: ``_eager`` has ruled out the transforms, and the Function has no setup_context.
apply_eager = super(torch.autograd.Function, EagerBatchNormFunction).apply


def params_need_grad(weight, bias, residual) -> bool:
    """Whether a differentiable input other than ``input`` requires grad (the caller checks grad mode)."""
    return (
        (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    )
