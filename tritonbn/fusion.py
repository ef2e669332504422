"""Fuse ``BatchNorm -> activation`` and ``BatchNorm -> add -> activation`` into tritonbn modules.

:func:`fuse_batchnorm_activations` traces a model with ``torch.fx`` and rewrites two patterns:

* ``act(bn(x))`` becomes ``SyncBatchNorm(activation=act)(x)``;
* ``act(bn(x) + r)`` (``+``, ``+=``, ``torch.add``, ``.add``) becomes ``SyncBatchNorm(activation=act)(x, r)``,

where ``bn`` is any BatchNorm module whose output feeds nothing else, and ``act`` is ReLU, LeakyReLU
or SiLU, as a module, a function or a method. It says what it fused, and touches nothing else.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from tritonbn.modules import SyncBatchNorm, _move_state, name_layers

_ACT_MODULES = {nn.ReLU: "relu", nn.LeakyReLU: "leaky_relu", nn.SiLU: "silu"}
_ACT_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", torch.relu_: "relu", F.silu: "silu", F.leaky_relu: "leaky_relu"}
_ACT_METHODS = {"relu": "relu", "relu_": "relu"}
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
_ADD_METHODS = ("add", "add_")


def _activation(node: fx.Node, modules: dict) -> tuple[str, float] | None:
    """``(activation, negative_slope)`` when ``node`` applies a fusable activation to its first argument."""
    if node.op == "call_module" and type(modules[node.target]) in _ACT_MODULES:
        module = modules[node.target]
        return _ACT_MODULES[type(module)], float(getattr(module, "negative_slope", 0.01))
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


def _sole_batchnorm(node, modules: dict) -> bool:
    """A BatchNorm module call on one input whose output is used once."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_module"
        and isinstance(modules[node.target], _BatchNorm)
        and len(node.args) == 1
        and not node.kwargs
        and len(node.users) == 1
        and getattr(modules[node.target], "activation", None) is None
    )


def _fused_module(bn: _BatchNorm, activation: str, negative_slope: float) -> SyncBatchNorm:
    fused = SyncBatchNorm(
        bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
        getattr(bn, "process_group", None), device="meta", activation=activation, negative_slope=negative_slope,
    )  # fmt: skip
    return _move_state(bn, fused)


def fuse_batchnorm_activations(model: nn.Module) -> tuple[fx.GraphModule, list[str]]:
    """Return ``(fused_model, fused)``: ``model`` traced by ``torch.fx`` with its BatchNorm epilogues fused.

    ``fused`` lists one line per rewrite, such as ``"layer1.0.bn2 + add + relu"``. The fused modules
    are ``tritonbn.SyncBatchNorm`` (they synchronize across ranks in training, like converted ones)
    and share the original parameters and buffers. Outputs and gradients are unchanged. A model
    ``torch.fx`` cannot trace raises a ``ValueError``: apply the helper to its traceable parts (for
    example each residual block) instead.
    """
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:  # noqa: BLE001 - fx raises many kinds of errors on untraceable code
        raise ValueError(
            f"fuse_batchnorm_activations: torch.fx cannot trace {type(model).__name__} ({type(e).__name__}: {e}); "
            "apply it to the model's traceable submodules instead"
        ) from e
    modules = dict(gm.named_modules())
    fused = []
    for node in list(gm.graph.nodes):
        act = _activation(node, modules)
        if act is None or not node.args:
            continue
        source = node.args[0]
        if not isinstance(source, fx.Node) or len(source.users) != 1:
            continue
        add, residual = None, None
        if _is_add(source):
            first, second = source.args
            bn_node = first if _sole_batchnorm(first, modules) else second if _sole_batchnorm(second, modules) else None
            residual = second if bn_node is first else first
            if bn_node is None or not isinstance(residual, fx.Node):
                continue
            add = source
        elif _sole_batchnorm(source, modules):
            bn_node = source
        else:
            continue
        name = bn_node.target
        fused_bn = _fused_module(modules[name], *act)
        parent, _, leaf = name.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, leaf, fused_bn)
        modules[name] = fused_bn
        with gm.graph.inserting_after(node):
            args = (bn_node.args[0],) + ((residual,) if add is not None else ())
            replacement = gm.graph.call_module(name, args)
        node.replace_all_uses_with(replacement)
        for dead in (node, add, bn_node):
            if dead is not None:
                gm.graph.erase_node(dead)
        fused.append(f"{name} + add + {act[0]}" if add is not None else f"{name} + {act[0]}")
    gm.graph.lint()
    gm.recompile()
    name_layers(gm)  # the fused modules' debug-mode identity: their qualified names
    return gm, fused
