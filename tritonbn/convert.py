"""One call to swap a model's batch norms for tritonbn's, and one to swap them back.

:func:`convert_sync_batchnorm` replaces ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm``, sharing their
parameters and buffers, and never changes what a layer computes. timm's ``BatchNormAct2d`` is recognized by
structure (timm is not imported) and keeps its activation, fused into the kernels where they can compute it.
:func:`revert_sync_batchnorm` gives every converted layer its original class back.
"""

from __future__ import annotations

import warnings

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from tritonbn.activations import activation_of_module
from tritonbn.groups import syncbn_group
from tritonbn.modules import SyncBatchNorm, SyncBatchNormAct, name_layers

_ORIGINAL = "_tritonbn_original_class"
_TEMPLATE = "_tritonbn_original_module"  # a converted subclass instance, given back by revert
_PLAIN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _move_state(src: _BatchNorm, dst: _BatchNorm) -> _BatchNorm:
    """Give ``dst`` the very parameters and buffers of ``src``, and its mode."""
    if src.affine:
        dst.weight = src.weight
        dst.bias = src.bias
    if src.track_running_stats:
        dst.running_mean = src.running_mean
        dst.running_var = src.running_var
        dst.num_batches_tracked = src.num_batches_tracked
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig
    return dst


def _bias_kwargs(module: _BatchNorm) -> dict:
    """``bias=False`` when ``module`` has a weight without a bias (passed only then, for older torch)."""
    return {"bias": False} if module.affine and module.bias is None else {}


# --- conversion of torch's and timm's batch norms ----------------------------------------------------

_TIMM_NORM_ACT = ("BatchNormAct2d", "SyncBatchNormAct")  # timm.layers.norm_act, recognised by structure


def _forward_owner(module: nn.Module) -> type:
    """The class whose ``forward`` the module runs."""
    return next(c for c in type(module).__mro__ if "forward" in c.__dict__)


def is_timm_norm_act(module: nn.Module) -> bool:
    """timm's ``BatchNormAct2d`` / ``SyncBatchNormAct``: a BatchNorm that runs timm's forward,
    ``act(drop(batch_norm(x)))``, with exactly the children ``drop`` and ``act``. timm is not imported.
    """
    return (
        isinstance(module, _BatchNorm)
        and not isinstance(module, SyncBatchNorm)
        and _forward_owner(module).__name__ in _TIMM_NORM_ACT
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


def _why_not_converted(module: nn.Module) -> str | None:
    """Why ``module``, a BatchNorm, cannot become a tritonbn module that computes the same; ``None`` if it can."""
    if type(module) in _PLAIN or is_timm_norm_act(module):
        return None
    if not isinstance(module, _PLAIN):
        return "not a BatchNorm1d/2d/3d or SyncBatchNorm"
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(recurse=False)):
        return "uninitialized lazy module"
    if _forward_owner(module) not in _PLAIN and _forward_owner(module) is not _BatchNorm:
        return f"own forward ({_forward_owner(module).__name__}.forward)"
    if next(module.children(), None) is not None:
        return "has child modules"
    return None


def _synced(module: _BatchNorm, process_group, cls: type[SyncBatchNorm] = SyncBatchNorm, **kwargs) -> SyncBatchNorm:
    out = cls(
        module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, process_group,
        device="meta", **_bias_kwargs(module), **kwargs,
    )  # fmt: skip
    _move_state(module, out)
    setattr(out, _ORIGINAL, type(module))
    if type(module) not in _PLAIN:  # a subclass: revert gives this very module back, with the current state
        object.__setattr__(out, _TEMPLATE, module)
    return out


def _converted(module: _BatchNorm, process_group) -> SyncBatchNorm:
    """The tritonbn module computing what ``module`` computes (see :func:`_why_not_converted`)."""
    if not is_timm_norm_act(module):
        return _synced(module, process_group)
    fused = fused_activation(module)
    if fused is not None:
        return _synced(module, process_group, activation=fused[0], negative_slope=fused[1])
    return _synced(module, process_group, SyncBatchNormAct, drop=module.drop, act=module.act)


def unconverted_batchnorms(module: nn.Module) -> list[str]:
    """``"name (Class: reason)"`` for every BatchNorm that :func:`convert_sync_batchnorm` leaves alone."""
    return [
        f"{name or '<root>'} ({type(m).__name__}: {why})"
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) and not isinstance(m, SyncBatchNorm) and (why := _why_not_converted(m))
    ]


