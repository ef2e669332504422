"""Find, confirm and repair BatchNorm statistics that drift apart across ranks.

Under DDP with plain BatchNorm each rank normalizes with, and accumulates running statistics of,
its own batches only. The ranks' running statistics drift apart, their eval outputs differ, and the
checkpoint that ships is whichever rank saved it. This module tells you whether that happened and
repairs it:

* :func:`find_unsynced_batchnorm`: which BatchNorm modules will not synchronize (no communication).
* :func:`check_bn_sync`: a collective comparing every BatchNorm's buffers and settings across ranks
  (within each BatchNorm group when the model synchronizes in groups, :func:`tritonbn.syncbn_group`).
* :func:`tritonbn.sync_running_stats`: pool the running statistics of all ranks (the quick repair, and
  the end-of-training step when BatchNorm synchronizes in groups).
* :func:`tritonbn.recalibrate_batchnorm`: recompute them exactly on given batches ("precise BN").
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from tritonbn._signature import check_signature, debug_enabled
from tritonbn.distributed import collective_device, resolve_group
from tritonbn.groups import group_ranks, group_size_of, syncbn_group
from tritonbn.modules import SyncBatchNorm

# A layer is in sync when, per channel, max - min across ranks <= ATOL + RTOL * max(|max|, |min|).
ATOL = 1e-6
RTOL = 1e-5

_SETTINGS = ("momentum", "eps", "affine", "track_running_stats")  # compared across ranks, in this order

_warned_unsynced = False


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` (or ``DataParallel``) wrapper."""
    while isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        model = model.module
    return model


