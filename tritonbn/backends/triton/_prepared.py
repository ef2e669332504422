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
    """The Triton backend's four launchers (:mod:`tritonbn.backends.launchers`) for the calls of one layer that match
    one checked record, calls without a mask."""

    __slots__ = ("name", "local", "prepare", "generation", "_stats", "_elemt", "_reduce", "_elemt_backward", "like")

    def __init__(self) -> None:
        self.name, self.local, self.prepare = "triton", None, None  # what the passes read of a Backend
        self._forget()

    def _forget(self) -> None:
        """Start again with no launches found (at first, and after :func:`~tritonbn.backends.triton._plan.clear_caches`
        made those found stale)."""
        self.generation = _plan.generation
        self._stats = None
        self._elemt: dict = {}
        self._reduce: dict = {}
        self._elemt_backward: dict = {}
        # What the launchers allocate at each call (``"stats"``, ``"elemt"``: mean and invstd, ``"reduce"``: the sums
        # and a parameter's gradient), made once by the launchers' own allocators at the first call that needs them:
        # they allocate ``torch.empty_like`` of these (no sizes, dtype and device parsed; about 9 us less host time
        # per training forward+backward, in benchmarks/host_overhead.py, than ``torch.empty(..., dtype=, device=)``).
        self.like: dict = {}

    def stats(self, x, mask):
        if mask is not None:
            raise RuntimeError(_MASKED)
        if self.generation != _plan.generation:  # the plans were cleared: find the launches again
            self._forget()
        launch = self._stats
        if launch is None:
            launch = self._stats = statistics.find(x)
        like = self.like.get("stats")
        if like is None:
            like = self.like["stats"] = statistics.new_stats(x)
        return statistics.run(launch, x, None, like)

    def elemt(self, options, operands, stats, save_stats):
        t = operands
        if t.mask is not None:
            raise RuntimeError(_MASKED)
        if self.generation != _plan.generation:
            self._forget()
        mode = (None if stats is None else stats.dtype, t.running_mean is None, t.running_var is None)
        mode += (t.weight is None, t.num_batches_tracked is None, t.bias is None, t.residual is None, save_stats)
        mode += (options.momentum, options.eps, options.activation, options.negative_slope)
        launch = self._elemt.get(mode)
        if launch is None:
            launch = self._elemt[mode] = elemt.find(options, t, stats, save_stats, own=True)
        like = self.like.get("elemt")
        if like is None:
            like = self.like["elemt"] = elemt.new_saved(t.input)
        return elemt.run(launch, t, stats, save_stats, None, like)

    def _backward(self, options, grad_out, saved) -> tuple:
        """What both backward launchers start with: ``(aux, aux_kind)`` (:func:`aux_tensor`) and the part of their
        keys they share: the upstream gradient's strides and dtype, the parameters' dtypes and the epilogue."""
        s, slope = saved, options.negative_slope
        if s.mask is not None:
            raise RuntimeError(_MASKED)
        if self.generation != _plan.generation:
            self._forget()
        aux, aux_kind = aux_tensor(options.activation, s.residual, s.output, slope)
        weight, bias = s.weight, s.bias
        mode = (grad_out.stride(), grad_out.dtype, None if weight is None else weight.dtype)
        mode += (None if bias is None else bias.dtype, options.activation, slope, aux_kind)
        return aux, aux_kind, mode

    def backward_reduce(self, options, grad_out, saved, weight_grad, bias_grad):
        s = saved
        aux, aux_kind, mode = self._backward(options, grad_out, s)
        mode += (weight_grad, bias_grad)
        launch = self._reduce.get(mode)
        if launch is None:
            found = backward_reduce.find(options, grad_out, s, weight_grad, bias_grad, aux, aux_kind, own=True)
            launch = self._reduce[mode] = found
        like = self.like.get("reduce")
        if like is None:
            like = self.like["reduce"] = backward_reduce.new_sums(s.x), backward_reduce.new_param_grad(s.x, s.weight)
        return backward_reduce.run(launch, grad_out, s, weight_grad, bias_grad, aux, None, like)

    def backward_elemt(self, options, grad_out, saved, sums, count, input_grad, out_grad_residual):
        s, dr = saved, out_grad_residual
        aux, aux_kind, mode = self._backward(options, grad_out, s)
        mode += (sums is None, input_grad, dr is None)
        launch = self._elemt_backward.get(mode)
        if launch is None:
            found = backward_elemt.find(options, grad_out, s, sums, count, aux, aux_kind, input_grad, dr, own=True)
            launch = self._elemt_backward[mode] = found
        return backward_elemt.run(launch, grad_out, s, sums, count, aux, input_grad, dr)


def prepare(record) -> Prepared:
    """The :class:`Prepared` launchers of a checked call record (:class:`tritonbn._core.call.CallRecord`: kept in its
    ``launches``), made on first use."""
    prepared = record.launches
    if prepared is None:
        prepared = record.launches = Prepared()
    return prepared
