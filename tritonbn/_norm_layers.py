"""Which batch norms a conversion takes, and what they compute: torch's own classes, and timm's norm-act layers
recognized by structure (timm is not imported). Used by :mod:`tritonbn.modules` and :mod:`tritonbn.fusion`.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from tritonbn.activations import activation_of_module

PLAIN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_TIMM_NORM_ACT = ("BatchNormAct2d", "SyncBatchNormAct")  # timm.layers.norm_act, recognised by structure


def forward_owner(module: nn.Module) -> type:
    """The class whose ``forward`` the module runs."""
    return next(c for c in type(module).__mro__ if "forward" in c.__dict__)


def is_tritonbn(module: nn.Module) -> bool:
    """Whether ``module`` is one of tritonbn's own layers (their classes live in this package)."""
    return any(c.__module__.startswith("tritonbn.") for c in type(module).__mro__)


def is_timm_norm_act(module: nn.Module) -> bool:
    """timm's ``BatchNormAct2d`` / ``SyncBatchNormAct``: a BatchNorm that runs timm's forward,
    ``act(drop(batch_norm(x)))``, with exactly the children ``drop`` and ``act``. timm is not imported.
    """
    return (
        isinstance(module, _BatchNorm)
        and not is_tritonbn(module)
        and forward_owner(module).__name__ in _TIMM_NORM_ACT
        and {name for name, _ in module.named_children()} == {"drop", "act"}
    )


def fused_activation(module: nn.Module) -> tuple[str | None, float] | None:
    """``(activation, negative_slope)`` the kernels compute for a timm norm-act layer, or ``None``
    when its ``drop`` or ``act`` is not one they fuse (only ``nn.Identity`` drop; ReLU, LeakyReLU,
    SiLU or Identity act).
    """
    if not is_timm_norm_act(module) or type(module.drop) is not nn.Identity:
        return None
    if type(module.act) is nn.Identity:
        return None, 0.01
    return activation_of_module(module.act)


def why_not_converted(module: nn.Module) -> str | None:
    """Why ``module``, a BatchNorm, cannot become a tritonbn module that computes the same; ``None`` if it can."""
    if type(module) in PLAIN or is_timm_norm_act(module):
        return None
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(recurse=False)):
        return "uninitialized lazy module: call the model once (a dry run) before converting"
    if not isinstance(module, PLAIN):
        return "not a BatchNorm1d/2d/3d or SyncBatchNorm"
    if forward_owner(module) not in PLAIN and forward_owner(module) is not _BatchNorm:
        return f"own forward ({forward_owner(module).__name__}.forward)"
    if next(module.children(), None) is not None:
        return "has child modules"
    return None


def move_state(src: _BatchNorm, dst: _BatchNorm) -> _BatchNorm:
    """Give ``dst`` the very parameters and buffers of ``src`` (running statistics kept by a layer whose
    ``track_running_stats`` was turned off after construction, which eval still reads, and buffers set to ``None``
    included), and its mode."""
    if src.affine:
        dst.weight = src.weight
        dst.bias = src.bias
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        setattr(dst, name, src._buffers.get(name))
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig
    return dst


def bias_kwargs(module: _BatchNorm) -> dict:
    """``bias=False`` when ``module`` has a weight without a bias (passed only then, for older torch)."""
    return {"bias": False} if module.affine and module.bias is None else {}
