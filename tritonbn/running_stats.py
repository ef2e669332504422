"""BatchNorm running statistics: one update per optimizer step, and repairs after the fact.

* :func:`accumulate_stats`: one running-statistics update per optimizer step under gradient accumulation.
* :func:`sync_running_stats`: pool the running statistics of all ranks.
* :func:`recalibrate_batchnorm`: recompute them exactly on given batches ("precise BN").

**Gradient accumulation.** With K micro-batches per optimizer step, BatchNorm updates its running statistics K times per
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

import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from tritonbn._core.call import in_backward
from tritonbn._core.checks import ACCUMULATE_EAGER_ONLY
from tritonbn._norm_layers import PLAIN
from tritonbn._signature import check_signature, debug_enabled
from tritonbn.backend import ops_for, update_running_stats
from tritonbn.diagnose import batchnorm_modules, unwrap
from tritonbn.distributed import collective_device, resolve_group
from tritonbn.functional import batch_norm
from tritonbn.modules import ACCUMULATOR, SyncBatchNorm


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
            raise RuntimeError(ACCUMULATE_EAGER_ONLY)
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
        update_running_stats(self.sums, m.running_mean, m.running_var, m.num_batches_tracked, m.momentum, m.eps)


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
    the concatenation of the micro-batches (over all ranks) would. See :mod:`tritonbn.running_stats`
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


# --- repairing running statistics after the fact: pooling over ranks, and precise BN ------------------


def _tracked(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    return [(n, m) for n, m in batchnorm_modules(model) if m.track_running_stats and m.running_mean is not None]


@torch.no_grad()
def sync_running_stats(model: nn.Module, process_group=None) -> int:
    """Pool the running statistics over the ranks of ``process_group`` (default: the world).

    Every layer gets the mean over ranks of ``running_mean``, and the pooled variance
    ``mean_r(var_r + mean_r^2) - mean^2``, which includes the spread of the means between ranks.
    ``num_batches_tracked`` becomes the rounded mean over ranks. One packed fp64 all-reduce for the
    whole model; afterwards every rank holds identical buffers. A collective: every rank must call it.
    Returns the number of layers updated.

    Two uses: repairing a model trained with unsynchronized BatchNorm, and, when BatchNorm
    synchronizes within groups (:func:`tritonbn.syncbn_group`, whose running statistics differ
    between groups by design), giving every rank the statistics of the whole world before
    evaluating or saving a checkpoint, as timm's ``distribute_bn`` does. With groups of equal size,
    pooling over the world's ranks weighs every group equally.
    """
    layers = _tracked(model)
    group = resolve_group(process_group)
    if group is None or not layers:
        return len(layers)
    world = dist.get_world_size(group)
    device = collective_device(group)
    parts = []
    for _, m in layers:
        mean, var = m.running_mean.double(), m.running_var.double()
        nbt = m.num_batches_tracked.double().reshape(1) if m.num_batches_tracked is not None else mean.new_zeros(1)
        parts += [mean.to(device), (var + mean * mean).to(device), nbt.to(device)]
    packed = torch.cat(parts)
    if debug_enabled():
        check_signature(group, "sync_running_stats", {"BatchNorm layers": len(layers), "elements": packed.numel()})
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    packed /= world
    offset = 0
    for _, m in layers:
        C = m.num_features
        mean = packed[offset : offset + C]
        second = packed[offset + C : offset + 2 * C]
        m.running_mean.copy_(mean)
        m.running_var.copy_((second - mean * mean).clamp_min(0))
        if m.num_batches_tracked is not None:
            m.num_batches_tracked.copy_(packed[offset + 2 * C].round().long())
        offset += 2 * C + 1
    return len(layers)


class _BatchNormCalls(TorchFunctionMode):
    """Routes ``F.batch_norm`` calls made directly inside a BatchNorm layer's own forward to ``normalize``.

    ``enter``/``leave`` are that layer's forward pre- and post-hooks; calls outside such a layer pass through.
    """

    def __init__(self, normalize):
        super().__init__()
        self.normalize, self.stack = normalize, []

    def enter(self, module, args):
        self.stack.append(module)

    def leave(self, module, args, output):
        self.stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.batch_norm or not self.stack:
            return func(*args, **kwargs)
        # F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps): the
        # layer's own parameters are used, as in its forward; only the statistics change.
        return self.normalize(self.stack[-1], args[0] if args else kwargs["input"])


def _default_forward(model: nn.Module, batch):
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, list | tuple):
        return model(batch[0])
    raise TypeError(f"batches must yield tensors, (input, ...) tuples or dicts, got {type(batch).__name__}")


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, batches, process_group=None, forward=None) -> int:
    """Recompute every BatchNorm's running statistics exactly on ``batches`` ("precise BN").

    Runs the model over ``batches`` (each rank its own, every rank the same number of batches) in
    training mode, with every BatchNorm normalizing with the statistics synchronized over
    ``process_group``, and accumulates each layer's input sums in fp64. One all-reduce at the end
    gives every layer ``running_mean`` / ``running_var`` equal to the mean and unbiased variance of
    the union of all ranks' batches, and ``num_batches_tracked`` the number of batches. That is
    exact for a layer whose input does not depend on other BatchNorm layers (the first one); later
    layers see inputs normalized with per-batch statistics, as in training. Every layer runs its own
    forward (timm's ``BatchNormAct2d`` applies its ``drop`` and ``act``, a fused tritonbn module its
    epilogue); only the normalization inside it changes.

    ``forward(model, batch)`` runs one batch (default: ``model(batch)`` for a tensor,
    ``model(batch[0])`` for a tuple or list, ``model(**batch)`` for a dict). The training mode of
    every module and the BatchNorm settings are restored afterwards. A layer that sees no data keeps
    its statistics. A collective: every rank must call it. Returns the number of batches run.
    """
    count = 0
    forward = forward or _default_forward
    root = unwrap(model)
    layers = batchnorm_modules(root)
    group = resolve_group(process_group)
    modes = [(m, m.training) for m in root.modules()]
    sums: dict[int, torch.Tensor] = {}

    def normalize(m: _BatchNorm, x, residual=None, mask=None, *, activation=None, negative_slope=0.01):
        """Batch norm over ``group`` with the batch statistics, accumulating ``m``'s input sums (of the real
        positions, for masked BatchNorm's ``mask``)."""
        stats = ops_for(x).batch_norm_stats(x, mask=mask)
        sums[id(m)] = stats if id(m) not in sums else sums[id(m)] + stats
        return batch_norm(
            x,
            None,
            None,
            m.weight,
            m.bias,
            True,
            m.momentum,
            m.eps,
            group,
            residual=residual,
            activation=activation,
            negative_slope=negative_slope,
            mask=mask,
        )

    # Every layer runs its own forward; only the batch norm inside it is replaced by `normalize`:
    # torch's own classes compute nothing else, tritonbn's call `_normalize` (fused epilogue, then
    # drop/act for SyncBatchNormAct), and other subclasses (timm's BatchNormAct2d) call F.batch_norm.
    restore = []
    with _BatchNormCalls(normalize) as calls:
        try:
            root.train()
            for _, m in layers:
                if isinstance(m, SyncBatchNorm):
                    m._normalize = functools.partial(
                        normalize, m, activation=m.activation, negative_slope=m.negative_slope
                    )
                    restore.append((m, "_normalize"))
                elif type(m) in PLAIN:
                    m.forward = functools.partial(normalize, m)
                    restore.append((m, "forward"))
                else:
                    restore += [
                        (m.register_forward_pre_hook(calls.enter), None),
                        (m.register_forward_hook(calls.leave, always_call=True), None),
                    ]
            for batch in batches:
                forward(model, batch)
                count += 1
        finally:
            for m, name in restore:
                if name is None:
                    m.remove()
                else:
                    m.__dict__.pop(name, None)
            for m, training in modes:
                m.training = training

    tracked = _tracked(root)
    if not tracked:
        return count
    device = collective_device(group)
    packed = torch.cat(
        [sums.get(id(m), torch.zeros(2 * m.num_features + 1, dtype=torch.float64)).to(device) for _, m in tracked]
    )
    if group is not None:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for _, m in tracked:
        C = m.num_features
        layer = packed[offset : offset + 2 * C + 1].to(m.running_mean.device)  # [sum x | sum x^2 | count]
        s1, s2, n = layer[:C], layer[C : 2 * C], layer[2 * C]
        offset += 2 * C + 1
        if not n > 0:
            continue
        mean = s1 / n
        var = ((s2 - n * mean * mean) / (n - 1).clamp_min(1)).clamp_min(0)
        m.reset_running_stats()
        m.running_mean.copy_(mean)
        m.running_var.copy_(var)
        if m.num_batches_tracked is not None:
            m.num_batches_tracked.fill_(count)
    return count
