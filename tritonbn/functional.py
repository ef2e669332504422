"""The functional form, :func:`sync_batch_norm`, and the dispatch every call goes through (:func:`run`).

A call is checked (:mod:`tritonbn._checks`), then runs one of four ways, each over the same two passes
(:mod:`tritonbn._passes`, where the data path and the gradient derivation are written out):

* under an exporting tracer (``torch.export``, ONNX, ``jit.trace``): torch's own ops (:mod:`tritonbn._export`);
* eager, with autograd: :class:`tritonbn._eager.EagerBatchNormFunction`, straight over the launchers (on
  the PyTorch backend, a layer that synchronizes with nobody runs torch's own ops instead, which autograd
  records itself: :func:`tritonbn._torch_local.local_autograd`);
* compiled, traced, or under a transform or dispatch mode: the custom ops (:mod:`tritonbn._custom_ops`);
* without autograd (inference, or nothing needs a gradient): :func:`tritonbn._passes.forward_pass` alone.
"""

from __future__ import annotations

import torch

from tritonbn._checks import ACCUMULATE_EAGER_ONLY, check_call, check_traced_call, mask_from_lengths, signature
from tritonbn._compat import forward_ad_active, functorch_transforms_active
from tritonbn._custom_ops import SyncBatchNormFunction, SyncBatchNormFunctionForwardAD, group_name
from tritonbn._eager import apply_eager, is_eager, params_need_grad
from tritonbn._export import exporter, lowered
from tritonbn._passes import Layer, forward_pass, synchronizes_with_nobody
from tritonbn.backend import ops_for
from tritonbn.distributed import check_signature, debug_enabled, resolve_group


def batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
    group,
    num_batches_tracked: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    negative_slope: float = 0.01,
    num_features: int | None = None,
    debug_group=None,
    name: str = "",
    stats_sink: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Checked entry point of :func:`sync_batch_norm`: :func:`run` with a :class:`Layer` made for this call.

    ``group`` (resolved) is what the statistics are synchronized over, ``None`` for this rank alone.
    ``debug_group`` (default ``group``) is what ``TRITONBN_DEBUG=1`` checks signatures over.
    ``name`` is the layer's identity in those checks. ``stats_sink``: see :func:`forward_pass`.
    """
    layer = Layer(training, momentum, eps, activation, negative_slope, group, debug_group, name)
    return run(layer, input, weight, bias, running_mean, running_var, num_batches_tracked, residual, num_features,
               stats_sink, mask)  # fmt: skip


def run(
    layer: Layer,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    num_features: int | None = None,
    stats_sink: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One call of ``layer`` on these tensors: the checks, then the eager Function, the custom ops, or no autograd.

    Every argument a rank can get wrong alone is checked first; with ``TRITONBN_DEBUG=1`` the ranks
    of ``layer.debug_group`` then compare signatures, so that a rank whose input was rejected makes
    every rank raise instead of leaving them waiting in the next collective. ``stats_sink``: see
    :func:`forward_pass` (eager calls only). ``mask``: masked BatchNorm, see :func:`sync_batch_norm`.
    """
    training = layer.training
    debug_group = layer.debug_group
    compiling = torch.compiler.is_compiling()
    checking = debug_group is not None and not compiling and debug_enabled()
    grad_mode = torch.is_grad_enabled()
    input_grad = grad_mode and isinstance(input, torch.Tensor) and input.requires_grad
    # THE export hook (taken after the checks): torch.export, ONNX, jit.trace record torch's own ops
    how = exporter(compiling)
    checks = check_traced_call if how is not None and not compiling else check_call  # jit.trace: sizes are traced
    try:
        checks(layer, input, weight, bias, running_mean, running_var, num_batches_tracked, residual, num_features,
               mask)  # fmt: skip
    except (ValueError, TypeError) as error:
        if checking:  # every rank stops here, instead of the others waiting in the next collective
            check_signature(debug_group, "forward", signature(input, training, input_grad), local_error=error,
                            name=layer.name)  # fmt: skip
        raise
    if checking:
        check_signature(debug_group, "forward", signature(input, training, input_grad), name=layer.name)
    if how is not None:
        return lowered(how, layer, input, weight, bias, running_mean, running_var, num_batches_tracked, residual,
                       stats_sink, mask)  # fmt: skip
    if compiling or not is_eager(input):
        if stats_sink is not None:
            raise RuntimeError(ACCUMULATE_EAGER_ONLY)
        if not compiling and functorch_transforms_active():
            raise RuntimeError(
                "tritonbn does not support torch.func transforms (vmap, grad, jvp, jacrev, jacfwd, hessian): use "
                "torch.autograd.grad (create_graph=True for higher orders) and torch.autograd.forward_ad instead, "
                "or torch.func.functional_call, which runs without a transform"
            )
        function = SyncBatchNormFunction
        if forward_ad_active():
            if compiling:
                raise RuntimeError(
                    "tritonbn does not support forward-mode AD (torch.autograd.forward_ad) under torch.compile: "
                    "call the layer uncompiled"
                )
            function = SyncBatchNormFunctionForwardAD
        return function.apply(
            input, weight, bias, residual, running_mean, running_var, num_batches_tracked, training, layer.momentum,
            layer.eps, layer.activation, float(layer.negative_slope), group_name(layer.group), layer.name, mask,
        )  # fmt: skip
    ops = ops_for(input)
    if input_grad or (grad_mode and params_need_grad(weight, bias, residual)) or forward_ad_active():
        # The PyTorch backend's local path, recorded by autograd itself (None for the kernels). Forward-mode AD
        # keeps the Function: an outer torch.compile resumed after its graph break would trace these ops
        local = ops.local_autograd
        if local is not None and synchronizes_with_nobody(layer, residual, mask) and not forward_ad_active():
            y = local(layer, input, weight, bias, running_mean, running_var, num_batches_tracked, stats_sink)
            if y is not None:
                return y
        nondiff = (ops, layer, running_mean, running_var, num_batches_tracked, stats_sink, mask)
        return apply_eager(input, weight, bias, residual, nondiff)
    return forward_pass(
        ops, layer, input, weight, bias, running_mean, running_var, num_batches_tracked, residual, save_stats=False,
        stats_sink=stats_sink, mask=mask,
    )[0]  # fmt: skip


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
    group = resolve_group(process_group) if training else None
    if lengths is not None:
        mask = mask_from_lengths(input, lengths, mask)
    return batch_norm(
        input, running_mean, running_var, weight, bias, training, momentum, eps, group, num_batches_tracked,
        residual=residual, activation=activation, negative_slope=negative_slope, mask=mask,
    )  # fmt: skip