def batchnorm_modules(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """Qualified names and modules of every BatchNorm-like module, in ``named_modules`` order."""
    return [(name, m) for name, m in unwrap(model).named_modules() if isinstance(m, _BatchNorm)]


def find_unsynced_batchnorm(model: nn.Module) -> list[str]:
    """Qualified names of the BatchNorm modules whose statistics are not synchronized across ranks.

    That is every ``_BatchNorm`` that is neither ``tritonbn.SyncBatchNorm`` nor
    ``torch.nn.SyncBatchNorm``. When ``model`` is DDP-wrapped and holds any, a warning naming the fix
    is issued once per process.
    """
    names = [name for name, m in batchnorm_modules(model) if not isinstance(m, SyncBatchNorm | nn.SyncBatchNorm)]
    global _warned_unsynced
    if names and isinstance(model, nn.parallel.DistributedDataParallel) and not _warned_unsynced:
        _warned_unsynced = True
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        warnings.warn(
            f"DDP model holds {len(names)} plain BatchNorm module(s) ({shown}) whose statistics differ across "
            "ranks. Fix: model = tritonbn.convert_sync_batchnorm(model) before wrapping it in DDP; repair a "
            "trained model with tritonbn.sync_running_stats(model) or tritonbn.recalibrate_batchnorm(model, batches).",
            UserWarning,
            stacklevel=2,
        )
    return names


@dataclass
class LayerRecord:
    """How one BatchNorm layer differs across ranks (or checkpoints)."""

    name: str
    mean_abs: float = 0.0  # max over channels of (max - min) across ranks of running_mean
    mean_rel: float = 0.0  # the same, relative to max(|max|, |min|)
    var_abs: float = 0.0
    var_rel: float = 0.0
    batches: tuple[int, int] | None = None  # (min, max) num_batches_tracked across ranks
    mismatches: list[str] = field(default_factory=list)  # settings that differ: momentum, eps, ...
    diverged: bool = False

    @property
    def ok(self) -> bool:
        return not (self.diverged or self.mismatches or (self.batches and self.batches[0] != self.batches[1]))


@dataclass
class SyncReport:
    """Result of :func:`check_bn_sync` or of ``tritonbn doctor``; ``str(report)`` is a readable table.

    ``world_size`` is the number of ranks (or checkpoints) compared with each other. ``groups`` holds
    the global ranks of each group that :func:`check_bn_sync` compared within (one group when it
    compared across a whole process group; ``None`` for ``tritonbn doctor``), and ``group_ok`` whether
    each group is in sync. With several groups, each layer's figures are the worst over the groups.
    """

    layers: list[LayerRecord]
    world_size: int
    atol: float = ATOL
    rtol: float = RTOL
    groups: list[list[int]] | None = None
    group_ok: list[bool] | None = None

    @property
    def ok(self) -> bool:
        return all(layer.ok for layer in self.layers) and all(self.group_ok or [])

    @property
    def diverging(self) -> list[str]:
        return [layer.name for layer in self.layers if not layer.ok]

    @property
    def diverging_groups(self) -> list[list[int]]:
        """The groups (global ranks) in which some layer diverges."""
        return [g for g, ok in zip(self.groups or [], self.group_ok or [], strict=True) if not ok]

    def compared(self) -> str:
        """Which ranks were compared with which, in words: ``"within each of 2 groups of 2 ranks: 0-1 | 2-3"``."""
        if not self.groups:
            return ""
        if len(self.groups) == 1:
            return f"compared one group: ranks {_ranks_text(self.groups[0])}"
        shown = " | ".join(_ranks_text(g) for g in self.groups[:8]) + (" | ..." if len(self.groups) > 8 else "")
        return (
            f"compared within each of {len(self.groups)} groups of {len(self.groups[0])} ranks: {shown}; "
            "groups are not compared with each other"
        )

    def __str__(self) -> str:
        head = ("layer", "mean max|d|", "mean rel", "var max|d|", "var rel", "batches", "status")
        rows = [
            (
                r.name or "<root>",
                f"{r.mean_abs:.3g}",
                f"{r.mean_rel:.3g}",
                f"{r.var_abs:.3g}",
                f"{r.var_rel:.3g}",
                _batches_text(r.batches),
                "ok" if r.ok else "DIVERGED" + (f" ({', '.join(r.mismatches)})" if r.mismatches else ""),
            )
            for r in self.layers
        ]
        widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        where = f"across {self.world_size} ranks" if not self.groups or len(self.groups) == 1 else "within groups"
        verdict = (
            f"all {len(self.layers)} BatchNorm layers in sync {where}"
            if self.ok
            else f"{len(self.diverging)} of {len(self.layers)} BatchNorm layers diverge {where}: "
            f"{', '.join(self.diverging)}"
        )
        if self.groups and len(self.groups) > 1 and not self.ok:
            bad = self.diverging_groups
            verdict += "; in " + (
                f"group{'s' if len(bad) > 1 else ''} " + ", ".join(_ranks_text(g) for g in bad)
                if bad
                else "no one group: num_batches_tracked differs between groups"
            )
        if self.groups:
            verdict += f" ({self.compared()})"
        return "\n".join([*lines, verdict])


def _ranks_text(ranks: list[int]) -> str:
    """``"0-3"`` for consecutive ranks, else ``"0, 2, 5"``."""
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _batches_text(batches: tuple[int, int] | None) -> str:
    if batches is None:
        return "-"
    lo, hi = batches
    return str(lo) if lo == hi else f"{lo}..{hi}"


def _spread(hi: torch.Tensor, lo: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, bool]:
    """Max absolute and relative spread ``hi - lo`` over channels, and whether it is out of tolerance."""
    if hi.numel() == 0:
        return 0.0, 0.0, False
    diff = hi - lo
    scale = torch.maximum(hi.abs(), lo.abs())
    rel = torch.where(diff > 0, diff / scale.clamp_min(1e-30), torch.zeros_like(diff))
    nan = torch.isnan(diff).any().item()
    over = bool(nan or (diff > atol + rtol * scale).any().item())
    return float(diff.max().item()) if not nan else math.nan, float(rel.max().item()) if not nan else math.nan, over


def layer_record(
    name: str, hi: torch.Tensor, lo: torch.Tensor, C: int, tracked: bool, atol: float = ATOL, rtol: float = RTOL
) -> LayerRecord:
    """A record from the per-element max and min across ranks of ``[mean (C) | var (C) | nbt (1) | settings]``."""
    record = LayerRecord(name)
    if tracked:
        record.mean_abs, record.mean_rel, d1 = _spread(hi[:C], lo[:C], atol, rtol)
        record.var_abs, record.var_rel, d2 = _spread(hi[C : 2 * C], lo[C : 2 * C], atol, rtol)
        record.batches = (int(lo[2 * C].item()), int(hi[2 * C].item()))
        record.diverged = d1 or d2
    settings = hi[-4:] != lo[-4:]
    record.mismatches = [s for s, differs in zip(_SETTINGS, settings.tolist(), strict=True) if differs]
    return record


def _layer_vector(m: _BatchNorm) -> torch.Tensor:
    """``[running_mean | running_var | num_batches_tracked | momentum, eps, affine, track]`` in fp64."""
    parts = []
    if m.track_running_stats and m.running_mean is not None:
        nbt = m.num_batches_tracked if m.num_batches_tracked is not None else torch.zeros(())
        parts += [
            m.running_mean.detach().double().flatten(),
            m.running_var.detach().double().flatten(),
            nbt.detach().double().reshape(1).to(m.running_mean.device),
        ]
    momentum = -1.0 if m.momentum is None else float(m.momentum)
    device = m.running_mean.device if parts else torch.device("cpu")
    settings = torch.tensor([momentum, float(m.eps), float(m.affine), float(m.track_running_stats)], device=device)
    return torch.cat([*parts, settings.double()])


def check_bn_sync(
    model: nn.Module, process_group=None, atol: float = ATOL, rtol: float = RTOL, *, group_size: int | None = None
) -> SyncReport:
    """Compare every BatchNorm's running statistics and settings across the ranks of ``process_group``.

    A layer diverges when, for some channel, the spread ``max - min`` across ranks of its running
    mean or var exceeds ``atol + rtol * max(|max|, |min|)``, when ``num_batches_tracked`` differs, or
    when ``momentum``, ``eps``, ``affine`` or ``track_running_stats`` differ.

    **Groups.** When BatchNorm synchronizes within groups (:func:`tritonbn.syncbn_group`), the running
    statistics are equal within a group and differ between groups, by design. ``group_size=k``
    compares the ranks of each group of ``k`` consecutive ranks with each other, and never one group
    with another; so does a ``process_group`` made by :func:`tritonbn.syncbn_group`. By default
    (neither given), the groups are those of the model: when all its synchronized BatchNorm layers use
    the groups of one ``group_size``, it compares within them, and otherwise across the world. The
    report says which groups it compared (``report.groups``, and the last line of ``str(report)``),
    which groups diverge, and gives each layer's worst figures over the groups.

    A collective: every rank of the world (of ``process_group`` when it is some other group) must
    call it, with the same BatchNorm layers (DDP guarantees that). It makes one packed MAX
    all-reduce of every layer's buffers and settings for the whole model, within the group; with
    groups, a second small one (a dozen numbers per layer, one per group) merges the groups' verdicts
    so that every rank returns the same report. With ``TRITONBN_DEBUG=1`` a small signature
    all-reduce first checks that the ranks hold the same layout, so that a mismatch raises on every
    rank instead of hanging.
    """
    if process_group is not None and group_size is not None:
        raise ValueError("check_bn_sync: pass process_group or group_size, not both")
    layers = batchnorm_modules(model)
    if group_size is not None:
        process_group = syncbn_group(group_size)
    size = group_size_of(process_group) if process_group is not None else _model_group_size(layers)
    if process_group is None and size is not None:
        process_group = syncbn_group(size)
    vectors = [_layer_vector(m) for _, m in layers]
    group = resolve_group(process_group)
    world = dist.get_world_size(group) if group is not None else 1
    flat = torch.cat([v.cpu() for v in vectors]) if vectors else torch.zeros(0, dtype=torch.float64)
    if group is not None:
        if debug_enabled():
            check_signature(group, "check_bn_sync", {"BatchNorm layers": len(layers), "elements": flat.numel()})
        # MAX of [x | -x] gives every element's max and min across ranks.
        both = torch.cat([flat, -flat]).to(collective_device(group))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        hi, lo = both[: flat.numel()].cpu(), -both[flat.numel() :].cpu()
    else:
        hi = lo = flat
    records, offset = [], 0
    for (name, m), v in zip(layers, vectors, strict=True):
        n = v.numel()
        tracked = m.track_running_stats and m.running_mean is not None
        records.append(
            layer_record(name, hi[offset : offset + n], lo[offset : offset + n], m.num_features, tracked, atol, rtol)
        )
        offset += n
    initialized = dist.is_available() and dist.is_initialized()
    if initialized and size is not None and size < dist.get_world_size():
        groups = group_ranks(size, dist.get_world_size())
        group_ok = _merge_groups(records, size, len(groups))
        return SyncReport(records, size, atol, rtol, groups, group_ok)
    if process_group is not None and initialized:
        ranks = dist.get_process_group_ranks(process_group)
    else:
        ranks = list(range(dist.get_world_size() if initialized else 1))
    return SyncReport(records, world, atol, rtol, [ranks], [all(r.ok for r in records)])


def _model_group_size(layers: list[tuple[str, _BatchNorm]]) -> int | None:
    """The ``group_size`` of the :func:`tritonbn.syncbn_group` groups that all synchronized layers use,
    or ``None`` (compare across the world) when they use none, several, or other process groups."""
    sizes = {group_size_of(m.process_group) for _, m in layers if isinstance(m, SyncBatchNorm | nn.SyncBatchNorm)}
    return sizes.pop() if len(sizes) == 1 else None


_MERGED = 7 + len(_SETTINGS)  # per layer: 4 spreads, -min and max batches, diverged, settings that differ


def _merge_groups(records: list[LayerRecord], size: int, count: int) -> list[bool]:
    """Merge every group's records into the worst over the groups, in place, on every rank; return
    whether each group is in sync. One MAX all-reduce over the world of ``7 + 4`` numbers per layer
    and one per group: each rank fills in its own group's (every rank of a group holds the same).
    """
    numbers = torch.full((len(records) * _MERGED + count,), -math.inf, dtype=torch.float64)
    for i, r in enumerate(records):
        spreads = [math.inf if math.isnan(v) else v for v in (r.mean_abs, r.mean_rel, r.var_abs, r.var_rel)]
        batches = [-r.batches[0], r.batches[1]] if r.batches else [-math.inf, -math.inf]
        numbers[i * _MERGED : (i + 1) * _MERGED] = torch.tensor(
            [*spreads, *batches, float(r.diverged), *(float(s in r.mismatches) for s in _SETTINGS)],
            dtype=torch.float64,
        )
    mine = dist.get_rank() // size
    numbers[len(records) * _MERGED :] = 0.0
    numbers[len(records) * _MERGED + mine] = 0.0 if all(r.ok for r in records) else 1.0
    world = dist.group.WORLD
    merged = numbers.to(collective_device(world))
    dist.all_reduce(merged, op=dist.ReduceOp.MAX, group=world)
    merged = merged.cpu().tolist()
    for i, r in enumerate(records):
        v = merged[i * _MERGED : (i + 1) * _MERGED]
        r.mean_abs, r.mean_rel, r.var_abs, r.var_rel = v[:4]
        r.batches = (int(-v[4]), int(v[5])) if r.batches is not None else None
        r.diverged = v[6] > 0
        r.mismatches = [s for s, flag in zip(_SETTINGS, v[7:], strict=True) if flag > 0]
    return [flag == 0 for flag in merged[len(records) * _MERGED :]]
