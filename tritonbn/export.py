"""Export and serving: a model trained with tritonbn leaves through torch.export, ONNX and TorchScript tracing.

In eval, under an exporting tracer (``torch.export``, both ONNX exporters, AOTInductor, ``torch.jit.trace``),
each tritonbn layer records torch's own ``batch_norm`` and its epilogue's ops, so any consumer loads the
graph without tritonbn (:mod:`tritonbn._core.lowering` says how the tracers are told apart, and what a
training-mode export does). ``torch.compile`` keeps tritonbn's custom ops.

:func:`fold_batchnorm` folds eval-mode BatchNorms into the convolutions before them, for serving.
"""

from __future__ import annotations

import copy
import operator
import warnings

from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils.fusion import fuse_conv_bn_eval  # public; transpose= since 1.x (torch 2.8, 2.13)

from tritonbn.activations import activation_module
from tritonbn.fusion import _replace_module, trace_batchnorm_leaves
from tritonbn.modules import SyncBatchNorm, SyncBatchNormAct

# --- Folding: conv -> BatchNorm (-> add -> activation) for inference. -------------------------------

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _epilogue(bn: _BatchNorm) -> nn.Module | None:
    """What is left of ``bn`` once folded: its activation (``nn.Identity`` for none), ``None`` if not foldable."""
    forward = type(bn).forward
    if forward is SyncBatchNormAct.forward:
        return nn.Sequential(bn.drop, bn.act)
    if forward is SyncBatchNorm.forward:
        return activation_module(bn.activation, bn.negative_slope)
    if forward in (_BatchNorm.forward, nn.SyncBatchNorm.forward):
        return nn.Identity()
    return None  # a subclass with its own forward (such as timm's BatchNormAct2d): it may compute more


def _why_not_folded(node: fx.Node, modules: dict, calls: dict) -> str | None:
    """Why the BatchNorm call ``node`` cannot fold into the convolution before it; ``None`` if it can."""
    bn = modules[node.target]
    source = node.args[0] if node.args else None
    if bn.training:
        return "in training mode"
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return "no running statistics"
    if _epilogue(bn) is None:
        return f"own forward ({type(bn).__name__})"
    if calls[node.target] > 1:
        return "called more than once"
    if not (isinstance(source, fx.Node) and source.op == "call_module"):
        return "not after a convolution"
    conv = modules[source.target]
    if type(conv) not in _CONVS + _CONV_TRANSPOSES or conv.out_channels != bn.num_features:
        return "not after a convolution"
    if conv.training:
        return "its convolution is in training mode"
    if type(conv) in _CONV_TRANSPOSES and conv.groups != 1:
        return "after a grouped transposed convolution"  # fuse_conv_bn_eval scales its weight as ungrouped
    elsewhere = len(source.users) > 1 or any(a is source for a in (*node.args[1:], *node.kwargs.values()))
    if elsewhere or calls[source.target] > 1:  # a residual that is the convolution's output counts too
        return "its convolution's output is used elsewhere"
    return None


def fold_batchnorm(model: nn.Module) -> fx.GraphModule:
    """Return ``model`` traced by ``torch.fx``, with every eval-mode BatchNorm after a convolution folded into it.

    The convolution gets the BatchNorm's affine map in its weight and bias (torch's
    ``fuse_conv_bn_eval``), and the BatchNorm module is gone: a fused activation stays as a module of
    its own at the BatchNorm's name (``nn.ReLU``, ``nn.LeakyReLU``, ``nn.SiLU``), and a fused residual as
    an ``add`` node before it. It works on tritonbn's layers and torch's ``BatchNorm1d/2d/3d`` and
    ``SyncBatchNorm``. Outputs equal the eval-mode model's to float rounding.

    A BatchNorm that cannot fold (in training mode, without running statistics, not right after a
    convolution whose output it alone reads, called more than once, or a subclass with its own
    forward) stays as it is, named in one warning. ``model`` itself is not changed. A model
    ``torch.fx`` cannot trace raises a ``ValueError``: fold its traceable submodules instead.
    """
    model = copy.deepcopy(model)
    gm = trace_batchnorm_leaves(model, "fold_batchnorm", "fold its traceable submodules instead")
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    kept = []
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(modules[node.target], _BatchNorm):
            continue
        why = _why_not_folded(node, modules, calls)
        if why is not None:
            kept.append(f"{node.target} ({why})")
            continue
        bn, conv_node = modules[node.target], node.args[0]
        conv = modules[conv_node.target]
        folded = fuse_conv_bn_eval(conv, bn, transpose=type(conv) in _CONV_TRANSPOSES)
        _replace_module(gm, modules, conv_node.target, folded)
        epilogue = _epilogue(bn)
        last = conv_node
        with gm.graph.inserting_before(node):  # after the residual too
            residual = node.args[1] if len(node.args) > 1 else node.kwargs.get("residual")
            if residual is not None:  # tritonbn's fused residual
                last = gm.graph.call_function(operator.add, (last, residual))
            if type(epilogue) is nn.Identity:
                gm.delete_submodule(node.target)
            else:
                _replace_module(gm, modules, node.target, epilogue)
                last = gm.graph.call_module(node.target, (last,))
        node.replace_all_uses_with(last)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    if kept:
        warnings.warn(
            f"fold_batchnorm left {len(kept)} BatchNorm layer(s) as they are: {', '.join(kept)}",
            UserWarning,
            stacklevel=2,
        )
    return gm
