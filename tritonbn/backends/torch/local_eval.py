"""The PyTorch backend's eval path with running statistics, the half of its local path (:mod:`.local`, which
re-exports it) where nothing synchronizes because nothing is summed.

:func:`evaluated` is torch's own eval kernel over
the input, one native pass as ``nn.BatchNorm2d``'s, its epilogue in place (the passes call it for every eval call
without a mask that autograd does not record, and for the eager Function and the custom ops). An eager eval call
that autograd records runs :func:`recorded_eval` instead, the same kernel recorded by autograd itself, so that its
backward is torch's own nodes; the Function and the custom ops' backward (:func:`evaluated_backward`) make the same
native calls over the running statistics saved at forward (:func:`running_stats`), so all three agree bitwise.
"""

from __future__ import annotations

import torch

from tritonbn._numerics import compute_dtype
from tritonbn.activations import output_gives_grad
from tritonbn.backends.torch.steps import _act_backward, _as, _constants_for, _epilogue, _native_layout, _to

_aten = torch.ops.aten


def _eval_types(x: torch.Tensor, weight, bias, running_mean, running_var) -> bool:
    """Whether torch's eval kernel takes these dtypes as they are: the parameters and buffers all of ``x``'s type, or
    all float32 beside a 16-bit ``x`` (its mixed-type form)."""
    dtype = running_mean.dtype
    if dtype != x.dtype and not (dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)):
        return False
    return (
        running_var.dtype == dtype
        and (weight is None or weight.dtype == dtype)
        and (bias is None or bias.dtype == dtype)
    )


def evaluated(layer, x, weight, bias, running_mean, running_var, residual, save_stats=False):
    """``y`` of an eval call with running statistics, or with ``save_stats`` ``(y, mean, invstd, stats)`` (what a
    backward reads), or ``None`` where the packed path takes the call: an empty input, a layout torch's kernels do
    not keep, or parameters of mixed types.

    ``y`` is torch's own eval kernel over ``x`` itself, one native pass, as ``nn.BatchNorm2d``'s: ``y = x * alpha
    + beta`` with ``alpha = w * invstd(running_var)`` and ``beta = b - running_mean * alpha``, in float32 for
    float32 and 16-bit inputs and in float64 for float64 ones (there ``y`` is ``F.batch_norm``'s, to the bit); the
    epilogue follows in place (:func:`_epilogue`): for a 16-bit input without a residual, on the 16-bit output,
    the very values of ``nn.BatchNorm2d`` followed by the activation module (as the training local path does). A
    16-bit input with a residual takes the same kernel over a float32 copy, adds the residual and activates in
    float32, and rounds once at the end, as the kernels and the export lowering do (so no 16-bit rounding of the
    batch norm's output moves a kink of ``z``: ``local._rounds_a_kink`` is a training matter). What a backward
    reads is the packed path's (``mean`` the running mean in float64, ``invstd`` from the running variance), so the
    eager Function and the custom ops that ``torch.compile`` traces run this same function and agree bitwise.

    Precision: no shifted copy of ``x`` is made (only the statistics need one). ``x * alpha`` and ``beta`` are each
    rounded once at the size of ``|x| * |alpha|``, so ``y`` is within a few ulp of ``|x| * |alpha|``: at ``|mean| /
    std = K`` about ``K`` ulp of ``y``, the same size as the rounding that ``x`` itself carries there (a float32
    ``x`` near ``K`` standard deviations from 0 is stored to ``K`` ulp of a standard deviation). The float64 test
    holds it to that bound at ``K = 1e3`` (``tests/autograd/test_torch_eval.py``).
    """
    if not ((x.is_contiguous() or _native_layout(x)) and x.numel()):  # is_contiguous first: the common case, cheap
        return None
    if not _eval_types(x, weight, bias, running_mean, running_var):
        return None
    if residual is None or x.dtype == compute_dtype(x.dtype):
        y = evaluated_natively(layer, x, weight, bias, running_mean, running_var, residual)
        if not save_stats:
            return y
    else:  # a 16-bit residual: the sum in float32, rounded once at the end (as the kernels and the export lowering)
        acc = torch.float32
        z = x.to(acc)
        w, b, rm, rv = _as(weight, acc), _as(bias, acc), _as(running_mean, acc), _as(running_var, acc)
        e1, e2 = _constants_for(x.shape[1], acc, x.device)[2:]
        torch.native_batch_norm(z, w, b, rm, rv, False, 0.0, layer.eps, out=(z, e1, e2))  # in place, as _train_
        if residual is not None:  # a 16-bit residual in float32 first: torch's mixed-type add_ is the slower pass
            z.add_(_to(residual, acc))
        y = _epilogue(layer, z, None, False).to(x.dtype)
        if not save_stats:
            return y
    mean = running_mean.to(torch.float64, copy=True)  # an output of its own, never the running buffer
    invstd = _as((running_var.double() + layer.eps).rsqrt_(), compute_dtype(x.dtype))  # as the packed path's
    return y, mean, invstd, running_stats(running_mean, running_var)


def evaluates_natively(x, weight, bias, running_mean, running_var, residual) -> bool:
    """Whether :func:`evaluated` takes an eval call in one native pass (:func:`evaluate`): a non-empty input in a
    layout torch's kernels keep, types its eval kernel takes as they are, and no 16-bit residual."""
    return (
        (x.is_contiguous() or _native_layout(x))  # is_contiguous first: the common case, cheap
        and x.numel() > 0
        and _eval_types(x, weight, bias, running_mean, running_var)
        and (residual is None or x.dtype == compute_dtype(x.dtype))
    )


