"""BatchNorm running statistics under gradient accumulation: :func:`accumulate_stats`.

With K micro-batches per optimizer step, BatchNorm updates its running statistics K times per
step, each from one micro-batch: they follow a batch K times smaller, with K times the momentum.
Inside ``with tritonbn.accumulate_stats(model):`` each tritonbn layer's training forward still
normalizes with its own (global) micro-batch statistics, but instead of updating the running
statistics it adds its global packed sums ``[sum x | sum x^2 | count]`` (the forward's own
all-reduced buffer) into a per-layer fp64 buffer on the device: no host synchronization, no extra
collective. On leaving the block, each layer makes one running-statistics update from the pooled
sums of all its calls, and one ``num_batches_tracked`` increment: the update one forward over the
concatenation of the K micro-batches would have made (``momentum=None`` included). That update is
the forward kernel's own (its launcher runs on an empty batch with the pooled sums), so it is the
same code and the same math as an ordinary step.

Nothing is updated, and the running statistics stay as they were before the block, when the
block raises, or when the layers that ran in training were not all called the same number of
times (a layer shared between branches, a layer skipped in some micro-batches): the latter raises
a ``RuntimeError`` on leaving the block that names the layers and their counts.

Layers in eval mode, layers with ``track_running_stats=False``, and activation-checkpointing
recomputes (forwards inside a backward pass) are not counted and add nothing. Eager calls only: a
call while a CUDA graph is being captured raises an error, and so does one under functorch transforms
or dispatch modes. Under ``torch.compile`` the layer's call raises inside the traced code, so dynamo
runs it eagerly (a graph break; the block's attribute is guarded, so graphs compiled before the block
are not reused inside it), and with ``fullgraph=True`` dynamo's error quotes this module's.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from tritonbn.backend import ops_for
from tritonbn.functional import in_backward
from tritonbn.modules import ACCUMULATOR, SyncBatchNorm

_EAGER_ONLY = (
    "tritonbn.accumulate_stats needs eager calls: it does not work under torch.compile, functorch transforms (vmap) "
    "or dispatch modes (make_fx)"
)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _Slot:
    """One layer's accumulator: what :class:`SyncBatchNorm` calls in a training forward inside the block."""

    __slots__ = ("name", "module", "sums", "calls")

    def __init__(self, name: str, module: SyncBatchNorm) -> None:
        self.name, self.module = name, module
        self.sums: torch.Tensor | None = None  # (2C + 1,) fp64 on the input's device, allocated at the first call
        self.calls = 0

    def __call__(self, input) -> torch.Tensor | None:
        """The buffer this call's global sums are added into, or ``None`` (a recompute: add nothing)."""
        if torch.compiler.is_compiling():  # before anything dynamo would break the graph on
            raise RuntimeError(_EAGER_ONLY)
        if not isinstance(input, torch.Tensor) or in_backward():
            return None
        if _capturing(input.device):
            raise RuntimeError(
                "tritonbn.accumulate_stats cannot run inside a CUDA graph capture: its call counts live on the "
                "host and would not replay; capture the micro-batches without it, or accumulate eagerly"
            )
        if self.sums is None:
            C = self.module.num_features
            self.sums = torch.zeros(2 * C + 1, dtype=torch.float64, device=input.device)
        self.calls += 1
        return self.sums

    def apply(self) -> None:
        """One running-statistics update from the pooled sums (the forward kernel's own, on an empty batch)."""
        m = self.module
        empty = torch.empty((0, m.num_features), dtype=m.running_mean.dtype, device=self.sums.device)
        ops_for(empty).batch_norm_elemt(
            empty, None, None, stats=self.sums, running_mean=m.running_mean, running_var=m.running_var,
            num_batches_tracked=m.num_batches_tracked, momentum=m.momentum, eps=m.eps,
        )  # fmt: skip


class accumulate_stats:  # noqa: N801 - used like a function: ``with tritonbn.accumulate_stats(model):``
    """Context manager: one BatchNorm running-statistics update for all the micro-batches run inside it.

    ::

        for step in range(steps):
            with tritonbn.accumulate_stats(model):
                for x, t in micro_batches(step):  # K of them
                    loss_fn(model(x), t).backward()
            optimizer.step()
            optimizer.zero_grad()

    ``model`` holds :class:`tritonbn.SyncBatchNorm` layers (after :func:`tritonbn.convert_sync_batchnorm`),
    possibly wrapped in DDP. On a normal exit every layer that ran in training mode updates its
    running statistics once, from the pooled global sums of all its calls, exactly as one forward over
    the concatenation of the micro-batches (over all ranks) would. See :mod:`tritonbn.accumulate`
    for what leaves the statistics untouched. ``micro_batches`` holds, after the block, how many
    training calls each layer made (``None`` when no layer ran in training mode).
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"accumulate_stats: model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.micro_batches: int | None = None
        self._slots: list[_Slot] = []

    def __enter__(self) -> accumulate_stats:
        layers, plain = [], []
        for name, m in self.model.named_modules():
            if isinstance(m, SyncBatchNorm):
                if ACCUMULATOR in m.__dict__:
                    raise RuntimeError(
                        f"accumulate_stats: layer {name or '<root>'!r} is already inside another "
                        "tritonbn.accumulate_stats block; blocks cannot nest"
                    )
                if m.track_running_stats and m.running_mean is not None:
                    layers.append(_Slot(name, m))
            elif isinstance(m, _BatchNorm):
                plain.append(name or "<root>")
        if not layers:
            raise ValueError(
                "accumulate_stats: model has no tritonbn.SyncBatchNorm layer with running statistics; "
                "convert it with tritonbn.convert_sync_batchnorm first"
            )
        if plain:
            warnings.warn(
                f"accumulate_stats: {len(plain)} BatchNorm layer(s) are not tritonbn layers and will update their "
                f"running statistics at every micro-batch: {', '.join(plain)}",
                UserWarning,
                stacklevel=2,
            )
        for slot in layers:
            setattr(slot.module, ACCUMULATOR, slot)
        self._slots = layers
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        slots, self._slots = self._slots, []
        for slot in slots:
            slot.module.__dict__.pop(ACCUMULATOR, None)
        if exc_type is not None:
            return False  # nothing was updated: the running statistics are those from before the block
        ran = [s for s in slots if s.calls > 0]
        counts = {s.calls for s in ran}
        if len(counts) > 1:
            detail = ", ".join(f"{s.name or '<root>'}: {s.calls}" for s in ran)
            raise RuntimeError(
                "tritonbn.accumulate_stats: the BatchNorm layers were called different numbers of times in the "
                f"block ({detail}), so the micro-batches cannot be pooled per layer; the running statistics "
                "were left as they were before the block"
            )
        for slot in ran:
            slot.apply()
        self.micro_batches = counts.pop() if counts else None
        return False
