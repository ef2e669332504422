"""Fuse ``BatchNorm -> activation`` and ``BatchNorm -> add -> activation`` into tritonbn modules.

:func:`fuse_batchnorm_activations` traces a model with ``torch.fx`` and rewrites two patterns:

* ``act(bn(x))`` becomes ``SyncBatchNorm(activation=act)(x)``;
* ``act(bn(x) + r)`` (``+``, ``+=``, ``torch.add``, ``.add``) becomes ``SyncBatchNorm(activation=act)(x, r)``,

where ``bn`` is any BatchNorm module whose output feeds nothing else, and ``act`` is ReLU, LeakyReLU
or SiLU, as a module, a function or a method. ``nn.Identity`` modules in between are looked
through, and so is ``nn.Dropout`` (any mode) before a ReLU or LeakyReLU, which is moved after the
fused module: both scale by non-negative factors, so the order does not matter. It says what it
fused, and touches nothing else.

Every BatchNorm module is traced as a leaf (one ``call_module`` node), so none is inlined, no
``training`` flag is baked into the graph, no forward runs while tracing, and the result keeps every
BatchNorm module and buffer. timm's ``BatchNormAct2d``/``SyncBatchNormAct`` with a fusable
activation become fused modules; other BatchNorm subclasses with their own forward stay as they are.
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from tritonbn._norm_layers import PLAIN, fused_activation, move_state
from tritonbn.activations import activation_of_module
from tritonbn.modules import PLAIN_SYNCED, SyncBatchNorm, name_layers

_ACT_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", torch.relu_: "relu", F.silu: "silu", F.leaky_relu: "leaky_relu"}
_ACT_METHODS = {"relu": "relu", "relu_": "relu"}
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
_ADD_METHODS = ("add", "add_")
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_BATCH_NORM_FUNCTIONS = (F.batch_norm, torch.batch_norm, torch.native_batch_norm)


class _BatchNormLeafTracer(fx.Tracer):
    """fx's tracer, with every BatchNorm module (any subclass) kept whole as one ``call_module`` node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, _BatchNorm) or super().is_leaf_module(m, module_qualified_name)


def trace_batchnorm_leaves(model: nn.Module, caller: str, instead: str) -> fx.GraphModule:
    """``model`` traced by ``torch.fx`` with every BatchNorm kept whole; a ``ValueError`` naming ``caller`` and
    what to do ``instead`` when fx cannot trace it."""
    tracer = _BatchNormLeafTracer()
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - fx raises many kinds of errors on untraceable code
        raise ValueError(
            f"{caller}: torch.fx cannot trace {type(model).__name__} ({type(e).__name__}: {e}); {instead}"
        ) from e
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _trace(model: nn.Module) -> fx.GraphModule:
    gm = trace_batchnorm_leaves(
        model, "fuse_batchnorm_activations", "apply it to the model's traceable submodules instead"
    )
    baked = [str(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in _BATCH_NORM_FUNCTIONS]
    if baked:
        raise ValueError(
            f"fuse_batchnorm_activations: {type(model).__name__} calls batch_norm as a function ({', '.join(baked)}); "
            "torch.fx would bake its training flag into the graph. Apply the helper to submodules without it"
        )
    return gm


def _activation(node: fx.Node, modules: dict) -> tuple[str, float] | None:
    """``(activation, negative_slope)`` when ``node`` applies a fusable activation to its first argument."""
    if node.op == "call_module" and (found := activation_of_module(modules[node.target])) is not None:
        return found
    if node.op == "call_function" and node.target in _ACT_FUNCTIONS:
        name = _ACT_FUNCTIONS[node.target]
        slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1 else 0.01)
        return name, float(slope) if name == "leaky_relu" else 0.01
    if node.op == "call_method" and node.target in _ACT_METHODS and len(node.args) == 1:
        return _ACT_METHODS[node.target], 0.01
    return None


def _is_add(node: fx.Node) -> bool:
    plain = not node.kwargs and len(node.args) == 2
    return plain and (
        (node.op == "call_function" and node.target in _ADD_FUNCTIONS)
        or (node.op == "call_method" and node.target in _ADD_METHODS)
    )


def _plain_batchnorm(module: nn.Module) -> bool:
    """A BatchNorm that computes batch norm and nothing after it."""
    if isinstance(module, SyncBatchNorm):
        return type(module) in PLAIN_SYNCED and module.activation is None
    return type(module) in PLAIN


