"""The four public launchers, written once for both backends, and the records a call's tensors travel in.

A backend implements four launchers with the tensors of a call in one record each (what the data path calls,
:mod:`tritonbn._core.passes`):

* ``stats(x, mask)`` -> ``stats``;
* ``elemt(options, operands, stats, save_stats)`` -> ``(y, mean, invstd)``;
* ``backward_reduce(options, grad_out, saved, weight_grad, bias_grad)`` -> ``(sums, grad_weight, grad_bias)``;
* ``backward_elemt(options, grad_out, saved, sums, count, input_grad, out_grad_residual)`` -> ``dx`` or ``None``.

``options`` is anything with ``momentum``, ``eps``, ``activation`` and ``negative_slope``: a layer's settings
(:class:`tritonbn._core.call.LayerSettings`) or an :class:`Options`. ``operands`` is an :class:`Operands`, ``saved``
a :class:`Saved`. :class:`Launchers` gives them the public signatures of :mod:`tritonbn.kernels`, for the Triton
backend there and for the PyTorch backend in :mod:`tritonbn.backends.torch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Operands:
    """The tensors of one call. ``sink``: the ``accumulate_stats`` buffer this call's global sums go to, in
    place of the running-statistics update (``None`` outside that block). ``mask``: masked BatchNorm's bool
    ``(N, *S)`` tensor, True at real positions (``None``: no mask)."""

    input: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    running_mean: torch.Tensor | None = None
    running_var: torch.Tensor | None = None
    num_batches_tracked: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    sink: torch.Tensor | None = None

    def tensors(self) -> tuple:
        """Every field, in order (``None`` where a tensor is not given)."""
        return (
            self.input,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.num_batches_tracked,
            self.residual,
            self.mask,
            self.sink,
        )

    def without_running_stats(self) -> Operands:
        """The same call, updating no running statistics (a forward inside backward: a checkpoint recompute)."""
        return Operands(self.input, self.weight, self.bias, None, None, None, self.residual, self.mask, self.sink)


@dataclass(slots=True)
class Saved:
    """What backward reads: the input, parameters, the statistics the forward used (``stats``: the global packed
    sums, ``None`` in eval), and what act'(z) is read from (``residual`` or ``output``, see
    :func:`tritonbn._core.call.kept`)."""

    x: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    mean: torch.Tensor
    invstd: torch.Tensor
    stats: torch.Tensor | None
    residual: torch.Tensor | None = None
    output: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(slots=True, frozen=True)
class Options:
    """The scalar arguments of a public launcher's call (a layer's settings carry the same four)."""

    momentum: float | None
    eps: float
    activation: str | None
    negative_slope: float


def check_elemt(operands: Operands, stats: torch.Tensor | None, momentum: float | None) -> None:
    """Raise where an elementwise call's arguments contradict each other (each backend's ``elemt`` asks)."""
    t = operands
    if stats is None and (t.running_mean is None or t.running_var is None):
        raise ValueError("batch_norm_elemt: eval mode (stats=None) needs running_mean and running_var")
    if momentum is None and stats is not None and t.running_mean is not None and t.num_batches_tracked is None:
        raise ValueError("batch_norm_elemt: momentum=None needs num_batches_tracked")


class Launchers:
    """One backend's four launchers under their public signatures: ``batch_norm_stats``, ``batch_norm_elemt``,
    ``batch_norm_backward_reduce`` and ``batch_norm_backward_elemt``, each over the backend's launcher of the same
    pass (``stats``, ``elemt``, ``backward_reduce``, ``backward_elemt``: see the module docstring).

    :mod:`tritonbn.kernels` exports them bound to the Triton backend, :mod:`tritonbn.backends.torch` to the
    PyTorch one, and :func:`tritonbn.backend.ops_for` gives the chosen backend's.
    """

    __slots__ = ("stats", "elemt", "backward_reduce", "backward_elemt")

    def __init__(self, stats: Callable, elemt: Callable, backward_reduce: Callable, backward_elemt: Callable) -> None:
        self.stats, self.elemt = stats, elemt
        self.backward_reduce, self.backward_elemt = backward_reduce, backward_elemt

    def batch_norm_stats(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Local per-channel statistics of ``x``, packed for one SUM all-reduce (one launch).

        Args:
            x: ``(N, C, *S)`` input of any rank >= 2, dtype fp32/fp16/bf16/fp64, any strides
                (contiguous, channels_last, permuted). ``N`` may be 0.
            mask: masked BatchNorm: a bool ``(N, *S)`` tensor, True at real positions (any strides). The
                sums and the count then cover the real positions only; what padded positions hold is never
                used.

        Returns:
            ``stats``: ``(2C + 1,)`` float64, ``[sum(x) (C) | sum(x^2) (C) | count]``, where ``count`` is
            the number of elements (real positions) per channel. Buffers from several ranks combine by summing;
            :func:`batch_norm_elemt` turns them into mean and var, and ``stats[-1:]`` is the count
            :func:`batch_norm_backward_elemt` takes.
        """
        return self.stats(x, mask)

    def batch_norm_elemt(
        self,
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
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Normalize ``x``, then add ``residual`` and apply ``activation``; in training, also update the running
        stats.

        Args:
            x: ``(N, C, *S)`` input, fp32/fp16/bf16/fp64, any strides.
            weight, bias: ``(C,)`` affine parameters, or ``None``.
            stats: the packed global sums ``(2C + 1,)`` fp64 from :func:`batch_norm_stats` (summed over
                ranks). Given: training mode, normalize with the batch statistics. ``None``: eval mode,
                normalize with ``running_mean`` / ``running_var``, which are then required.
            running_mean, running_var: ``(C,)`` buffers. In training they are updated in place
                (unbiased var), unless both are ``None``.
            num_batches_tracked: ``()`` int64 buffer, incremented in place in training when given.
                Required when ``momentum`` is ``None`` (cumulative moving average).
            momentum: the running-stat update factor, or ``None`` for a cumulative average.
            eps: added to the variance.
            residual: a tensor shaped like ``x`` (any strides) added after the affine transform, or ``None``.
            activation: ``None``, ``"relu"``, ``"leaky_relu"`` (with ``negative_slope``) or ``"silu"``,
                applied last.
            save_stats: return the statistics ``y`` was normalized with (what backward needs); ``False``
                skips them (inference).
            mask: masked BatchNorm: a bool ``(N, *S)`` tensor, True at real positions; ``y`` is 0 at the
                others (after the activation). ``stats`` then holds the real positions' sums and count.

        Returns:
            ``(y, mean, invstd)``: ``y`` like ``x`` (same dtype and memory format), ``mean`` ``(C,)``
            fp64 and ``invstd`` ``(C,)`` fp32 (fp64 for float64 ``x``), the statistics ``y`` was
            normalized with; both ``None`` when ``save_stats`` is false.
        """
        t = Operands(x, weight, bias, running_mean, running_var, num_batches_tracked, residual, mask)
        return self.elemt(Options(momentum, eps, activation, negative_slope), t, stats, save_stats)

    def batch_norm_backward_reduce(
        self,
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
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Local per-channel reductions for the backward pass.

        Args:
            grad_out: ``(N, C, *S)`` upstream gradient ``dy``, any strides (a stride-0 expanded
                gradient works).
            x: the forward input, any strides.
            mean, invstd: ``(C,)`` saved statistics from :func:`batch_norm_elemt`.
            weight: ``(C,)`` parameter or ``None``; gives the dtype of ``grad_weight``/``grad_bias``.
            weight_grad, bias_grad: whether to return ``grad_weight`` / ``grad_bias``.
            bias, activation, negative_slope, residual, output: for a forward with a fused activation,
                ``dy`` is taken at ``y = act(z)`` and the sums are over ``dz = dy * act'(z)``. ``act'`` is
                read from the sign of ``output`` (y) when given (relu, or leaky_relu with a slope >= 0),
                else from ``z = xhat * weight + bias (+ residual)`` recomputed from ``x``.
            mask: masked BatchNorm: a bool ``(N, *S)`` tensor, True at real positions; the sums cover those
                only (the forward's output is a constant 0 at the others).

        Returns:
            ``(sums, grad_weight, grad_bias)``: ``sums`` is ``(2, C)`` fp32 (fp64 for float64 ``x``) contiguous,
            ``[sum(dz) | sum(dz * xhat)]``, to be summed over ranks; ``grad_weight = sum(dz * xhat)``
            and ``grad_bias = sum(dz)`` are this rank's own, or ``None`` when not asked for.
        """
        saved = Saved(x, weight, bias, mean, invstd, None, residual, output, mask)
        options = Options(None, 0.0, activation, negative_slope)
        return self.backward_reduce(options, grad_out, saved, weight_grad, bias_grad)

    def batch_norm_backward_elemt(
        self,
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
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Input gradient of batch norm (and of a fused residual add and activation).

        Args:
            grad_out: ``(N, C, *S)`` upstream gradient, any strides.
            x: the forward input, any strides.
            mean, invstd: ``(C,)`` statistics the forward normalized with.
            weight: ``(C,)`` or ``None``.
            sums: ``(2, C)`` ``[sum_dz | sum_dz_xhat]`` summed over the ranks that shared the
                statistics (from :func:`batch_norm_backward_reduce` plus an all-reduce). ``None`` means
                the statistics were constants (eval): ``dx = dz * invstd * weight``.
            count: float64 tensor whose first element is the global element count per channel
                (``stats[-1:]`` of the forward's summed ``stats``); required with ``sums``.
            bias, activation, negative_slope, residual, output: the fused epilogue of the forward, as
                for :func:`batch_norm_backward_reduce`.
            input_grad: compute ``dx`` (else return ``None``, e.g. to fill only the residual's gradient).
            out_grad_residual: a tensor shaped like ``x`` to write the residual's gradient ``dz`` into.
            mask: masked BatchNorm: a bool ``(N, *S)`` tensor, True at real positions; both gradients are 0
                at the others, and ``count`` is the real positions' (from the masked forward's ``stats``).

        Returns:
            ``dx`` like ``x`` (same dtype and memory format), or ``None`` when ``input_grad`` is false.
        """
        if sums is not None and count is None:
            raise ValueError("batch_norm_backward_elemt: sums needs count")
        saved = Saved(x, weight, bias, mean, invstd, None, residual, output, mask)
        options = Options(None, 0.0, activation, negative_slope)
        return self.backward_elemt(options, grad_out, saved, sums, count, input_grad, out_grad_residual)
