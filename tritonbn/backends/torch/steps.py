"""The building blocks of the PyTorch backend (:mod:`.plain`, :mod:`.masked`, :mod:`.local`): each one native op,
or a few.

Its module docstring says which native op each step uses and why it is exact enough; these are those steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonbn.activations import check_output_gives_grad

_aten = torch.ops.aten
_constants: dict = {}

_ONES = {d: (1,) * (d - 2) for d in range(2, 6)}


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view((1, -1) + _ONES[x.dim()])


def _first(x: torch.Tensor) -> torch.Tensor:
    """Each channel's first element, ``x[0, :, 0, ...]`` (a view): the shift the statistics take off."""
    return x.as_strided((x.shape[1],), (x.stride(1),))


def _constants_for(C: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(zeros (C,), ones (C,), empty, empty)`` made once per (C, dtype, device); the native calls read them
    (the empties are the unused ``save_mean`` / ``save_invstd`` outputs of an eval-mode ``out=`` call).
    Made as normal tensors even inside ``torch.inference_mode``, so that calls outside it can use them."""
    key = (C, dtype, device)
    consts = _constants.get(key)
    if consts is None:
        options = {"dtype": dtype, "device": device}
        with torch.inference_mode(False):
            consts = (
                torch.zeros(C, **options),
                torch.ones(C, **options),
                torch.empty(0, **options),
                torch.empty(0, **options),
            )
        _constants[key] = consts
    return consts


def _channel_sums(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(dy), sum(dy * (x - mean)))`` per channel, in one pass: ``aten.native_batch_norm_backward``.

    With ``invstd = 1`` its ``grad_weight`` is ``sum(dy * (x - mean))`` and its ``grad_bias`` is
    ``sum(dy)``; ``grad_input`` is not asked for, so nothing activation-sized is written. ``x - mean``
    is formed per element before the product (as in the kernels), and the sums accumulate in
    float32 (float64 for float64 inputs; in double across the planes of contiguous inputs), the
    kernels' per-lane precision. ``mean`` has the arithmetic type of ``x`` (float32 for 16-bit ``x``:
    torch's mixed-type path).
    """
    if x.numel() == 0:  # the native kernels divide by the batch size: an empty rank's sums are zeros
        zeros = torch.zeros(x.shape[1], dtype=mean.dtype, device=x.device)
        return zeros, zeros.clone()
    if x.dtype != mean.dtype and not (_native_layout(x) and dy.stride() == x.stride()):
        # torch's generic (strided) path sums 16-bit tensors in their own type: give it float32 copies
        x32 = x.to(mean.dtype)
        dy, x = (x32 if dy is x else dy.to(mean.dtype)), x32
    ones = _constants_for(x.shape[1], mean.dtype, x.device)[1]
    _, dotp, total = _aten.native_batch_norm_backward(
        dy, x, None, None, None, mean, ones, True, 0.0, [False, True, True]
    )
    return total, dotp


def _native_layout(t: torch.Tensor) -> bool:
    """Whether the native batch-norm kernels take their fast path on ``t``: contiguous or channels_last."""
    return (
        t.is_contiguous()
        or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
        or (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))
    )


