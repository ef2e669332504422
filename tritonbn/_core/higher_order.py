"""Gradients beyond first order: double backward and forward-mode AD, in differentiable torch ops.

The kernels' backward returns gradients that autograd cannot differentiate again: the saved mean and
invstd, and the global sums, are constants to it. Under ``create_graph=True`` (the only time
``torch.is_grad_enabled()`` holds inside a Function's backward) both autograd Functions instead call
:func:`backward`, which recomputes the normalization from the saved input with torch ops whose
statistics go through a *differentiable* all-reduce (``torch.distributed.nn.functional.all_reduce``),
and differentiates that with ``create_graph=True``. The second-order terms then see the other ranks'
data through the global sums, as the math requires. Nothing here runs on the first-order path.

Recompute (training), with ``m0`` the saved global mean (identical on every rank, so a safe shift)::

    d = x - m0;  [sum d | sum d^2 | n] -> all_reduce (differentiable)
    mean = m0 + sum d / n;  var = sum d^2 / n - (sum d / n)^2;  xhat = (d - sum d / n) * rsqrt(var + eps)
    u = xhat * w + b;  dz = dy * act'(u + residual)
    dx, dw, db = grad(u, (x, w, b), dz, create_graph=True);  dresidual = dz

In eval the saved mean and invstd (the running statistics) are constants, as in torch. The running
statistics are never touched here: they advanced once, in the forward.

Forward mode (:func:`jvp`): with ``xhat`` over the global batch of ``n`` per channel,

    d xhat = invstd * (dx - mean(dx)) - xhat * invstd * mean(xhat * dx)

where the two means run over the global batch (one all-reduce of ``[sum dx | sum xhat*dx]``);
``du = d xhat * w + xhat * dw + db``, ``dz = du + d residual`` and ``dy = act'(z) * dz``.
"""

from __future__ import annotations

import torch
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from tritonbn._numerics import compute_dtype
from tritonbn.distributed import all_reduce_sum


def check_unmasked(mask, what: str) -> None:
    """Masked BatchNorm has first-order gradients only: ``what`` raises an error naming tritonbn."""
    if mask is not None:
        raise RuntimeError(
            f"tritonbn: masked BatchNorm (mask= or lengths=) does not support {what}; call the layer without a "
            "mask, or use first-order gradients"
        )


def _reduce(buffer: torch.Tensor, group) -> torch.Tensor:
    """``all_reduce(SUM)`` that autograd differentiates: torch's own, whose backward is the same all-reduce of
    the gradient (every rank's loss depends on every rank's input through the sum), itself differentiable."""
    return buffer if group is None else differentiable_all_reduce(buffer, group=group)


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.reshape(1, -1, *([1] * (x.dim() - 2)))