def evaluate(layer, call):
    """``y`` of an eval call that :func:`evaluates_natively` (``call``: its tensors, ``input``, ``weight``, ``bias``,
    ``running_mean``, ``running_var``, ``residual``)."""
    t = call
    return evaluated_natively(layer, t.input, t.weight, t.bias, t.running_mean, t.running_var, t.residual)


def evaluated_natively(layer, x, weight, bias, running_mean, running_var, residual=None):
    """:func:`evaluated`'s ``y`` where it takes the call in one native pass: torch's eval kernel over ``x``, then the
    epilogue in place."""
    y = torch.native_batch_norm(x, weight, bias, running_mean, running_var, False, 0.0, layer.eps)[0]
    if residual is not None or layer.activation is not None:
        y = _epilogue(layer, y, residual, False)
    return y


def running_stats(running_mean: torch.Tensor, running_var: torch.Tensor) -> torch.Tensor:
    """``[running_mean | running_var | 0]`` in float64, the packed statistics' shape: what an eval call's backward
    reads (:func:`evaluated_backward`), the buffers as they were at forward (a later training call updates them in
    place), exact in float64 for every buffer type."""
    C = running_mean.shape[0]
    stats = running_mean.new_zeros(2 * C + 1, dtype=torch.float64)
    stats[:C].copy_(running_mean)
    stats[C : 2 * C].copy_(running_var)
    return stats


def takes_recorded_eval(x, weight, bias, running_mean, running_var, residual) -> bool:
    """Whether :func:`recorded_eval` takes an eval call: a non-empty input in a layout torch's kernels keep, the
    types torch's eval kernel takes as they are, buffers of the type :func:`evaluated_backward` gives them back
    (``weight``'s, or the arithmetic type), and no 16-bit residual (that sum is made in float32 and rounded once,
    and its act'(z) read from a 16-bit output: the Function takes it)."""
    acc = compute_dtype(x.dtype)
    return (
        (residual is None or x.dtype == acc)
        and running_mean.dtype == (acc if weight is None else weight.dtype)
        and _eval_types(x, weight, bias, running_mean, running_var)
        and x.numel() > 0
        and _native_layout(x)
    )


def recorded_eval(layer, call):
    """``y`` of an eager eval call whose ops autograd records, one that :func:`takes_recorded_eval` (``call``: its
    tensors, as :func:`evaluate` reads them).

    torch's own eval kernel over ``x`` (as :func:`evaluated`, the same values), on copies of the running statistics
    (autograd's node reads them in backward, after a training call may have updated the buffers), then the epilogue
    (:func:`_epilogue`): the backward is torch's own nodes, as ``nn.BatchNorm2d``'s, and the custom ops' backward
    (:func:`evaluated_backward`) makes the same calls over the same numbers, so that eager and compiled calls agree
    bitwise."""
    t = call
    rm, rv = t.running_mean.clone(), t.running_var.clone()
    y = torch.native_batch_norm(t.input, t.weight, t.bias, rm, rv, False, 0.0, layer.eps)[0]
    if t.residual is None and layer.activation is None:
        return y
    return _epilogue(layer, y, t.residual, True)


def _backward_types(x, weight) -> bool:
    """Whether torch's eval backward takes ``x`` and ``weight`` as they are (``weight`` of ``x``'s type, or float32
    beside a 16-bit ``x``)."""
    return weight is None or weight.dtype == x.dtype or weight.dtype == compute_dtype(x.dtype)


def evaluated_backward(layer, grad_out, x, weight, bias, stats, residual, output, needs):
    """``(dx, dweight, dbias, dresidual)`` of an eval call, as autograd computes them over :func:`recorded_eval`'s
    ops: ``dz = dy * act'(z)`` (from the output where its sign gives it, else from ``z`` made again by the same eval
    kernel), then ``aten.native_batch_norm_backward`` in eval mode over the running statistics the forward saved in
    ``stats`` (:func:`running_stats`), of ``weight``'s type (or the arithmetic type). ``None`` where the launchers'
    eval backward takes it: an empty input, a layout torch's kernels do not keep, parameters of other types, and a
    16-bit input whose act'(z) was read beside a residual (see :func:`takes_recorded_eval`)."""
    acc = compute_dtype(x.dtype)
    if not (x.numel() and _native_layout(x) and _backward_types(x, weight)):
        return None
    if x.dtype != acc and (residual is not None or output is not None):
        return None
    input_grad, weight_grad, bias_grad, residual_grad = needs
    C = x.shape[1]
    dtype = weight.dtype if weight is not None else acc
    rm, rv = _to(stats[:C], dtype), _to(stats[C : 2 * C], dtype)
    activation, slope = layer.activation, layer.negative_slope
    dz = grad_out
    if activation is not None and output is not None and output_gives_grad(activation, slope):
        dz = _act_backward(grad_out, output, activation, slope, True)
    elif activation is not None:
        z = torch.native_batch_norm(x, weight, bias, rm, rv, False, 0.0, layer.eps)[0]
        if residual is not None:
            z.add_(residual)
        dz = _act_backward(grad_out, z, activation, slope, False)  # act'(z) from z's sign: as from y's, same bits
    dr = (dz.clone() if dz is grad_out else dz) if residual_grad else None  # an op's outputs may not alias its inputs
    mask = [input_grad, weight_grad, bias_grad]
    if not any(mask):
        return None, None, None, dr
    dx, dw, db = _aten.native_batch_norm_backward(dz, x, weight, rm, rv, None, None, False, layer.eps, mask)
    return (dx if input_grad else None), (dw if weight_grad else None), (db if bias_grad else None), dr
