"""The export lowering: under an exporting tracer, a call is recorded as torch's own ops (see :mod:`tritonbn.export`).

The dispatch (:func:`tritonbn._core.dispatch.run`) asks :func:`exporter` which tracer, if any, is recording the
call (the one hook, marked there), and then hands it to :func:`lowered`: torch's ``batch_norm``, then the fused
epilogue as ``add`` and ``relu`` / ``leaky_relu`` / ``silu``. The tracers are told apart so:

* ``torch.export`` (strict and non-strict, and so ``torch.onnx.export(dynamo=True)`` and
  AOTInductor, which go through it): :func:`tritonbn._compat.exporting`, the flag export sets. (The public
  ``torch.compiler.is_exporting()`` is true under ``torch.compile`` too on torch 2.8 to 2.11.)
* ``torch.jit.trace`` and ``torch.onnx.export(dynamo=False)``, which traces with it:
  ``torch.jit.is_tracing()``; ``torch.onnx.is_in_onnx_export()`` only names the exporter in messages.
* ``torch.compile`` (``torch.compiler.is_compiling()`` without ``exporting()``) keeps the
  custom ops: its speed comes from them. So do ``make_fx`` and other dispatch-mode tracers
  outside export: they are the machinery AOTAutograd builds on (``aot_module`` included), and
  there the custom ops carry the synchronization.

In eval the lowering is exact: the running statistics are constants. A training-mode export
(as QAT flows do) lowers to ``batch_norm`` over the local batch with a warning that the graph does
not synchronize, when the layer would not communicate anyway (no process group, or world size 1);
a layer that would synchronize raises an error naming the fix (``model.eval()``, or
``tritonbn.revert_sync_batchnorm``).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tritonbn._compat import exporting, jit_tracing
from tritonbn._core.checks import ACCUMULATE_EAGER_ONLY


def exporter(compiling: bool) -> str | None:
    """The exporting tracer this call runs under (a name for messages), or ``None``: run as usual.

    ``compiling`` is ``torch.compiler.is_compiling()``, which the caller has read already (true
    under ``torch.compile`` and ``torch.export`` alike). Cheap on the eager path: one more flag read.
    """
    if compiling:
        return "torch.export" if exporting() else None  # not torch.compiler.is_exporting(): see _compat.exporting
    if jit_tracing():  # torch.jit.is_tracing() (torch 2.8, 2.13); the TorchScript ONNX exporter traces with it
        return "torch.onnx.export" if torch.onnx.is_in_onnx_export() else "torch.jit.trace"
    return None


def lowered(how: str, layer, operands):
    """One call in torch's own ops, for the tracer ``how``: ``layer`` its settings, ``operands`` its tensors.

    The caller has checked the arguments. See the module docstring for what training mode does. A
    masked call (eval only) writes 0 at the padded positions with ``masked_fill``.
    """
    t = operands
    input, weight, bias, residual, mask = t.input, t.weight, t.bias, t.residual, t.mask
    running_mean, running_var, num_batches_tracked = t.running_mean, t.running_var, t.num_batches_tracked
    if t.sink is not None:
        raise RuntimeError(f"{ACCUMULATE_EAGER_ONLY}; it cannot run under {how}")
    if layer.batch_stats and mask is not None:
        raise RuntimeError(
            f"tritonbn: cannot export masked BatchNorm with batch statistics (training mode, or eval without running "
            f"statistics) under {how}: torch's batch_norm has no mask. Call model.eval() before exporting"
        )
    if layer.batch_stats:
        if layer.group is not None:
            raise RuntimeError(
                f"tritonbn: cannot export a training-mode SyncBatchNorm ({layer.name or 'functional call'}) under "
                f"{how}: it synchronizes its statistics over a process group of {layer.group.size()} ranks, and an "
                "exported graph cannot. Call model.eval() before exporting (inference uses the running statistics), "
                "or tritonbn.revert_sync_batchnorm(model) to export local BatchNorm"
            )
        if layer.momentum is None and running_mean is not None:
            raise RuntimeError(
                f"tritonbn: cannot export a training-mode SyncBatchNorm with momentum=None (cumulative average) "
                f"under {how}. Call model.eval() before exporting, or set a float momentum"
            )
        warnings.warn(  # (strict torch.export drops Python warnings while dynamo traces: then none is shown)
            f"tritonbn: a SyncBatchNorm that normalizes with batch statistics (training mode, or eval without "
            f"running statistics) becomes torch's batch_norm over each process's local batch when exported by {how}: "
            "the exported graph does not synchronize statistics across ranks",
            UserWarning,
            stacklevel=2,
        )
        if num_batches_tracked is not None and running_mean is not None:
            num_batches_tracked.add_(1)
    momentum = layer.momentum if layer.batch_stats and layer.momentum is not None else 0.0
    return in_torch_ops(layer, input, weight, bias, running_mean, running_var, residual, mask, momentum)


def in_torch_ops(layer, input, weight, bias, running_mean, running_var, residual, mask, momentum):
    """``act(batch_norm(input) + residual)`` in torch's own ops, ``momentum`` the running statistics' factor (what
    export tracers record, and what torch.func transforms batch and differentiate: :func:`under_transform`)."""
    out_dtype = input.dtype
    half_stats = layer.batch_stats and running_mean is not None and running_mean.dtype != torch.float32
    if input.dtype in (torch.float16, torch.bfloat16) and not half_stats:
        # As the kernels do: compute in fp32 and round once (fp32 running statistics are updated in place).
        input, weight, bias, residual = (None if t is None else t.float() for t in (input, weight, bias, residual))
        if not layer.batch_stats and running_mean is not None:
            running_mean, running_var = running_mean.float(), running_var.float()
    y = F.batch_norm(input, running_mean, running_var, weight, bias, layer.batch_stats, momentum, layer.eps)
    if residual is not None:
        y = y + residual
    if layer.activation == "relu":
        y = F.relu(y)
    elif layer.activation == "leaky_relu":
        y = F.leaky_relu(y, layer.negative_slope)
    elif layer.activation == "silu":
        y = F.silu(y)
    if mask is not None:
        y = y.masked_fill(~mask.unsqueeze(1), 0)
    return y if y.dtype == out_dtype else y.to(out_dtype)


TRANSFORM_SYNC = (
    "tritonbn: a training-mode SyncBatchNorm ({name}) cannot run under a torch.func transform (vmap, grad, jvp, "
    "jacrev, jacfwd, hessian) while it synchronizes its statistics over a process group of {ranks} ranks. Call it "
    "without the transform (torch.func.functional_call runs none; torch.autograd.grad and torch.autograd.forward_ad "
    "give gradients and tangents across ranks), put the layer in eval, or tritonbn.revert_sync_batchnorm(model) for "
    "BatchNorm over each rank's own batch"
)
TRANSFORM_MASK = (
    "tritonbn: masked BatchNorm (mask= or lengths=) cannot run under a torch.func transform (vmap, grad, jvp, "
    "jacrev, jacfwd, hessian): call it without the transform (torch.autograd.grad and torch.autograd.forward_ad "
    "give its gradients)"
)


def under_transform(layer, operands):
    """One call under a ``torch.func`` transform, in torch's own ops, which functorch batches and differentiates.

    What ``nn.BatchNorm*d`` computes there, as its forward computes it: eval with the running statistics, training
    with the batch's (each vmapped slice its own) updating the running statistics in place, ``momentum=None`` the
    cumulative average. Where torch's module fails (a running-statistics update that a ``grad`` transform captured,
    or that ``vmap`` would batch into an unbatched buffer), this fails with torch's error, named as tritonbn's. A
    layer that would synchronize across ranks, and a masked call, raise an error naming the way out.
    """
    t = operands
    if t.mask is not None:
        raise RuntimeError(TRANSFORM_MASK)
    if layer.group is not None:
        ranks = layer.group.size() if hasattr(layer.group, "size") else "several"  # (tritonbn.join's relay: the world)
        raise RuntimeError(TRANSFORM_SYNC.format(name=layer.name or "functional call", ranks=ranks))
    running_mean, running_var, count = t.running_mean, t.running_var, t.num_batches_tracked
    momentum, counted = 0.0, False
    try:
        if layer.batch_stats and running_mean is not None:
            if count is not None:
                count.add_(1)
                counted = True
            momentum = layer.momentum if layer.momentum is not None else 1.0 / float(count)
        return in_torch_ops(layer, t.input, t.weight, t.bias, running_mean, running_var, t.residual, None, momentum)
    except RuntimeError as error:
        if not layer.batch_stats or running_mean is None:
            raise
        if counted:  # a refused call changes no buffer (torch's module leaves its count one higher under vmap)
            count.sub_(1)
        raise RuntimeError(
            f"tritonbn: a training-mode SyncBatchNorm ({layer.name or 'functional call'}) cannot update its running "
            "statistics under this torch.func transform, as torch's nn.BatchNorm2d cannot (an in-place update of a "
            "buffer the transform captured, or momentum=None's count read on the host): call "
            "torch.func.replace_all_batch_norm_modules_(model) first (no running statistics), put the layer in eval, "
            "or, under vmap, pass stacked running statistics (functional_call with stack_module_state) with a float "
            f"momentum. torch says: {error}"
        ) from error


def script_error(module: nn.Module) -> RuntimeError:
    """The error ``torch.jit.script`` gets for a tritonbn module.

    ``SyncBatchNorm.__prepare_scriptable__`` raises it: an undocumented TorchScript hook that
    ``torch.jit.script`` calls on every module before compiling it (torch/jit/_script.py, torch 2.8 and
    2.13; torchvision uses it). A working scripted layer is not offered: the hook's result replaces the
    module inside the user's model, which would then no longer synchronize in training.
    """
    return RuntimeError(
        f"tritonbn: torch.jit.script cannot compile {type(module).__name__} (TorchScript is deprecated). "
        "Use torch.jit.trace, torch.export or torch.onnx.export on the model in eval mode (they record torch's own "
        "batch_norm), or script tritonbn.fold_batchnorm(model.eval()) or tritonbn.revert_sync_batchnorm(model)"
    )


def exported_keywords(module, exported: tuple, mask, lengths) -> tuple:
    """``(mask, lengths)`` of a call that ``torch.onnx.export(dynamo=False)`` makes on a bare layer.

    That exporter fills in every parameter of ``forward`` that the example leaves out, keyword-only ones included,
    positionally and in order (``_decide_input_format``): a layer exported alone is called ``forward(x, None, mask,
    lengths)``. Those two take the place of the keywords there; anywhere else ``mask`` and ``lengths`` are
    keyword-only, as the signature says.
    """
    if len(exported) > 2 or mask is not None or lengths is not None or not torch.onnx.is_in_onnx_export():
        raise TypeError(
            f"{type(module).__name__}.forward() takes the input (and, for SyncBatchNorm, a residual) positionally; "
            f"pass mask= and lengths= by keyword (got {len(exported)} more positional arguments)"
        )
    return (*exported, None)[:2]