def _sole_batchnorm(node, modules: dict) -> bool:
    """A plain BatchNorm module call on one input whose output is used once."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_module"
        and _plain_batchnorm(modules[node.target])
        and len(node.args) == 1
        and not node.kwargs
        and len(node.users) == 1
    )


def _passthrough(node, modules: dict, dropout_ok: bool) -> bool:
    """An ``nn.Identity`` call (or a dropout, when ``dropout_ok``) whose output is used once."""
    if not (isinstance(node, fx.Node) and node.op == "call_module" and len(node.users) == 1 and len(node.args) == 1):
        return False
    kind = type(modules[node.target])
    return kind is nn.Identity or (dropout_ok and kind in _DROPOUTS)


def _skip_back(node, modules: dict, dropout_ok: bool) -> tuple[object, list[fx.Node]]:
    """Walk from ``node`` back through pass-through modules: ``(first other node, the pass-through nodes)``."""
    chain = []
    while _passthrough(node, modules, dropout_ok):
        chain.append(node)
        node = node.args[0]
    return node, chain


def _fused_module(bn: _BatchNorm, activation: str | None, negative_slope: float) -> SyncBatchNorm:
    fused = SyncBatchNorm(
        bn.num_features,
        bn.eps,
        bn.momentum,
        bn.affine,
        bn.track_running_stats,
        getattr(bn, "process_group", None),
        device="meta",
        activation=activation,
        negative_slope=negative_slope,
        **({"bias": False} if bn.affine and bn.bias is None else {}),
    )
    return move_state(bn, fused)


def _replace_module(gm: fx.GraphModule, modules: dict, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, leaf, new)
    modules[name] = new


def _fuse_timm_layers(gm: fx.GraphModule, modules: dict) -> tuple[list[str], list[str]]:
    """Replace timm norm-act layers with a fusable ``act`` (Identity included) by fused modules.

    Returns ``(one line per replacement, the other BatchNorm subclasses, with their own forward)``.
    """
    fused, kept = [], []
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], _BatchNorm):
            continue
        module = modules[node.target]
        act = fused_activation(module)
        if act is not None:
            _replace_module(gm, modules, node.target, _fused_module(module, *act))
            fused.append(f"{node.target} ({type(module).__name__})" + (f" + {act[0]}" if act[0] else ""))
        elif not _plain_batchnorm(module) and not isinstance(module, SyncBatchNorm):
            kept.append(f"{node.target} ({type(module).__name__})")
    return fused, kept


def fuse_batchnorm_activations(model: nn.Module) -> tuple[fx.GraphModule, list[str]]:
    """Return ``(fused_model, fused)``: ``model`` traced by ``torch.fx`` with its BatchNorm epilogues fused.

    ``fused`` lists one line per rewrite, such as ``"layer1.0.bn2 + add + relu"`` (or
    ``"bn1 (BatchNormAct2d) + silu"`` for a timm norm-act layer). The fused modules are
    ``tritonbn.SyncBatchNorm`` (they synchronize across ranks in training, like converted ones)
    and share the original parameters and buffers. Outputs and gradients are unchanged, in training
    and in eval. Other BatchNorm subclasses with their own forward are kept whole, and named in one
    warning. ``model`` itself is not changed, its buffers included. A model ``torch.fx`` cannot trace,
    or one that calls ``batch_norm`` as a function, raises a ``ValueError``: apply the helper to its
    traceable parts (for example each residual block) instead.
    """
    gm = _trace(model)
    modules = dict(gm.named_modules())
    fused, kept = _fuse_timm_layers(gm, modules)
    for node in list(gm.graph.nodes):
        act = _activation(node, modules)
        if act is None or not node.args:
            continue
        source, between = _skip_back(node.args[0], modules, dropout_ok=act[0] in ("relu", "leaky_relu"))
        if not isinstance(source, fx.Node) or len(source.users) != 1:
            continue
        add, residual, before_add = None, None, []
        if _is_add(source):
            first, second = (_skip_back(a, modules, dropout_ok=False) for a in source.args)
            bn_side, other = (first, second) if _sole_batchnorm(first[0], modules) else (second, first)
            if not _sole_batchnorm(bn_side[0], modules):
                continue
            bn_node, before_add = bn_side
            residual = source.args[1] if bn_side is first else source.args[0]
            if not isinstance(residual, fx.Node):
                continue
            add = source
        elif _sole_batchnorm(source, modules):
            bn_node = source
        else:
            continue
        name = bn_node.target
        _replace_module(gm, modules, name, _fused_module(modules[name], *act))
        with gm.graph.inserting_after(node):
            args = (bn_node.args[0],) + ((residual,) if add is not None else ())
            replacement = gm.graph.call_module(name, args)
        last = replacement
        for dropout in reversed([n for n in between if type(modules[n.target]) is not nn.Identity]):
            with gm.graph.inserting_after(last):
                last = gm.graph.call_module(dropout.target, (last,))
        node.replace_all_uses_with(last)
        for dead in (node, *between, add, *before_add, bn_node):
            if dead is not None:
                gm.graph.erase_node(dead)
        fused.append(f"{name} + add + {act[0]}" if add is not None else f"{name} + {act[0]}")
    gm.graph.lint()
    gm.recompile()
    name_layers(gm)  # the fused modules' debug-mode identity: their qualified names
    if kept:
        warnings.warn(
            f"fuse_batchnorm_activations kept {len(kept)} BatchNorm layer(s) with their own forward as they are "
            f"(not fused): {', '.join(kept)}",
            UserWarning,
            stacklevel=2,
        )
    return gm, fused
