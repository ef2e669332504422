"""Argument checks: everything a rank can get wrong alone is rejected before any collective, naming the argument."""

from __future__ import annotations

import torch

from tritonbn._compat import assert_on_device, tracer_paused
from tritonbn._core.call import CallRecord
from tritonbn._numerics import FLOAT_DTYPES
from tritonbn.activations import check_activation

# Raised wherever tritonbn.accumulate_stats meets a call it cannot pool: compiled, transformed or traced.
ACCUMULATE_EAGER_ONLY = (
    "tritonbn.accumulate_stats needs eager calls: it does not work under torch.compile, functorch transforms (vmap) "
    "or dispatch modes (make_fx)"
)


def _check_vector(name: str, t: torch.Tensor | None, C: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape ({C},) or None, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != C:
        raise ValueError(f"{name} must have shape ({C},) to match the {C} channels of input, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the input's device {device}, got {t.device}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def check_momentum(momentum: float | None) -> None:
    if momentum is not None and not (0.0 <= float(momentum) <= 1.0):
        raise ValueError(f"momentum must be in [0, 1] or None, got {momentum}")


def check_inputs(operands, momentum: float | None, eps: float, training: bool, num_features: int | None = None):
    """Raise a ``ValueError``/``TypeError`` naming the argument for anything a rank can see alone.

    As in torch, ``eps`` must be positive in training and non-negative in eval, and ``momentum``
    (unused in eval) is only checked in training. ``operands``: the call's
    :class:`~tritonbn.backends.launchers.Operands` (its mask and sink are checked elsewhere).
    """
    input, residual, num_batches_tracked = operands.input, operands.residual, operands.num_batches_tracked
    running_mean, running_var, weight, bias = (
        operands.running_mean,
        operands.running_var,
        operands.weight,
        operands.bias,
    )
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a tensor, got {type(input).__name__}")
    if not 2 <= input.dim() <= 5:
        raise ValueError(f"input must have 2 to 5 dimensions (N, C, *S), got shape {tuple(input.shape)}")
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(f"input must be float32, float16, bfloat16 or float64, got dtype {input.dtype}")
    C = input.shape[1]
    if num_features is not None and C != num_features:
        raise ValueError(f"input has {C} channels (dim 1), but num_features={num_features}")
    if C == 0:
        raise ValueError(f"input must have at least one channel (dim 1), got shape {tuple(input.shape)}")
    device = input.device
    _check_vector("running_mean", running_mean, C, device)
    _check_vector("running_var", running_var, C, device)
    _check_vector("weight", weight, C, device)
    _check_vector("bias", bias, C, device)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must both be tensors or both be None")
    if training:
        check_momentum(momentum)
        if not float(eps) > 0.0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    elif not float(eps) >= 0.0:
        raise ValueError(f"batch_norm eps must be non-negative, but got {eps}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a tensor shaped like input or None, got {type(residual).__name__}")
        if residual.shape != input.shape:
            raise ValueError(f"residual must have the input's shape {tuple(input.shape)}, got {tuple(residual.shape)}")
        if residual.device != input.device:
            raise ValueError(f"residual must be on the input's device {input.device}, got {residual.device}")
        if residual.dtype not in FLOAT_DTYPES:
            raise TypeError(f"residual must be a floating-point tensor, got dtype {residual.dtype}")
    if num_batches_tracked is not None:
        if num_batches_tracked.numel() != 1 or num_batches_tracked.dtype != torch.long:
            raise ValueError(
                "num_batches_tracked must be a one-element int64 tensor, got "
                f"shape {tuple(num_batches_tracked.shape)} dtype {num_batches_tracked.dtype}"
            )
        if num_batches_tracked.device != device:
            raise ValueError(
                f"num_batches_tracked must be on the input's device {device}, got {num_batches_tracked.device}"
            )


def check_mask(mask, input: torch.Tensor) -> None:
    """Masked BatchNorm's ``mask``: a bool tensor of the input's shape without its channel dimension, on its device."""
    shape = (input.shape[0], *input.shape[2:])
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a bool tensor of shape {shape} or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True at real positions), got dtype {mask.dtype}")
    if tuple(mask.shape) != shape:
        raise ValueError(
            f"mask must have the input's shape without its channel dimension, {shape} for input of "
            f"shape {tuple(input.shape)}, got {tuple(mask.shape)}"
        )
    if mask.device != input.device:
        raise ValueError(f"mask must be on the input's device {input.device}, got {mask.device}")


def mask_from_lengths(input: torch.Tensor, lengths, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mask of an ``(N, C, L)`` input whose item ``i`` holds ``lengths[i]`` real positions, then padding.

    ``lengths`` on the host (a sequence, or a CPU tensor) is checked here; on a GPU, or under
    ``torch.compile``, on the device, with no host synchronization (on a GPU a failed check is a
    device-side assertion).
    """
    if mask is not None:
        raise ValueError("give mask or lengths, not both")
    if not isinstance(input, torch.Tensor) or input.dim() != 3:
        shape = tuple(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__
        raise ValueError(f"lengths needs an input of shape (N, C, L), got {shape}: give mask= instead")
    N, L = input.shape[0], input.shape[2]
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(lengths)
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
    if tuple(lengths.shape) != (N,):
        raise ValueError(
            f"lengths must have shape ({N},), one length per item of the batch, got {tuple(lengths.shape)}"
        )
    message = f"lengths must lie in [0, {L}] (the input's last dimension)"
    if lengths.device.type == "cpu" and not torch.compiler.is_compiling():
        if N and not bool(((lengths >= 0) & (lengths <= L)).all()):
            raise ValueError(f"{message}, got {lengths.tolist()}")
    else:
        assert_on_device(((lengths >= 0) & (lengths <= L)).all(), message)
    lengths = lengths.to(input.device, non_blocking=True)
    return torch.arange(L, device=input.device) < lengths[:, None]


def check_call(settings, operands, num_features: int | None = None) -> None:
    """Every check of one call (a :class:`~tritonbn._core.call.LayerSettings` and its
    :class:`~tritonbn.backends.launchers.Operands`): :func:`check_inputs` and the rules that need the layer's mode."""
    t = operands
    training = settings.batch_stats
    check_inputs(t, settings.momentum, settings.eps, training, num_features)
    check_activation(settings.activation, settings.negative_slope)
    if t.mask is not None:
        check_mask(t.mask, t.input)
    if not training and t.running_mean is None:
        raise ValueError("running_mean and running_var are required when training=False")
    if training and settings.group is None and t.input.numel() // t.input.shape[1] == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(t.input.shape)}")
    if training and settings.momentum is None and t.running_mean is not None and t.num_batches_tracked is None:
        raise ValueError("momentum=None (cumulative average) needs num_batches_tracked")


def check_eager_call(settings, operands, num_features: int | None = None):
    """:func:`check_call` for an eager call, skipped where the call repeats the layer's last one that passed it
    (:func:`repeats`). Returns that call's :class:`~tritonbn._core.call.CallRecord` (``settings.record``, made anew
    where the checks ran), or ``None`` for a call with a mask or an ``accumulate_stats`` sink, which are checked at
    every call.

    What the checks read is then unchanged: the layer's settings are rebuilt (no record) whenever one of them
    changes, and whenever the module moves or converts its tensors (``SyncBatchNorm._apply``); a parameter whose
    ``.data`` was set by hand to another shape, dtype or device is checked again.
    """
    t = operands
    if t.mask is not None or t.sink is not None:
        return check_call(settings, t, num_features)
    last = settings.record
    if last is not None and repeats(last, t, num_features):
        return last
    check_call(settings, t, num_features)
    w, b, rm, rv, nbt = t.weight, t.bias, t.running_mean, t.running_var, t.num_batches_tracked
    meta = call_meta(t.input, t.residual, w, b, rm, rv, nbt, num_features)
    settings.record = CallRecord(meta, w, b, rm, rv, nbt, {})
    return settings.record


def repeats(record: CallRecord, operands, num_features) -> bool:
    """Whether a call repeats the one ``record`` keeps: the very same parameter and buffer tensors, and the same
    :func:`call_meta`."""
    t = operands
    w, b, rm, rv, nbt = t.weight, t.bias, t.running_mean, t.running_var, t.num_batches_tracked
    if not (
        record.weight is w
        and record.bias is b
        and record.running_mean is rm
        and record.running_var is rv
        and record.num_batches_tracked is nbt
    ):
        return False
    return record.meta == call_meta(t.input, t.residual, w, b, rm, rv, nbt, num_features)


def call_meta(x, r, w, b, rm, rv, nbt, num_features) -> tuple:
    """What :func:`check_eager_call` compares between calls: the shape, strides, dtype and device of the input
    ``x`` and of the residual ``r``, the shapes, dtypes and devices of the parameters and buffers (``None`` for an
    absent one), and ``num_features``."""
    # one flat tuple, written out: this runs at every eager call (benchmarks/host_overhead.py times it)
    return (
        x.shape, x.stride(), x.dtype, x.device, num_features,
        None if r is None else r.shape, None if r is None else r.stride(), None if r is None else r.dtype,
        None if r is None else r.device,
        None if w is None else w.shape, None if w is None else w.dtype, None if w is None else w.device,
        None if b is None else b.shape, None if b is None else b.dtype, None if b is None else b.device,
        None if rm is None else rm.shape, None if rm is None else rm.dtype, None if rm is None else rm.device,
        None if rv is None else rv.shape, None if rv is None else rv.dtype, None if rv is None else rv.device,
        None if nbt is None else nbt.shape, None if nbt is None else nbt.dtype, None if nbt is None else nbt.device,
    )  # fmt: skip


def check_traced_call(*args) -> None:
    """:func:`check_call` under ``torch.jit.trace`` (and the TorchScript ONNX exporter, which traces with it).

    There sizes are traced values, and each comparison of one would warn (``TracerWarning``) that it becomes a
    constant of the trace. The checks are no data flow of the model: they run with the tracer paused, on the example
    input's sizes as Python ints (static checks, as in eager: a wrong call raises while tracing), and record nothing.
    """
    with tracer_paused():
        check_call(*args)
