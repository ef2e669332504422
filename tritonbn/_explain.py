""":func:`explain`: which route each of a model's tritonbn BatchNorm layers takes on an example input, and why.

Is this layer synchronized, and on which path does it run? :func:`explain` answers it for every layer at once, from
one forward of a copy of the model: the route each call took (:mod:`tritonbn._core.route`; the table of routes is in
the design notes), the backend, the process group and whether the layer synchronizes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from tritonbn._core.dispatch import watching
from tritonbn.modules import SyncBatchNorm


@dataclass(frozen=True)
class LayerRoute:
    """One call of one layer in :func:`explain`'s forward.

    ``name``: the layer's qualified name in the model; ``kind``: its class; ``mode``: ``"train"`` or ``"eval"``;
    ``synchronizes``: whether the call's statistics are summed over other ranks; ``ranks``: how many ranks it
    synchronizes with (1: none); ``backend``: ``"triton"`` (the kernels), ``"torch"`` (the PyTorch backend) or
    ``"torch ops"`` (an export or ``torch.func`` lowering); ``route``: the route's name; ``reason``: why it was
    chosen.
    """

    name: str
    kind: str
    mode: str
    synchronizes: bool
    ranks: int
    backend: str
    route: str
    reason: str


class Explanation(list):
    """The :class:`LayerRoute` of every call :func:`explain` saw, in call order; ``str()`` gives them as a table."""

    def __str__(self) -> str:
        rows = [("layer", "class", "mode", "synchronizes", "backend", "route", "why")]
        for r in self:
            sync = f"yes ({r.ranks} ranks)" if r.synchronizes else "no"
            rows.append((r.name, r.kind, r.mode, sync, r.backend, r.route, r.reason))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1]
            for row in rows
        )


def _ranks(group) -> int:
    if group is None:
        return 1
    size = getattr(group, "size", None)
    return size() if callable(size) else 2  # tritonbn.join's relay: the world, at least two ranks


def _shared_groups(model: nn.Module) -> dict:
    """A ``copy.deepcopy`` memo under which the copy shares the model's process groups (which cannot be copied:
    a layer of a ``syncbn_group`` keeps its group in ``process_group``)."""
    if not dist.is_available():
        return {}
    return {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, dist.ProcessGroup)}


def explain(model: nn.Module, *example_args, **example_kwargs) -> Explanation:
    """The route every tritonbn BatchNorm layer of ``model`` takes on ``model(*example_args, **example_kwargs)``.

    Runs one forward of a deep copy of ``model`` (the model, its running statistics and its parameters are left as
    they are), in the model's mode and the current grad mode, and returns an ``Explanation``: a list with one
    ``LayerRoute`` per layer call, in call order, whose ``str()`` is a table. Each has the layer's qualified
    ``name``, its class (``kind``), its ``mode`` (``"train"`` or ``"eval"``), whether it ``synchronizes`` across
    ranks and with how many (``ranks``), the ``backend`` (``"triton"``, ``"torch"``, or ``"torch ops"`` for an
    export or ``torch.func`` lowering), the ``route`` (a row of the routes table in the design notes) and the
    ``reason`` it was chosen. A training-mode layer of a process group communicates in that forward as in any
    other: call it on every rank, as you call the model. Raises a ``ValueError`` for a model without a tritonbn
    BatchNorm.

    Example::

        print(tritonbn.explain(model, torch.randn(8, 3, 32, 32)))
    """
    if not any(isinstance(m, SyncBatchNorm) for m in model.modules()):
        raise ValueError(
            "tritonbn.explain: the model has no tritonbn BatchNorm layer; convert it first "
            "(tritonbn.convert_sync_batchnorm)"
        )
    copied = copy.deepcopy(model, _shared_groups(model))
    names = {id(m): name or "<root>" for name, m in copied.named_modules() if isinstance(m, SyncBatchNorm)}
    current: list[nn.Module] = []
    seen = Explanation()

    def pre_hook(module, args):
        current.append(module)

    def post_hook(module, args, output):
        current.pop()

    def watch(settings, route):
        if not current:  # a functional call outside the layers
            return
        module = current[-1]
        seen.append(
            LayerRoute(
                name=names.get(id(module), type(module).__name__),
                kind=type(module).__name__,
                mode="train" if module.training else "eval",
                synchronizes=settings.group is not None,
                ranks=_ranks(settings.group),
                backend=route.backend,
                route=route.name,
                reason=route.reason,
            )
        )

    handles = []
    for module in copied.modules():
        if isinstance(module, SyncBatchNorm):
            handles.append(module.register_forward_pre_hook(pre_hook))
            handles.append(module.register_forward_hook(post_hook))
    try:
        with watching(watch):
            copied(*example_args, **example_kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


__all__ = ["explain", "Explanation", "LayerRoute"]
