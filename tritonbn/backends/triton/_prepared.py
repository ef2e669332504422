"""The launches of one layer's eager calls, found once: the Triton backend as those calls see it.

Each launcher finds its launch in a cache keyed by everything the launch depends on (the input's shape,
strides, dtype and device, every other tensor's dtype, the flags): about twenty tensor attributes read and hashed
per training step, the largest part of the launchers' host cost (``benchmarks/host_overhead.py``). An eager call of a
module reads most of them anyway, in :func:`tritonbn._core.checks.check_eager_call`, which remembers the last call
that passed the checks (its input's shape, strides, dtype and device, its residual's, and the very same parameter
and buffer tensors, with their shapes, dtypes and devices). A :class:`Prepared` belongs to that record: its
launchers are those of the backend, for calls that look like it, and keep the launch each found for the rest of
what it depends on (the mode: training or eval, running statistics or not, saving statistics or not; in backward
the upstream gradient's strides and dtype and which gradients are asked for), so the next call looks up a few
flags instead.

The dispatch hands a :class:`Prepared` to the passes in place of the backend only for a call that
``check_eager_call`` just matched against its record (no mask, no ``accumulate_stats`` sink: those are checked
anew at each call), and the eager Function keeps it for that call's backward, whose saved input and statistics
are the forward's. A launcher given a mask goes through the backend's own launcher. Clearing the plans
(:func:`tritonbn.backends.triton._plan.clear_caches`) makes every :class:`Prepared` stale.

Only the passes call these launchers, with their own statistics: ``stats`` from
:func:`~tritonbn.backends.triton.stats.batch_norm_stats` (or a recompute's copy of it), ``mean`` and ``invstd`` (and
``y``, an ``output`` backward reads) from the forward's :func:`~tritonbn.backends.triton.elemt.batch_norm_elemt`, the
backward's ``sums`` and the residual's gradient buffer, and ``count``, ``stats[-1:]``, ``16 C`` bytes into ``stats``:
fresh allocations, which the allocator aligns to 16 bytes and more. Their launches (``own=True``) read the alignment
of the call's other tensors only (the input, the gradient, the parameters and buffers, the residual), which
``tests/helpers/launch_check.py`` misaligns in turn.
"""

from __future__ import annotations

from tritonbn.backends.triton import _plan, backward_elemt, backward_reduce, elemt
from tritonbn.backends.triton import stats as statistics
from tritonbn.backends.triton.backward_reduce import aux_tensor


