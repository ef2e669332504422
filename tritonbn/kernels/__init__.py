"""Triton kernels for batch normalization, and their launchers.

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
"""

from tritonbn.kernels._plan import Plan, plan
from tritonbn.kernels.backward_elemt import batch_norm_backward_elemt
from tritonbn.kernels.backward_reduce import batch_norm_backward_reduce
from tritonbn.kernels.elemt import batch_norm_elemt
from tritonbn.kernels.stats import batch_norm_stats

# The kernels have no local path (the PyTorch backend's tritonbn/_torch_local.py): every call packs its statistics.
local_forward = local_backward = local_autograd = None

__all__ = [
    "Plan",
    "plan",
    "batch_norm_stats",
    "batch_norm_elemt",
    "batch_norm_backward_reduce",
    "batch_norm_backward_elemt",
]
