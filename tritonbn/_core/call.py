"""What one call carries: the layer's settings (built once per layer), its tensors, and what backward saves.

Records, so that the dispatch, the checks, the export lowering and the passes pass on one value each instead of a
dozen loose arguments:

* :class:`LayerSettings`: what a layer's calls need besides their tensors (whether they normalize with batch
  statistics, momentum, eps, epilogue, process groups, the layer's name in debug checks), built by
  :func:`settings_for` alone. The module builds it once and keeps it until one of its settings changes; the
  functional form builds one per call; the custom ops rebuild it from their flat schema.
* :class:`Operands`: the tensors of one call (input, parameters, running statistics, residual, mask, and
  the ``accumulate_stats`` sink), defined with the backends' launchers, which read it
  (:mod:`tritonbn.backends.launchers`).
* :class:`CallRecord`: what the layer's last eager call that passed the checks looked like, and the
  :class:`Route` chosen for calls like it in each context (:mod:`tritonbn._core.route`).
* :class:`Saved`: what the forward keeps for the backward (defined there too).

None of them is part of a module's state: ``SyncBatchNorm`` drops its settings (and so the record) from pickles and
copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tritonbn._compat import current_graph_task_id
from tritonbn.activations import output_gives_grad
from tritonbn.distributed import world


@dataclass(slots=True, kw_only=True)
class LayerSettings:
    """A layer's settings: what each call of the layer needs besides its tensors.

    ``batch_stats``: the call normalizes with the batch's statistics (training mode, or eval without running
    statistics); otherwise with the running statistics. ``group`` is what training synchronizes over (``None``:
    this rank alone; always ``None`` in eval), ``debug_group`` what ``TRITONBN_DEBUG=1`` checks signatures over,
    and ``name`` the layer's identity in those checks. ``world`` is the default process group the groups were
    resolved against, so that a module built before ``init_process_group`` resolves them again. ``record``: the
    last eager call that passed the checks (:func:`tritonbn._core.checks.check_eager_call`), ``None`` before one.
    """

    batch_stats: bool
    momentum: float | None
    eps: float
    activation: str | None
    negative_slope: float
    group: object
    debug_group: object
    name: str
    world: object
    record: CallRecord | None = None


def settings_for(
    training, momentum, eps, activation, negative_slope, group, *, debug_group, name="", batch_stats=False
) -> LayerSettings:
    """The one builder of :class:`LayerSettings` (the module's, once per layer; the functional form's and the
    custom ops', once per call), ``group`` and ``debug_group`` already resolved (``None``: nobody).

    ``training`` synchronizes the batch statistics over ``group``; ``batch_stats`` normalizes with the batch's
    own statistics in eval (a layer without running statistics), without synchronizing.
    """
    return LayerSettings(
        batch_stats=training or batch_stats,
        momentum=momentum,
        eps=eps,
        activation=activation,
        negative_slope=negative_slope,
        group=group if training else None,
        debug_group=debug_group,
        name=name,
        world=world(),
    )


@dataclass(slots=True, eq=False)
class CallRecord:
    """An eager call that passed the checks (:func:`tritonbn._core.checks.check_eager_call`): ``meta`` (its input's
    and residual's shapes, strides, dtypes and devices, the parameters' and buffers' shapes, dtypes and devices:
    :func:`~tritonbn._core.checks.call_meta`) and the very parameter and buffer tensors it had. A later call with the
    same tensors and the same ``meta`` repeats it, and needs neither the checks nor a new route.

    ``routes``: the :class:`Route` chosen for calls like it, keyed by the context that can change between such calls
    (:func:`tritonbn._core.route.context`). ``launches``: what a backend keeps for calls like it (the Triton
    backend's prepared launchers, :mod:`tritonbn.backends.triton._prepared`), ``None`` before the first.
    """

    meta: tuple
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    num_batches_tracked: torch.Tensor | None
    routes: dict
    launches: object = None


@dataclass(slots=True, frozen=True, eq=False)
class Route:
    """How a call runs, chosen by :func:`tritonbn._core.route.route_for` alone: ``name`` (one of the rows of the
    table in docs/design.md), ``backend`` (``"triton"``, ``"torch"``, or ``"torch ops"`` for the export and
    ``torch.func`` lowerings), ``reason`` (why this route, in words) and ``run``, ``(settings, operands) -> y``."""

    name: str
    backend: str
    reason: str
    run: Callable

    def __repr__(self) -> str:
        return f"<tritonbn route {self.name!r} ({self.backend}): {self.reason}>"


def stats_shape(C: int) -> tuple[int, ...]:
    """Shape of the packed forward statistics: ``[sum x (C) | sum x^2 (C) | count (1)]``."""
    return (2 * C + 1,)


def in_backward() -> bool:
    """Whether this forward runs inside a backward pass: an activation-checkpointing recompute."""
    return current_graph_task_id() != -1


def kept(y, residual, activation, negative_slope):
    """``(residual, output)``: what backward reads act'(z) from (see :mod:`tritonbn._core.passes`), or ``None``."""
    if activation is None or residual is None:
        return None, None
    if output_gives_grad(activation, negative_slope):
        return None, y
    return residual, None


def synchronizes_with_nobody(settings: LayerSettings, mask) -> bool:
    """Whether a call can take the PyTorch backend's local path: training with no process group, and no mask (a
    residual and an activation follow it there, in torch's own ops)."""
    return settings.batch_stats and settings.group is None and mask is None