def _normalized(x, mean, invstd, training, eps, group):
    """``xhat`` in the compute dtype, differentiable in ``x`` through the global statistics in training."""
    acc = compute_dtype(x.dtype)
    xa = x.to(acc)
    if not training:
        return (xa - _per_channel(mean.to(acc), x)) * _per_channel(invstd.to(acc), x)
    C = x.shape[1]
    dims = [0, *range(2, x.dim())]
    d = xa - _per_channel(mean.detach().to(acc), x)
    n_local = d.new_full((1,), x.numel() // C if C else 0)
    sums = _reduce(torch.cat([d.sum(dims), (d * d).sum(dims), n_local]), group)
    n = sums[2 * C].clamp_min(1.0)
    shift = sums[:C] / n
    var = (sums[C : 2 * C] / n - shift * shift).clamp_min(0.0)
    return (d - _per_channel(shift, x)) * _per_channel(torch.rsqrt(var + eps), x)


def _affine(xhat, x, weight, bias):
    u = xhat * _per_channel(weight.to(xhat.dtype), x) if weight is not None else xhat
    return u + _per_channel(bias.to(xhat.dtype), x) if bias is not None else u


def _act_grad(g, z, activation, slope, output):
    """``g * act'(z)``; ``z > 0`` read from ``output`` when the residual was not kept (relu, leaky slope >= 0).

    relu's and leaky_relu's through torch's own backward ops, whose derivative in ``z`` is zero: what they read the
    sign of stays in the graph (with a zero gradient), as in torch's modules, so a parameter that reaches ``z`` only
    gets a zero gradient, not ``None``. With ``output``, ``z`` is joined to it with a factor of zero."""
    if activation is None:
        return g
    if activation == "silu":
        s = torch.sigmoid(z)
        return g * s * (1.0 + z * (1.0 - s))
    sign = z if output is None else output.to(z.dtype) + z * 0.0  # > 0 where z is
    if activation == "relu":
        return torch.ops.aten.threshold_backward(g, sign, 0.0)
    return torch.ops.aten.leaky_relu_backward(g, sign, slope, False)


def backward(layer, grad_out, saved, needs):
    """``(dx, dweight, dbias, dresidual)`` as differentiable functions of the inputs and ``grad_out``.

    ``layer`` is the layer's settings, ``saved`` the forward's :class:`~tritonbn.backends.launchers.Saved`. ``needs`` is
    ``(input, weight, bias, residual)`` from ``ctx.needs_input_grad``; what is not needed is ``None``.
    ``saved.output`` replaces ``saved.residual`` for the sign of ``z`` (see :mod:`tritonbn._core.passes`);
    relu's and leaky_relu's second derivative is zero, so the sign is all the double backward needs from it.
    """
    x, weight, bias, residual, output = saved.x, saved.weight, saved.bias, saved.residual, saved.output
    mean, invstd, eps = saved.mean, saved.invstd, layer.eps
    need_x, need_w, need_b, need_r = needs
    group = layer.group if layer.batch_stats else None
    xhat = _normalized(x, mean, invstd, layer.batch_stats, eps, group)
    u = _affine(xhat, x, weight, bias)
    z = u
    if layer.activation is not None and output is None and residual is not None:
        z = u + residual.to(u.dtype)
    dz = _act_grad(grad_out.to(u.dtype), z, layer.activation, layer.negative_slope, output)
    wanted = [t for t, need in ((x, need_x), (weight, need_w), (bias, need_b)) if need]
    grads = iter(torch.autograd.grad(u, wanted, dz, create_graph=True, allow_unused=True) if wanted else ())
    out = []
    for t, need in ((x, need_x), (weight, need_w), (bias, need_b)):
        g = next(grads) if need else None
        out.append(torch.zeros_like(t) if need and g is None else g)
    out.append(dz.to(residual.dtype if residual is not None else x.dtype) if need_r else None)
    return tuple(out)


def jvp(layer, x, weight, bias, mean, invstd, stats, residual, output, tx, tw, tb, tr):
    """The tangent of ``y`` for the tangents ``tx, tw, tb, tr`` of ``x, weight, bias, residual`` (``None``: zero)."""
    acc = compute_dtype(x.dtype)
    xa = x.to(acc)
    xhat = (xa - _per_channel(mean.to(acc), x)) * _per_channel(invstd.to(acc), x)
    inv = _per_channel(invstd.to(acc), x)
    C = x.shape[1]
    dims = [0, *range(2, x.dim())]
    t = None
    if tx is not None:
        tx = tx.to(acc)
        if layer.batch_stats:
            sums = torch.cat([tx.sum(dims), (xhat * tx).sum(dims)])
            all_reduce_sum(sums, layer.group)
            # the global count; a layer that synchronizes with nobody counts its own batch (the PyTorch
            # backend's local path, tritonbn/backends/torch/local.py, packs no statistics)
            n = stats[-1].clamp_min(1.0).to(acc) if layer.group is not None else max(1, x.numel() // C)
            t = inv * (tx - _per_channel(sums[:C] / n, x)) - xhat * inv * _per_channel(sums[C:] / n, x)
        else:
            t = inv * tx
        if weight is not None:
            t = t * _per_channel(weight.to(acc), x)
    if tw is not None:
        t = xhat * _per_channel(tw.to(acc), x) if t is None else t + xhat * _per_channel(tw.to(acc), x)
    if tb is not None:
        t = _per_channel(tb.to(acc), x) if t is None else t + _per_channel(tb.to(acc), x)
    if tr is not None:
        t = tr.to(acc) if t is None else t + tr.to(acc)
    if t is None:
        t = torch.zeros((), dtype=acc, device=x.device)
    if layer.activation is not None:
        z = _affine(xhat, x, weight, bias)
        if output is None and residual is not None:
            z = z + residual.to(acc)
        t = _act_grad(t, z, layer.activation, layer.negative_slope, output)
    return torch.empty_like(x).copy_(t.expand(x.shape))