class Prepared:
    """The Triton backend's four launchers for the calls of one layer that match one checked record."""

    __slots__ = ("name", "local", "prepare", "generation", "stats", "elemt", "reduce", "elemt_backward", "like")

    def __init__(self) -> None:
        self.name, self.local, self.prepare = "triton", None, None  # what the passes read of a Backend
        self.generation = _plan.generation
        self.stats = None
        self.elemt: dict = {}
        self.reduce: dict = {}
        self.elemt_backward: dict = {}
        # What the launchers allocate at each call (``"stats"``, ``"elemt"``: mean and invstd, ``"reduce"``: the sums
        # and a parameter's gradient), made once by the launchers' own allocators at the first call that needs them:
        # they allocate ``torch.empty_like`` of these (no sizes, dtype and device parsed; about 9 us less host time
        # per training forward+backward, in benchmarks/host_overhead.py, than ``torch.empty(..., dtype=, device=)``).
        self.like: dict = {}

    def batch_norm_stats(self, x, *, mask=None):
        if mask is not None:
            return statistics.batch_norm_stats(x, mask=mask)
        launch = self.stats
        if launch is None:
            launch = self.stats = statistics.find(x)
        like = self.like.get("stats")
        if like is None:
            like = self.like["stats"] = statistics.new_stats(x)
        return statistics.run(launch, x, None, like)

    def batch_norm_elemt(self, x, weight, bias, *, stats=None, running_mean=None, running_var=None,
                         num_batches_tracked=None, momentum=0.1, eps=1e-5, residual=None, activation=None,
                         negative_slope=0.01, save_stats=True, mask=None):  # fmt: skip
        args = (x, weight, bias, stats, running_mean, running_var, num_batches_tracked)
        if mask is not None:
            return elemt.batch_norm_elemt(*args[:3], stats=stats, running_mean=running_mean, running_var=running_var,
                                          num_batches_tracked=num_batches_tracked, momentum=momentum, eps=eps,
                                          residual=residual, activation=activation, negative_slope=negative_slope,
                                          save_stats=save_stats, mask=mask)  # fmt: skip
        mode = (
            None if stats is None else stats.dtype, running_mean is None, running_var is None,
            num_batches_tracked is None, weight is None, bias is None, residual is None, save_stats, momentum, eps,
            activation, negative_slope,
        )  # fmt: skip
        launch = self.elemt.get(mode)
        if launch is None:
            launch = self.elemt[mode] = elemt.find(*args, momentum, eps, residual, activation, negative_slope,
                                                   save_stats, own=True)  # fmt: skip
        like = self.like.get("elemt")
        if like is None:
            like = self.like["elemt"] = elemt.new_saved(x)
        return elemt.run(launch, *args, residual, save_stats, None, like)

    def batch_norm_backward_reduce(self, grad_out, x, mean, invstd, weight=None, *, weight_grad=True, bias_grad=True,
                                   bias=None, activation=None, negative_slope=0.01, residual=None, output=None,
                                   mask=None):  # fmt: skip
        if mask is not None:
            return backward_reduce.batch_norm_backward_reduce(
                grad_out, x, mean, invstd, weight, weight_grad=weight_grad, bias_grad=bias_grad, bias=bias,
                activation=activation, negative_slope=negative_slope, residual=residual, output=output, mask=mask,
            )  # fmt: skip
        aux, aux_kind = aux_tensor(activation, residual, output, negative_slope)
        mode = (
            grad_out.stride(), grad_out.dtype, None if weight is None else weight.dtype,
            None if bias is None else bias.dtype, weight_grad, bias_grad, activation, negative_slope, aux_kind,
        )  # fmt: skip
        args = (grad_out, x, mean, invstd, weight, bias, weight_grad, bias_grad)
        launch = self.reduce.get(mode)
        if launch is None:
            launch = self.reduce[mode] = backward_reduce.find(*args, activation, negative_slope, aux, aux_kind,
                                                              own=True)  # fmt: skip
        like = self.like.get("reduce")
        if like is None:
            like = self.like["reduce"] = backward_reduce.new_sums(x), backward_reduce.new_param_grad(x, weight)
        return backward_reduce.run(launch, *args, aux, None, like)

    def batch_norm_backward_elemt(self, grad_out, x, mean, invstd, weight=None, sums=None, count=None, *, bias=None,
                                  activation=None, negative_slope=0.01, residual=None, output=None, input_grad=True,
                                  out_grad_residual=None, mask=None):  # fmt: skip
        dr = out_grad_residual
        if mask is not None or (sums is not None and count is None) or not (input_grad or dr is not None):
            return backward_elemt.batch_norm_backward_elemt(
                grad_out, x, mean, invstd, weight, sums, count, bias=bias, activation=activation,
                negative_slope=negative_slope, residual=residual, output=output, input_grad=input_grad,
                out_grad_residual=dr, mask=mask,
            )  # fmt: skip
        aux, aux_kind = aux_tensor(activation, residual, output, negative_slope)
        mode = (
            grad_out.stride(), grad_out.dtype, None if weight is None else weight.dtype,
            None if bias is None else bias.dtype, sums is None, input_grad, dr is None, activation, negative_slope,
            aux_kind,
        )  # fmt: skip
        args = (grad_out, x, mean, invstd, weight, bias, sums, count)
        launch = self.elemt_backward.get(mode)
        if launch is None:
            launch = self.elemt_backward[mode] = backward_elemt.find(*args, activation, negative_slope, aux, aux_kind,
                                                                     input_grad, dr, own=True)  # fmt: skip
        return backward_elemt.run(launch, *args, aux, input_grad, dr)


def prepare(kept: dict) -> Prepared:
    """The :class:`Prepared` of a checked record (``kept``: what the backends keep with it), made on first use."""
    prepared = kept.get("triton")
    if prepared is None or prepared.generation != _plan.generation:
        prepared = kept["triton"] = Prepared()
    return prepared
