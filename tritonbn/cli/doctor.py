"""``tritonbn doctor CKPT [CKPT ...]``: compare BatchNorm statistics across per-rank checkpoints.

Exit codes: 0 when the checkpoints are in sync, 1 when some BatchNorm layer diverges (per channel,
``max - min`` across checkpoints of ``running_mean`` or ``running_var`` above
``atol + rtol * max(|max|, |min|)``, defaults ``1e-6`` and ``1e-5``, or a different
``num_batches_tracked``), 2 when a file cannot be used: it cannot be read (empty, not written by
``torch.save``, or refused by the weights-only loader), it is not a state_dict, its BatchNorm entries are
not tensors of the right shapes, or the checkpoints do not hold the same layers. Exit 2 prints one
line on stderr naming the file and the problem, never a traceback.
"""

from __future__ import annotations

import os
import pickle
import sys

import torch

from tritonbn.diagnose import ATOL, RTOL, SyncReport, layer_record


class DoctorError(Exception):
    """An unreadable or incompatible checkpoint (exit code 2)."""


_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _load_failure(path: str, error: BaseException) -> str:
    """Why ``torch.load(path, weights_only=True)`` failed, in one line without advice to load unsafely.

    The weights-only loader's refusal is explained by torch's own list of the globals it would need
    (``torch.serialization.get_unsafe_globals_in_checkpoint``), not by parsing its message.
    """
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        return "empty file"
    if isinstance(error, OSError):
        return _first_line(error)
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic not in (b"PK", b"\x80\x02"):  # torch.save writes a zip archive (or, before 1.6, a pickle)
        return "not a checkpoint written by torch.save"
    if isinstance(error, pickle.UnpicklingError):
        refused = "refused by the weights-only loader, nothing was run"
        try:
            needed = torch.serialization.get_unsafe_globals_in_checkpoint(path) if magic == b"PK" else []
        except Exception:  # noqa: BLE001 - the list only adds detail to the refusal
            needed = []
        return f"{refused} (it needs globals that are not allowed: {', '.join(needed)})" if needed else refused
    return _first_line(error)


def _a(value) -> str:
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def _state_dict(obj, path: str) -> dict:
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    elif isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not any(isinstance(v, torch.Tensor) for v in obj.values()):
        raise DoctorError(f"{path}: expected a state_dict or {{'model': state_dict}}, got {type(obj).__name__}")
    for key, value in obj.items():
        if not isinstance(key, str):
            raise DoctorError(f"{path}: key {key!r} is {_a(key)}, not a string: not a state_dict")
        if key.endswith(_SUFFIXES) and not isinstance(value, torch.Tensor):
            raise DoctorError(f"{path}: {key} is {_a(value)}, not a tensor")
    return obj


def load(path: str) -> dict:
    """The state_dict inside a checkpoint file (weights only: no code is run)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is reported the same way
        raise DoctorError(f"{path}: cannot read checkpoint: {_load_failure(path, e)}") from e
    return _state_dict(obj, path)


def _layer_row(state: dict, prefix: str, path: str, shape: torch.Size, first: str) -> torch.Tensor:
    """``[running_mean | running_var | num_batches_tracked]`` of one layer as fp64, checked."""
    try:
        mean, var = state[prefix + "running_mean"], state[prefix + "running_var"]
    except KeyError as e:
        raise DoctorError(f"{path}: has no {e.args[0]}, which {first} has: not the same model") from e
    nbt = state.get(prefix + "num_batches_tracked", torch.tensor(-1))
    for name, t in (("running_mean", mean), ("running_var", var)):
        if t.layout != torch.strided or not t.is_floating_point():
            raise DoctorError(f"{path}: {prefix}{name} must be a dense floating-point tensor, got {t.dtype} {t.layout}")
        if t.shape != shape:
            raise DoctorError(f"{path}: {prefix}{name} has shape {tuple(t.shape)}, not {tuple(shape)} as in {first}")
    if nbt.layout != torch.strided or nbt.numel() != 1 or nbt.is_floating_point() or nbt.is_complex():
        raise DoctorError(
            f"{path}: {prefix}num_batches_tracked must hold one integer, got {nbt.dtype} of shape {tuple(nbt.shape)}"
        )
    try:
        return torch.cat(
            [
                mean.double().flatten(),
                var.double().flatten(),
                nbt.double().reshape(1),
                torch.zeros(4, dtype=torch.float64),
            ]
        )
    except (RuntimeError, TypeError, ValueError) as e:  # a tensor torch cannot convert, say
        raise DoctorError(f"{path}: {prefix}running_mean/var cannot be read as numbers: {_first_line(e)}") from e


def batchnorm_prefixes(state: dict) -> list[str]:
    """Prefixes ``p`` with both ``p + 'running_mean'`` and ``p + 'running_var'`` in ``state``."""
    return [
        k[: -len("running_mean")]
        for k in state
        if k.endswith("running_mean") and k[: -len("running_mean")] + "running_var" in state
    ]


def compare(states: list[dict], paths: list[str], atol: float = ATOL, rtol: float = RTOL) -> SyncReport:
    """A :class:`SyncReport` of the BatchNorm buffers across ``states`` (one per rank)."""
    prefixes = batchnorm_prefixes(states[0])
    if not prefixes:
        raise DoctorError(f"{paths[0]}: no BatchNorm running statistics (no '*running_mean' with '*running_var')")
    for state, path in zip(states[1:], paths[1:], strict=True):
        extra = sorted(set(batchnorm_prefixes(state)) - set(prefixes))
        if extra:
            layer = extra[0].rstrip(".")
            raise DoctorError(f"{path}: has BatchNorm layer {layer!r}, which {paths[0]} has not: not the same model")
    records = []
    for prefix in prefixes:
        shape = states[0][prefix + "running_mean"].shape
        stack = torch.stack([_layer_row(s, prefix, p, shape, paths[0]) for s, p in zip(states, paths, strict=True)])
        hi, lo = stack.max(0).values, stack.min(0).values
        records.append(layer_record(prefix.rstrip("."), hi, lo, shape.numel(), True, atol, rtol))
    return SyncReport(records, len(states), atol, rtol)


def main(paths: list[str], atol: float = ATOL, rtol: float = RTOL) -> int:
    try:
        if len(paths) < 2:
            raise DoctorError(f"need at least two checkpoints (one per rank) to compare, got {len(paths)}")
        states = [load(p) for p in paths]
        report = compare(states, paths, atol, rtol)
    except DoctorError as e:
        print(f"tritonbn doctor: error: {e}", file=sys.stderr)
        return 2
    print(report)
    if not report.ok:
        print(
            "fix: convert the model with tritonbn.convert_sync_batchnorm before training, and repair this one with "
            "tritonbn.sync_running_stats(model) or tritonbn.recalibrate_batchnorm(model, batches)"
        )
    return 0 if report.ok else 1
