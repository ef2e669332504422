"""Pure-PyTorch backend: the same four launchers as :mod:`tritonbn.kernels`, with the same math.

It runs wherever PyTorch runs (CPU without the Triton interpreter, or a device Triton cannot target),
keeps every result on the device (no host synchronization), and uses the same shifted statistics,
fp64 sums and split fp64 mean as the kernels, so both backends agree to rounding.
"""

from __future__ import annotations

import torch

from tritonbn._numerics import compute_dtype
from tritonbn.activations import check_output_gives_grad


def _dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.reshape(1, -1, *([1] * (x.dim() - 2)))


def _activate(z: torch.Tensor, activation: str | None, slope: float) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(z)
    if activation == "leaky_relu":
        return torch.where(z > 0, z, z * slope)
    if activation == "silu":
        return z * torch.sigmoid(z)
    return z


def _grad_z(dy, xc, scale, bias, x, activation, slope, residual, output):
    """dz = dy * act'(z), z read from ``output`` (its sign) or recomputed; as the kernels do."""
    if activation is None:
        return dy
    if output is not None:
        check_output_gives_grad(activation, slope)
        z = output.to(xc.dtype)
    else:
        z = xc * _per_channel(scale, x) + (_per_channel(bias.to(xc.dtype), x) if bias is not None else 0.0)
        if residual is not None:
            z = z + residual.to(xc.dtype)
    if activation == "relu":
        return torch.where(z > 0, dy, torch.zeros_like(dy))
    if activation == "leaky_relu":
        return torch.where(z > 0, dy, dy * slope)
    s = torch.sigmoid(z)
    return dy * s * (1.0 + z * (1.0 - s))


def _acc(x: torch.Tensor) -> torch.dtype:
    """The arithmetic type for ``x``, as in the kernels."""
    return compute_dtype(x.dtype)


def _split_mean(mean64: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    hi = mean64.to(acc)
    return hi, (mean64 - hi.double()).to(acc)


def batch_norm_stats(x: torch.Tensor) -> torch.Tensor:
    """See :func:`tritonbn.kernels.batch_norm_stats`."""
    C = x.shape[1]
    n = x.numel() // C if C else 0
    stats = torch.zeros(2 * C + 1, dtype=torch.float64, device=x.device)
    stats[2 * C] = n
    if n == 0:
        return stats
    acc = _acc(x)
    shift = x[(0, slice(None)) + (0,) * (x.dim() - 2)].to(acc)
    var, mean = torch.var_mean(x.to(acc) - _per_channel(shift, x), dim=_dims(x), correction=0)
    mean64 = mean.double() + shift.double()
    stats[:C] = n * mean64
    stats[C : 2 * C] = var.double() * n + n * mean64 * mean64
    return stats


def _channel_stats(stats, running_mean, running_var):
    if stats is not None:
        C = (stats.numel() - 1) // 2
        s1, s2, n = stats[:C], stats[C : 2 * C], stats[2 * C]
        nn = n.clamp_min(1.0)
        mean = s1 / nn
        return mean, (s2 / nn - mean * mean).clamp_min(0.0), n
    # Copies: the saved mean is an output of its own, never the running buffer.
    return running_mean.to(torch.float64, copy=True), running_var.to(torch.float64, copy=True), None


def batch_norm_elemt(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    stats: torch.Tensor | None = None,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    num_batches_tracked: torch.Tensor | None = None,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    negative_slope: float = 0.01,
    save_stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """See :func:`tritonbn.kernels.batch_norm_elemt`."""
    training = stats is not None
    if not training and (running_mean is None or running_var is None):
        raise ValueError("batch_norm_elemt: eval mode (stats=None) needs running_mean and running_var")
    if momentum is None and training and running_mean is not None and num_batches_tracked is None:
        raise ValueError("batch_norm_elemt: momentum=None needs num_batches_tracked")
    acc = _acc(x)
    mean64, var64, n = _channel_stats(stats, running_mean, running_var)
    invstd = torch.rsqrt(var64 + eps).to(acc)
    if training and running_mean is not None:
        keep = n > 0  # every rank empty: leave the running stats alone
        if momentum is None:
            factor = 1.0 / (num_batches_tracked + 1).double()
        else:
            factor = float(momentum)
        unbiased = var64 * n / (n - 1.0).clamp_min(1.0)
        new_mean = running_mean.double() * (1.0 - factor) + mean64 * factor
        new_var = running_var.double() * (1.0 - factor) + unbiased * factor
        running_mean.copy_(torch.where(keep, new_mean, running_mean.double()))
        running_var.copy_(torch.where(keep, new_var, running_var.double()))
        if num_batches_tracked is not None:
            num_batches_tracked.add_(keep.reshape(num_batches_tracked.shape).long())
    hi, lo = _split_mean(mean64, acc)
    scale = invstd * weight.to(acc) if weight is not None else invstd
    xc = (x.to(acc) - _per_channel(hi, x)) - _per_channel(lo, x)
    y = xc * _per_channel(scale, x)
    if bias is not None:
        y = y + _per_channel(bias.to(acc), x)
    if residual is not None:
        y = y + residual.to(acc)
    out = torch.empty_like(x)
    out.copy_(_activate(y, activation, negative_slope))
    if not save_stats:
        return out, None, None
    return out, mean64, invstd


def batch_norm_backward_reduce(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    weight_grad: bool = True,
    bias_grad: bool = True,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    negative_slope: float = 0.01,
    residual: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """See :func:`tritonbn.kernels.batch_norm_backward_reduce`."""
    acc = _acc(x)
    hi, lo = _split_mean(mean, acc)
    xc = (x.to(acc) - _per_channel(hi, x)) - _per_channel(lo, x)
    invstd = invstd.to(acc)
    scale = invstd * weight.to(acc) if weight is not None else invstd
    dy = _grad_z(grad_out.to(acc), xc, scale, bias, x, activation, negative_slope, residual, output)
    dims = _dims(x)
    sums = torch.stack([dy.sum(dims), (dy * xc).sum(dims) * invstd])
    gdtype = weight.dtype if weight is not None else acc
    grad_weight = sums[1].to(gdtype, copy=True) if weight_grad else None
    grad_bias = sums[0].to(gdtype, copy=True) if bias_grad else None
    return sums, grad_weight, grad_bias


def batch_norm_backward_elemt(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    negative_slope: float = 0.01,
    residual: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    input_grad: bool = True,
    out_grad_residual: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """See :func:`tritonbn.kernels.batch_norm_backward_elemt`."""
    if sums is not None and count is None:
        raise ValueError("batch_norm_backward_elemt: sums needs count")
    acc = _acc(x)
    invstd = invstd.to(acc)
    scale = invstd * weight.to(acc) if weight is not None else invstd
    hi, lo = _split_mean(mean, acc)
    xc = (x.to(acc) - _per_channel(hi, x)) - _per_channel(lo, x)
    dz = _grad_z(grad_out.to(acc), xc, scale, bias, x, activation, negative_slope, residual, output)
    if out_grad_residual is not None:
        out_grad_residual.copy_(dz)
    if not input_grad:
        return None
    if sums is not None:
        inv_n = 1.0 / count.reshape(-1)[0].clamp_min(1.0).to(acc)
        dz = dz - _per_channel(sums[0] * inv_n, x) - xc * _per_channel(sums[1] * inv_n * invstd, x)
    out = torch.empty_like(x)
    out.copy_(dz * _per_channel(scale, x))
    return out
