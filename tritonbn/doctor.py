"""``tritonbn doctor CKPT [CKPT ...]``: compare BatchNorm statistics across per-rank checkpoints.

Exit codes: 0 when the checkpoints are in sync, 1 when some BatchNorm layer diverges (per channel,
``max - min`` across checkpoints of ``running_mean`` or ``running_var`` above
``atol + rtol * max(|max|, |min|)``, defaults ``1e-6`` and ``1e-5``, or a different
``num_batches_tracked``), 2 when a file cannot be read or the checkpoints do not hold the same layers.
"""

from __future__ import annotations

import sys

import torch

from tritonbn.diagnose import ATOL, RTOL, SyncReport, layer_record


class DoctorError(Exception):
    """An unreadable or incompatible checkpoint (exit code 2)."""


def _state_dict(obj, path: str) -> dict:
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    elif isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not any(isinstance(v, torch.Tensor) for v in obj.values()):
        raise DoctorError(f"{path}: expected a state_dict or {{'model': state_dict}}, got {type(obj).__name__}")
    return obj


def load(path: str) -> dict:
    """The state_dict inside a checkpoint file (weights only: no code is run)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is reported the same way
        raise DoctorError(f"{path}: cannot read checkpoint: {e}") from e
    return _state_dict(obj, path)


def batchnorm_prefixes(state: dict) -> list[str]:
    """Prefixes ``p`` with both ``p + 'running_mean'`` and ``p + 'running_var'`` in ``state``."""
    return [k[: -len("running_mean")] for k in state if k.endswith("running_mean") and
            k[: -len("running_mean")] + "running_var" in state]  # fmt: skip


def compare(states: list[dict], paths: list[str], atol: float = ATOL, rtol: float = RTOL) -> SyncReport:
    """A :class:`SyncReport` of the BatchNorm buffers across ``states`` (one per rank)."""
    prefixes = batchnorm_prefixes(states[0])
    if not prefixes:
        raise DoctorError(f"{paths[0]}: no BatchNorm running statistics (no '*running_mean' with '*running_var')")
    records = []
    for prefix in prefixes:
        rows = []
        for state, path in zip(states, paths, strict=True):
            try:
                mean, var = state[prefix + "running_mean"], state[prefix + "running_var"]
            except KeyError as e:
                raise DoctorError(f"{path}: has no {e.args[0]}, which {paths[0]} has: not the same model") from e
            if mean.shape != states[0][prefix + "running_mean"].shape or var.shape != mean.shape:
                shape = tuple(mean.shape)
                raise DoctorError(f"{path}: {prefix}running_mean/var have shape {shape}, not as in {paths[0]}")
            nbt = state.get(prefix + "num_batches_tracked", torch.tensor(-1))
            rows.append(torch.cat([mean.double().flatten(), var.double().flatten(), nbt.double().reshape(1),
                                   torch.zeros(4, dtype=torch.float64)]))  # fmt: skip
        stack = torch.stack(rows)
        hi, lo = stack.max(0).values, stack.min(0).values
        records.append(layer_record(prefix.rstrip("."), hi, lo, mean.numel(), True, atol, rtol))
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
