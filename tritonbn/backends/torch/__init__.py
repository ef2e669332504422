"""The PyTorch backend: the same four launchers as :mod:`tritonbn.kernels`, with the same math, in torch's own ops.

It runs wherever PyTorch runs (CPU without the Triton interpreter, or a device Triton cannot target) and
keeps every result on the device (no host synchronization). Its files:

* :mod:`.plain`: the four launchers, unmasked (the module docstring says which native op each pass is, and
  why each step is exact enough);
* :mod:`.masked`: what they run for ``mask=`` (masked BatchNorm), around the unmasked ones;
* :mod:`.local`: the local path, a capability of this backend alone: a training layer that synchronizes
  with nobody makes the passes torch's own BatchNorm makes;
* :mod:`.steps`: the building blocks, each one native op or a few.

The launchers below route a call with a mask to :mod:`.masked`, and any other to :mod:`.plain`.
"""

from __future__ import annotations

from tritonbn.backends.torch import local, masked, plain


def batch_norm_stats(x, *, mask=None):
    """See :func:`tritonbn.kernels.batch_norm_stats`."""
    return plain.batch_norm_stats(x) if mask is None else masked.batch_norm_stats(x, mask=mask)


def batch_norm_elemt(x, weight, bias, *, mask=None, **kwargs):
    """See :func:`tritonbn.kernels.batch_norm_elemt`."""
    if mask is None:
        return plain.batch_norm_elemt(x, weight, bias, **kwargs)
    return masked.batch_norm_elemt(x, weight, bias, mask=mask, **kwargs)


def batch_norm_backward_reduce(grad_out, x, mean, invstd, weight=None, *, mask=None, **kwargs):
    """See :func:`tritonbn.kernels.batch_norm_backward_reduce`."""
    if mask is None:
        return plain.batch_norm_backward_reduce(grad_out, x, mean, invstd, weight, **kwargs)
    return masked.batch_norm_backward_reduce(grad_out, x, mean, invstd, weight, mask=mask, **kwargs)


def batch_norm_backward_elemt(grad_out, x, mean, invstd, weight=None, sums=None, count=None, *, mask=None, **kwargs):
    """See :func:`tritonbn.kernels.batch_norm_backward_elemt`."""
    if mask is None:
        return plain.batch_norm_backward_elemt(grad_out, x, mean, invstd, weight, sums, count, **kwargs)
    return masked.batch_norm_backward_elemt(grad_out, x, mean, invstd, weight, sums, count, mask=mask, **kwargs)


__all__ = ["batch_norm_stats", "batch_norm_elemt", "batch_norm_backward_reduce", "batch_norm_backward_elemt", "local"]
