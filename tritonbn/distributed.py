"""The one collective per pass, and process-group resolution (the debug signature check: :mod:`tritonbn._signature`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonbn._compat import default_group


def resolve_group(process_group=None):
    """The group to synchronize over, or ``None`` when nothing needs to communicate.

    ``None`` means the default (world) group. Nothing communicates when ``torch.distributed`` is
    unavailable or uninitialized, or when the group has a single member.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) <= 1:
        return None
    return group


# The default process group (None before init_process_group): groups resolved against it stay valid.
world = default_group


class Relay:
    """A group that sums in its own way: a layer's collectives inside :func:`tritonbn.join` (``tritonbn/uneven.py``)."""

    def all_reduce_sum(self, buffer: torch.Tensor) -> None:
        raise NotImplementedError


def all_reduce_sum(buffer: torch.Tensor, group) -> torch.Tensor:
    """Sum ``buffer`` in place over ``group`` (no-op when ``group`` is ``None``)."""
    if group is not None:
        if isinstance(group, Relay):
            group.all_reduce_sum(buffer)
        else:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    return buffer


def collective_device(group) -> torch.device:
    """Where a small host-made tensor must live for a collective on ``group`` (CUDA for NCCL)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
