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

The routes of a record (:mod:`tritonbn._core.route`) hand a :class:`Prepared` to the passes in place of the backend,
for the calls that repeat the record (no mask, no ``accumulate_stats`` sink: those are checked anew at each call and
have no record), and the eager Function keeps it for that call's backward, whose saved input and statistics are the
forward's. Clearing the plans
(:func:`tritonbn.backends.triton._plan.clear_caches`) makes what a :class:`Prepared` found stale: its next call finds
its launches again.

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

# A masked call has no record (it is checked at each call), so its launches are never prepared.
_MASKED = "tritonbn: a masked call reached the launchers prepared for a call record; please report this"


class Prepared:
    """The Triton backend's four launchers for the calls of one layer that match one checked record: the public
    launchers' signatures, for calls without a mask."""

    __slots__ = ("name", "local", "prepare", "generation", "stats", "elemt", "reduce", "elemt_backward", "like")

    def __init__(self) -> None:
        self.name, self.local, self.prepare = "triton", None, None  # what the passes read of a Backend
        self._forget()

    def _forget(self) -> None:
        """Start again with no launches found (at first, and after :func:`~tritonbn.backends.triton._plan.clear_caches`
        made those found stale)."""
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
            raise RuntimeError(_MASKED)
        if self.generation != _plan.generation:  # the plans were cleared: find the launches again
            self._forget()
        launch = self.stats
        if launch is None:
            launch = self.stats = statistics.find(x)
        like = self.like.get("stats")
        if like is None:
            like = self.like["stats"] = statistics.new_stats(x)
        return statistics.run(launch, x, None, like)

    def batch_norm_elemt(
        self,
        x,
        weight,
        bias,
        *,
        stats=None,
        running_mean=None,
        running_var=None,
        num_batches_tracked=None,
        momentum=0.1,
        eps=1e-5,
        residual=None,
        activation=None,
        negative_slope=0.01,
        save_stats=True,
        mask=None,
    ):
        if mask is not None:
            raise RuntimeError(_MASKED)
        args = (x, weight, bias, stats, running_mean, running_var, num_batches_tracked)
        if self.generation != _plan.generation:
            self._forget()
        mode = (None if stats is None else stats.dtype, running_mean is None, running_var is None, weight is None)
        mode += (num_batches_tracked is None, bias is None, residual is None, save_stats, momentum, eps, activation)
        mode += (negative_slope,)
        launch = self.elemt.get(mode)
        if launch is None:
            launch = self.elemt[mode] = elemt.find(
                *args, momentum, eps, residual, activation, negative_slope, save_stats, own=True
            )
        like = self.like.get("elemt")
        if like is None:
            like = self.like["elemt"] = elemt.new_saved(x)
        return elemt.run(launch, *args, residual, save_stats, None, like)

    def batch_norm_backward_reduce(
        self,
        grad_out,
        x,
        mean,
        invstd,
        weight=None,
        *,
        weight_grad=True,
        bias_grad=True,
        bias=None,
        activation=None,
        negative_slope=0.01,
        residual=None,
        output=None,
        mask=None,
    ):
        if mask is not None:
            raise RuntimeError(_MASKED)
        if self.generation != _plan.generation:
            self._forget()
        aux, aux_kind = aux_tensor(activation, residual, output, negative_slope)
        mode = (grad_out.stride(), grad_out.dtype, None if weight is None else weight.dtype, weight_grad, bias_grad)
        mode += (None if bias is None else bias.dtype, activation, negative_slope, aux_kind)
        args = (grad_out, x, mean, invstd, weight, bias, weight_grad, bias_grad)
        launch = self.reduce.get(mode)
        if launch is None:
            launch = self.reduce[mode] = backward_reduce.find(
                *args, activation, negative_slope, aux, aux_kind, own=True
            )
        like = self.like.get("reduce")
        if like is None:
            like = self.like["reduce"] = backward_reduce.new_sums(x), backward_reduce.new_param_grad(x, weight)
        return backward_reduce.run(launch, *args, aux, None, like)

    def batch_norm_backward_elemt(
        self,
        grad_out,
        x,
        mean,
        invstd,
        weight=None,
        sums=None,
        count=None,
        *,
        bias=None,
        activation=None,
        negative_slope=0.01,
        residual=None,
        output=None,
        input_grad=True,
        out_grad_residual=None,
        mask=None,
    ):
        if mask is not None:
            raise RuntimeError(_MASKED)
        dr = out_grad_residual
        if self.generation != _plan.generation:
            self._forget()
        aux, aux_kind = aux_tensor(activation, residual, output, negative_slope)
        mode = (grad_out.stride(), grad_out.dtype, None if weight is None else weight.dtype, sums is None, input_grad)
        mode += (None if bias is None else bias.dtype, dr is None, activation, negative_slope, aux_kind)
        args = (grad_out, x, mean, invstd, weight, bias, sums, count)
        launch = self.elemt_backward.get(mode)
        if launch is None:
            launch = self.elemt_backward[mode] = backward_elemt.find(
                *args, activation, negative_slope, aux, aux_kind, input_grad, dr, own=True
            )
        return backward_elemt.run(launch, *args, aux, input_grad, dr)


def prepare(record) -> Prepared:
    """The :class:`Prepared` launchers of a checked call record (:class:`tritonbn._core.call.CallRecord`: kept in its
    ``launches``), made on first use."""
    prepared = record.launches
    if prepared is None:
        prepared = record.launches = Prepared()
    return prepared
