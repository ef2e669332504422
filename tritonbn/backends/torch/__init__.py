"""The PyTorch backend: the same four launchers as :mod:`tritonbn.kernels`, with the same math, in torch's own ops.

It runs wherever PyTorch runs (CPU without the Triton interpreter, or a device Triton cannot target) and
keeps every result on the device (no host synchronization). Its files:

* :mod:`.plain`: the four launchers, unmasked (the module docstring says which native op each pass is, and
  why each step is exact enough);
* :mod:`.masked`: what they run for ``mask=`` (masked BatchNorm), around the unmasked ones;
* :mod:`.local`: the local path, a capability of this backend alone: a training layer that synchronizes
  with nobody makes the passes torch's own BatchNorm makes;
* :mod:`.steps`: the building blocks, each one native op or a few.

The launchers below (:mod:`tritonbn.backends.launchers`) route a call with a mask to :mod:`.masked`, and any other
to :mod:`.plain`.
"""

from __future__ import annotations

from tritonbn.backends.launchers import Launchers
from tritonbn.backends.torch import local, masked, plain


def stats(x, mask):
    return plain.batch_norm_stats(x) if mask is None else masked.batch_norm_stats(x, mask)


def elemt(options, operands, stats, save_stats):
    return (plain if operands.mask is None else masked).elemt(options, operands, stats, save_stats)


def backward_reduce(options, grad_out, saved, weight_grad, bias_grad):
    return (plain if saved.mask is None else masked).backward_reduce(options, grad_out, saved, weight_grad, bias_grad)


def backward_elemt(options, grad_out, saved, sums, count, input_grad, out_grad_residual):
    module = plain if saved.mask is None else masked
    return module.backward_elemt(options, grad_out, saved, sums, count, input_grad, out_grad_residual)


launchers = Launchers(stats, elemt, backward_reduce, backward_elemt)
batch_norm_stats = launchers.batch_norm_stats
batch_norm_elemt = launchers.batch_norm_elemt
batch_norm_backward_reduce = launchers.batch_norm_backward_reduce
batch_norm_backward_elemt = launchers.batch_norm_backward_elemt

__all__ = ["batch_norm_stats", "batch_norm_elemt", "batch_norm_backward_reduce", "batch_norm_backward_elemt", "local"]