def _convert(module: nn.Module, process_group) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm) and _why_not_converted(module) is None:
        out = _converted(module, process_group)
    for name, child in module.named_children():
        out.add_module(name, _convert(child, process_group))
    return out


def convert_sync_batchnorm(
    module: nn.Module, process_group=None, *, group_size: int | None = None, strict: bool = False
) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` in ``module`` by :class:`SyncBatchNorm`.

    The new modules synchronize over ``process_group`` (default: the world), or, with
    ``group_size``, within groups of ``group_size`` consecutive ranks (:func:`tritonbn.syncbn_group`,
    a collective: every rank must convert with the same ``group_size``); ``group_size=1`` is local
    BatchNorm with tritonbn's kernels. Passing both is an error.

    The new modules share the original parameters and buffers (so device, dtype,
    ``requires_grad`` and optimizer references are kept) and the training mode, and remember the
    original class for :func:`revert_sync_batchnorm`. Other norms are left alone. Returns the
    converted module (``module`` itself, changed in place, unless ``module`` is a batch norm).

    Conversion never changes what a layer computes. A subclass that keeps torch's forward and has
    no children converts like its base class. timm's ``BatchNormAct2d`` and ``SyncBatchNormAct``
    (recognised by structure) become a :class:`SyncBatchNorm` with the fused activation when their
    ``act`` is ReLU, LeakyReLU, SiLU or Identity and their ``drop`` is Identity, and a
    :class:`SyncBatchNormAct` (the same ``drop`` and ``act`` children, applied after the kernels)
    otherwise. Any other BatchNorm (its own forward, child modules, another base class) is left
    alone, with one warning naming those layers, or a ``ValueError`` before anything changes when
    ``strict=True``.
    """
    if group_size is not None:
        if process_group is not None:
            raise ValueError(
                "convert_sync_batchnorm: pass process_group or group_size, not both "
                f"(got process_group={process_group!r} and group_size={group_size!r})"
            )
        process_group = syncbn_group(group_size)
    left = unconverted_batchnorms(module)
    if left:
        message = (
            f"convert_sync_batchnorm left {len(left)} BatchNorm layer(s) unconverted, since tritonbn cannot "
            f"compute what they compute; they will not synchronize across ranks: {', '.join(left)}"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message, UserWarning, stacklevel=2)
    out = _convert(module, process_group)
    name_layers(out)
    return out


def _reverted(module: SyncBatchNorm, default: type[_BatchNorm]) -> _BatchNorm:
    template = module.__dict__.get(_TEMPLATE)
    if template is not None:  # a converted subclass: the very original module, with the current state
        template.eps, template.momentum = module.eps, module.momentum
        if isinstance(template, nn.SyncBatchNorm):
            template.process_group = module.process_group
        return _move_state(module, template)
    if module.activation is not None:
        raise ValueError(
            f"cannot revert a SyncBatchNorm with a fused activation ({module.activation!r}) to a plain BatchNorm; "
            "rebuild the model without fusion first"
        )
    cls = getattr(module, _ORIGINAL, default)
    kwargs = {"process_group": module.process_group} if issubclass(cls, nn.SyncBatchNorm) else {}
    out = cls(
        module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, device="meta",
        **kwargs, **_bias_kwargs(module),
    )  # fmt: skip
    return _move_state(module, out)


def revert_sync_batchnorm(module: nn.Module, default: type[_BatchNorm] = nn.BatchNorm2d) -> nn.Module:
    """Replace every :class:`SyncBatchNorm` in ``module`` by the class it was converted from.

    A module built directly as ``tritonbn.SyncBatchNorm`` (no original class recorded) becomes
    ``default``. Parameters, buffers and training mode are shared, as in the conversion. A converted
    subclass (such as timm's ``BatchNormAct2d``, with its ``drop`` and ``act``) becomes its original
    module again. A module with a fused activation that was not converted from such a layer has no
    plain equivalent: reverting it raises a ``ValueError``.
    """
    out = _reverted(module, default) if isinstance(module, SyncBatchNorm) else module
    for name, child in module.named_children():
        out.add_module(name, revert_sync_batchnorm(child, default))
    return out