def _scale_shift_(t: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``t = t * scale + shift`` per channel, in place, in one pass: ``torch.native_batch_norm`` in eval
    mode with ``mean = 0``, ``var = 1``, ``eps = 0`` (so ``alpha = scale`` and ``beta = shift`` exactly),
    written over its own input (``out=``: an elementwise kernel reads each element before writing it).
    """
    if t.numel():
        zeros, ones, e1, e2 = _constants_for(t.shape[1], t.dtype, t.device)
        torch.native_batch_norm(t, scale, shift, zeros, ones, False, 0.0, 0.0, out=(t, e1, e2))
    return t


def _activate_(z: torch.Tensor, activation: str | None, slope: float) -> torch.Tensor:
    """act(z) in place (relu and silu propagate NaN, as the kernels do)."""
    if activation == "relu":
        return z.relu_()
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu_(z, slope)
    if activation == "silu":
        return torch.nn.functional.silu(z, inplace=True)
    return z


def _act_backward(dy: torch.Tensor, t: torch.Tensor, activation: str, slope: float, is_result: bool) -> torch.Tensor:
    """``dy * act'(z)`` in one native pass, read from ``t``: ``z`` itself, or (``is_result``) ``y = act(z)``, whose
    sign gives act'(z) for relu and leaky_relu with a slope >= 0. These are the ops autograd records for relu,
    leaky_relu and silu (``threshold_backward``, ``leaky_relu_backward``, ``silu_backward``): same bits."""
    if activation == "relu":
        return _aten.threshold_backward(dy, t, 0)
    if activation == "leaky_relu":
        return _aten.leaky_relu_backward(dy, t, slope, is_result)
    return _aten.silu_backward(dy, t)


def _epilogue_grad(dy, x, xc, scale, shift, activation, slope, residual, output):
    """``dz = dy * act'(z)`` in ``xc``'s type, each step one native pass: from the output ``y`` where its sign gives
    act'(z), else from ``z = xc * scale + shift (+ residual)`` made again (a new buffer, then ``dz`` written over
    it). ``xc`` is ``x - hi`` in the arithmetic type, the type of ``dz`` (``None`` when the output gives act'(z):
    ``dz`` then has ``x``'s type); ``shift = bias - lo * scale``."""
    acc = xc.dtype if xc is not None else x.dtype
    dy = _to(dy, acc)
    if activation is None:
        return dy
    if output is not None:
        check_output_gives_grad(activation, slope)
        return _act_backward(dy, _to(output, acc), activation, slope, True)
    z = torch.empty_like(xc)
    if z.numel():  # native_batch_norm in eval mode with mean 0, var 1, eps 0 (as in _scale_shift_), into z
        zeros, ones, e1, e2 = _constants_for(x.shape[1], acc, x.device)
        torch.native_batch_norm(xc, scale, shift, zeros, ones, False, 0.0, 0.0, out=(z, e1, e2))
    if residual is not None:
        z.add_(residual)
    if activation == "relu":
        return _aten.threshold_backward.grad_input(dy, z, 0, grad_input=z)
    if activation == "leaky_relu":
        return _aten.leaky_relu_backward.grad_input(dy, z, slope, False, grad_input=z)
    return _aten.silu_backward.grad_input(dy, z, grad_input=z)


# Tensor.float and its siblings: the cast of .to(dtype) without its overload resolution (about 0.9 µs less a call,
# four calls in a 16-bit layer's training step)
_CASTS = {
    torch.float32: torch.Tensor.float,
    torch.float64: torch.Tensor.double,
    torch.bfloat16: torch.Tensor.bfloat16,
    torch.float16: torch.Tensor.half,
}


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (``t`` itself where it is of that type already)."""
    if t.dtype == dtype:
        return t
    cast = _CASTS.get(dtype)
    return t.to(dtype) if cast is None else cast(t)


def _subtract(x: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``x - hi`` per channel in the arithmetic type (``hi``'s), laid out like ``x``: one pass, one allocation
    (a 16-bit ``x``: a float32 copy, then the subtraction in place; torch's mixed-type subtraction is several times
    slower than the two on CPU).

    ``x - hi`` is exact wherever ``x`` lies within a factor 2 of ``hi`` (Sterbenz): what keeps fp32
    precision when ``|mean| >> std``, as in the kernels.
    """
    if x.dtype != hi.dtype:
        return x.to(hi.dtype).sub_(_per_channel(hi, x))
    return torch.sub(x, _per_channel(hi, x), out=torch.empty_like(x, dtype=hi.dtype))


def _in_layout_of(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` (a native kernel's output for ``x``) in ``x``'s layout: the native kernels keep contiguous and
    channels_last, and give other layouts (permuted, sliced) back contiguous."""
    return y if y.stride() == x.stride() else torch.empty_like(x).copy_(y)


def _as(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else _to(t, dtype)


def _epilogue(layer, y, residual, by_autograd):
    """``act(y + residual)`` over the local path's fresh output ``y``, in place: torch's own ops, each one native
    pass. Where autograd records them (``by_autograd``), leaky_relu with a negative slope and silu run out of
    place, as autograd needs their input ``z`` for backward (torch's in-place silu would save a copy of it)."""
    if residual is not None:
        y = y.add_(residual)  # native_batch_norm's backward does not read its output: autograd allows this
    activation, slope = layer.activation, layer.negative_slope
    if by_autograd and (activation == "silu" or (activation == "leaky_relu" and slope < 0)):
        return F.silu(y) if activation == "silu" else F.leaky_relu(y, slope)
    return _activate_(y, activation, slope)
