"""The one collective per pass, process-group resolution, and the opt-in debug signature check."""

from __future__ import annotations

import os

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


def collective_device(group) -> torch.device:
    """Where a small host-made tensor must live for a collective on ``group`` (CUDA for NCCL)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def debug_enabled() -> bool:
    """``TRITONBN_DEBUG=1``: check a signature across ranks before each collective."""
    return os.environ.get("TRITONBN_DEBUG", "0").strip().lower() not in ("", "0", "false", "no", "off")


_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, 0)


class RemoteInputError(ValueError):
    """Raised on the ranks whose input was fine when another rank rejected its input (debug mode)."""


def check_signature(group, where: str, fields: dict[str, float], local_error: BaseException | None = None) -> None:
    """Compare ``fields`` across the ranks of ``group``; raise the same error on every rank on a mismatch.

    Every rank must call this at the same point with the same field names (debug mode calls it
    before each collective, and also in eval so that a rank in eval while others train is caught).
    A rank that rejected its input passes ``local_error``: it re-raises that error, and the other
    ranks raise :class:`RemoteInputError`, instead of waiting forever in the next collective.
    It reads the result on the host: a synchronization, which is why it is opt-in.
    """
    values = torch.tensor([1.0 if local_error is not None else 0.0, *map(float, fields.values())], dtype=torch.float64)
    both = torch.cat([values, -values]).to(collective_device(group))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[: values.numel()].cpu(), -both[values.numel() :].cpu()
    if local_error is not None:
        raise local_error
    if hi[0] > 0:
        raise RemoteInputError(f"tritonbn {where}: another rank rejected its input; see the error on that rank")
    names = list(fields)
    differ = [
        f"{name} ({_show(name, lo[i + 1])} vs {_show(name, hi[i + 1])})"
        for i, name in enumerate(names)
        if hi[i + 1] != lo[i + 1]
    ]
    if differ:
        raise ValueError(
            f"tritonbn {where}: ranks disagree on {', '.join(differ)}. Every rank of the process group must call "
            "SyncBatchNorm in the same order, in the same mode (train/eval), with the same channels and dtype"
        )


def _show(name: str, value: torch.Tensor) -> str:
    v = int(value.item())
    if name == "dtype":
        return next((str(d).replace("torch.", "") for d, c in _DTYPE_CODES.items() if c == v), "other")
    if name in ("training", "input_grad"):
        return {"training": ("eval", "train"), "input_grad": ("no", "yes")}[name][v]
    if name == "pass":
        return ("forward", "backward")[v - 1] if v in (1, 2) else str(v)
    return str(v)
