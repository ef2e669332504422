"""The functional form, :func:`sync_batch_norm`: one call of the dispatch (:mod:`tritonbn._core.dispatch`)."""

from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function

from tritonbn._core.call import settings_for
from tritonbn._core.checks import mask_from_lengths
from tritonbn._core.dispatch import run
from tritonbn.backends.launchers import Operands
from tritonbn.distributed import resolve_group


def batch_norm(
    input, running_mean, running_var, weight, bias, training, momentum, eps, group, num_batches_tracked=None, **call
) -> torch.Tensor:
    """:func:`sync_batch_norm` over an already resolved ``group`` (``None``: this rank alone), for the benchmarks
    and :func:`tritonbn.recalibrate_batchnorm`; ``call``: its keywords ``residual``, ``activation``,
    ``negative_slope``, ``mask``, and ``stats_sink`` (see :func:`tritonbn.accumulate_stats`); any other is an
    error, as for a function that names them."""
    activation, slope = call.pop("activation", None), call.pop("negative_slope", 0.01)
    tensors = (num_batches_tracked, call.pop("residual", None), call.pop("mask", None), call.pop("stats_sink", None))
    if call:
        raise TypeError(f"tritonbn batch_norm() got unexpected keyword arguments: {', '.join(sorted(call))}")
    settings = settings_for(training, momentum, eps, activation, slope, group, debug_group=group)
    return run(settings, Operands(input, weight, bias, running_mean, running_var, *tensors))


def sync_batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    process_group=None,
    *,
    num_batches_tracked: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    negative_slope: float = 0.01,
    mask: torch.Tensor | None = None,
    lengths=None,
) -> torch.Tensor:
    """Batch norm whose training statistics cover the global batch of ``process_group``.

    Arguments follow :func:`torch.nn.functional.batch_norm`. In training the batch statistics are
    summed over ``process_group`` (default: the world group) with one all-reduce, and the
    running statistics, when given, are updated in place on the device. ``momentum=None`` is a
    cumulative average and needs ``num_batches_tracked`` (``() int64``, incremented in place).
    Without an initialized process group, or at world size 1, this is plain batch norm.

    The fused epilogue computes ``act(batch_norm(input) + residual)`` inside the kernels:
    ``residual`` is a tensor shaped like ``input`` (it gets its gradient), ``activation`` one of
    ``None``, ``"relu"``, ``"leaky_relu"`` (with ``negative_slope``) or ``"silu"``.

    Masked batch norm, for padded batches: ``mask`` is a bool tensor of shape ``(N, *S)`` (the input's
    shape without its channel dimension) on the input's device, True at real positions. The statistics
    (and the running statistics' update) then cover the real positions of the global batch only, and
    the output and the input's gradient are 0 at the padded ones. For ``(N, C, L)`` inputs ``lengths``
    (``(N,)`` integers, a tensor or a sequence) builds the mask: position ``l`` of item ``i`` is real when
    ``l < lengths[i]``.
    """
    if type(input) is not torch.Tensor:  # torch's protocol for tensor subclasses, as F.batch_norm follows it
        tensors = (input, running_mean, running_var, weight, bias, num_batches_tracked, residual, mask)
        if has_torch_function(tensors):
            return handle_torch_function(
                sync_batch_norm,
                tensors,
                input,
                running_mean,
                running_var,
                weight,
                bias,
                training,
                momentum,
                eps,
                process_group,
                num_batches_tracked=num_batches_tracked,
                residual=residual,
                activation=activation,
                negative_slope=negative_slope,
                mask=mask,
                lengths=lengths,
            )
    if lengths is not None:
        mask = mask_from_lengths(input, lengths, mask)
    group = resolve_group(process_group) if training else None
    epilogue = {"residual": residual, "activation": activation, "negative_slope": negative_slope, "mask": mask}
    return batch_norm(
        input, running_mean, running_var, weight, bias, training, momentum, eps, group, num_batches_tracked, **epilogue
    )
