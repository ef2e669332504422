"""The one collective per pass, and process-group resolution."""

from __future__ import annotations

import torch
import torch.distributed as dist


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


def all_reduce_sum(buffer: torch.Tensor, group) -> torch.Tensor:
    """Sum ``buffer`` in place over ``group`` (no-op when ``group`` is ``None``)."""
    if group is not None:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    return buffer
