"""Triton kernels for batch normalization, and their launchers, for your own layers.

Each launcher takes and returns plain tensors, and accepts inputs ``(N, C, *S)`` of rank 2 to 5
with any strides (contiguous, channels_last, channels_last_3d, permuted) without copying them.
A training step is::

    stats = batch_norm_stats(x)                      # (2C + 1,) fp64 [sum_x | sum_x2 | count]
    dist.all_reduce(stats)                           # the one forward collective (if any)
    y, mean, invstd = batch_norm_elemt(x, w, b, stats=stats, running_mean=rm, running_var=rv)
    ...
    sums, gw, gb = batch_norm_backward_reduce(dy, x, mean, invstd, w)
    dist.all_reduce(sums)                            # the one backward collective (if any)
    dx = batch_norm_backward_elemt(dy, x, mean, invstd, w, sums, stats[-1:])

Each launcher is one kernel launch: a training forward takes 2 (stats, elemt), a backward 2
(reduce, elemt), eval 1 (elemt with the running statistics). The reductions finish in the same
launch: the program that draws the last ticket merges every program's partials in a fixed order.

``batch_norm_elemt`` also fuses ``act(bn(x) + residual)`` (``residual=``, ``activation=`` of
``"relu"``, ``"leaky_relu"``, ``"silu"``); the backward launchers then take the same epilogue
arguments and compute ``dz = dy * act'(z)`` on the fly, and ``batch_norm_backward_elemt`` writes
the residual's gradient into ``out_grad_residual``.

The kernels live in :mod:`tritonbn.backends.triton`, one of the two backends behind
:func:`tritonbn.backend.ops_for`; this is their public import path, with each pass's module
(``tritonbn.kernels.stats``, ``.elemt``, ``.backward_reduce``, ``.backward_elemt``) and the helper
modules of earlier releases kept importable under it. The four launchers are the methods of
:class:`Launchers` (where their arguments are documented), bound to the Triton backend; the PyTorch
backend's (:mod:`tritonbn.backends.torch`) are the same methods over its own launchers.
"""

import sys

from tritonbn.backends import triton as _triton_backend
from tritonbn.backends.launchers import Launchers
from tritonbn.backends.triton import (  # noqa: F401 - re-exported (__all__ is the backend's)
    Plan,
    _common,
    _launch,
    _plan,
    _tiles,
    _workspace,
    backward_elemt,
    backward_reduce,
    batch_norm_backward_elemt,
    batch_norm_backward_reduce,
    batch_norm_elemt,
    batch_norm_stats,
    elemt,
    plan,
    stats,
)

# ``import tritonbn.kernels.stats`` (and the rest) gives the very module of the backend, not a copy.
for _module in (_common, _launch, _plan, _tiles, _workspace, backward_elemt, backward_reduce, elemt, stats):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module
del _module

__all__ = [*_triton_backend.__all__, "Launchers"]
