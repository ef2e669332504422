"""Node-local BatchNorm groups: synchronize the statistics within groups of consecutive ranks.

At scale the collectives, not the kernels, decide what synchronized BatchNorm costs: a world-wide
all-reduce crosses the network on every layer, twice per step. MLPerf submissions, apex
(``create_syncbn_process_group``), Flax (``axis_index_groups``) and ClassyVision instead synchronize
within small groups inside one node. :func:`syncbn_group` builds those groups::

    model = tritonbn.convert_sync_batchnorm(model, group_size=8)   # one group per 8-GPU node

The running statistics are then equal within a group and differ between groups, by design;
:func:`tritonbn.sync_running_stats` pools them over the world before evaluating or saving.
"""

from __future__ import annotations

import torch.distributed as dist

from tritonbn.distributed import world as default_group

# group_size -> (the default group the subgroups were made from, this rank's subgroup)
_cache: dict[int, tuple[object, object]] = {}


def check_group_size(group_size, world: int) -> None:
    """Raise the error every rank raises alike when ``group_size`` cannot split ``world`` ranks into groups."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"tritonbn: group_size must be a positive int or None, got {group_size!r}")
    if group_size < 1:
        raise ValueError(f"tritonbn: group_size must be a positive int or None, got {group_size}")
    if world % group_size:
        alone = ""
        if default_group() is None:
            alone = " (torch.distributed is not initialized: the world is this process)"
        raise ValueError(
            f"tritonbn: group_size {group_size} does not divide the world size {world}{alone}; BatchNorm groups are "
            f"{group_size} consecutive ranks each, so the world size must be a multiple of {group_size}"
        )


def syncbn_group(group_size: int | None = None):
    """This rank's BatchNorm group: ``group_size`` consecutive ranks (``0..k-1``, ``k..2k-1``, ...).

    Pass the result as ``process_group`` to :class:`tritonbn.SyncBatchNorm`, or give ``group_size``
    to :func:`tritonbn.convert_sync_batchnorm`. ``None`` means the world (the default group, or
    ``None`` when torch.distributed is not initialized); ``1`` means no synchronization at all:
    local BatchNorm, still with tritonbn's kernels.

    A collective the first time for each size: every rank must call it, with the same
    ``group_size``. Every rank creates every group, in the same order
    (``torch.distributed.new_subgroups``), as process-group creation requires; the groups are
    cached per world and size, so later calls return the same object and communicate nothing.
    ``group_size`` must divide the world size; otherwise every rank raises the same
    ``ValueError``, before any communication.
    """
    world_group = default_group()
    world = dist.get_world_size() if world_group is not None else 1
    if group_size is None:
        return world_group
    check_group_size(group_size, world)
    if world_group is None:
        return None  # one process: group_size is 1, nothing to synchronize
    if group_size == world:
        return world_group
    cached = _cache.get(group_size)
    if cached is None or cached[0] is not world_group:  # first call, or a new world since
        group, _ = dist.new_subgroups(group_size=group_size)
        cached = _cache[group_size] = (world_group, group)
    return cached[1]


def group_size_of(group) -> int | None:
    """The ``group_size`` that :func:`syncbn_group` built ``group`` for (the world size for the world
    group and for ``None``), or ``None`` for another process group.
    """
    world_group = default_group()
    if world_group is None:
        return None
    if group is None or group is world_group:
        return dist.get_world_size()
    for size, (made_from, made) in _cache.items():
        if made is group and made_from is world_group:
            return size
    return None


def group_ranks(group_size: int, world: int) -> list[list[int]]:
    """The global ranks of every BatchNorm group of ``group_size``, in order."""
    return [list(range(start, start + group_size)) for start in range(0, world, group_size)]
