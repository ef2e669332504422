"""The eager path: an autograd Function straight over :func:`~tritonbn._core.passes.forward_pass` and
:func:`~tritonbn._core.passes.backward_pass`, with no custom-op dispatch (the design's rule: eager calls need
not pay it). The custom ops (:mod:`tritonbn._core.custom_ops`) call the same two functions, and
``tests/autograd/test_eager_path.py`` shows that both paths agree.
"""

from __future__ import annotations

import torch

from tritonbn._compat import forward_ad_active
from tritonbn._core import higher_order
from tritonbn._core.call import kept
from tritonbn._core.passes import backward_pass, forward_pass
from tritonbn.backends.launchers import Saved


class EagerBatchNormFunction(torch.autograd.Function):
    """Autograd over the two passes for eager calls.

    The differentiable inputs come first, as autograd needs them; then the ``backend``
    (:class:`tritonbn.backend.Backend`), the layer's ``settings`` and the call's ``operands`` (which hold the
    same input, parameters and residual, and the rest of the call's tensors).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, residual, backend, settings, operands):
        y, mean, invstd, stats = forward_pass(backend, settings, operands)
        if residual is None or settings.activation is None:
            ctx.save_for_backward(x, weight, bias, mean, invstd, stats)
        else:
            ctx.save_for_backward(
                x, weight, bias, mean, invstd, stats, *kept(y, residual, settings.activation, settings.negative_slope)
            )
        ctx.backend, ctx.settings, ctx.mask = backend, settings, operands.mask
        if forward_ad_active():  # forward-mode AD is on: what jvp needs (inputs and statistics only)
            ctx.for_jvp = (x, weight, bias, mean, invstd, stats, residual)
        return y

    @staticmethod
    def jvp(ctx, tx, tw, tb, tr, *_):
        higher_order.check_unmasked(ctx.mask, "forward-mode AD")
        return higher_order.jvp(ctx.settings, *ctx.for_jvp, None, tx, tw, tb, tr)

    @staticmethod
    def backward(ctx, grad_out):
        saved = Saved(*ctx.saved_tensors, mask=ctx.mask)
        needs = ctx.needs_input_grad[:4]
        if torch.is_grad_enabled():  # create_graph=True: differentiable recompute (see higher_order)
            higher_order.check_unmasked(ctx.mask, "double backward (create_graph=True)")
            return (*higher_order.backward(ctx.settings, grad_out, saved, needs), None, None, None)
        return (*backward_pass(ctx.backend, ctx.settings, grad_out, saved, needs), None, None, None)


# ``Function.apply`` without its Python wrapper, which only adds what functorch transforms and ``setup_context``
# need: the route has ruled out the transforms (``tritonbn._core.route.is_eager``), and the Function has no
# setup_context.
apply_eager = super(torch.autograd.Function, EagerBatchNormFunction).apply


def eager_output(launchers, settings, operands):
    """``y`` of an eager call that autograd records, through :class:`EagerBatchNormFunction` over ``launchers`` (a
    :class:`tritonbn.backend.Backend`, or the Triton backend's launchers prepared for the call's record)."""
    t = operands
    return apply_eager(t.input, t.weight, t.bias, t.residual, launchers, settings, t)
