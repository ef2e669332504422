"""The frameworks' own sync-BN switches, routed to tritonbn: :func:`patch_sync_batchnorm` and its undo.

Ignite's ``auto_model(model, sync_bn=True)``, fastai's ``distrib_ctx()`` (``sync_bn=True`` by default) and
Lightning's ``Trainer(sync_batchnorm=True)`` call ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``. mmengine's
``sync_bn="torch"`` and timm's train script's ``--sync-bn`` call converters of their own, which build torch's
layer directly: ``mmengine.model.convert_sync_batchnorm`` and ``timm.layers.convert_sync_batchnorm``. The patch
replaces torch's classmethod and those two functions, under every name a loaded module holds them by, with
:func:`tritonbn.convert_sync_batchnorm`, which leaves tritonbn's layers alone; the undo puts back the very objects
it replaced. Nothing else of torch or of the frameworks changes.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings

from torch import nn

from tritonbn.modules import convert_sync_batchnorm

NAME = "convert_sync_batchnorm"
# The frameworks whose switch builds torch's layer itself, each as (package, module that defines the converter);
# checked on mmengine 0.10.7 and timm 1.0.31. A framework that is not installed is left out.
FRAMEWORKS = {"mmengine": "mmengine.model.utils", "timm": "timm.layers.norm_act"}

# While patched: {"replaced": [(owner, attribute, original)], "switches": {id(switch): (original, switch)}}.
_patched: dict | None = None


def _torch_switch(cls, module: nn.Module, process_group=None) -> nn.Module:
    """``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` while patched: :func:`tritonbn.convert_sync_batchnorm`."""
    return convert_sync_batchnorm(module, process_group)


def _switch(package: str, original):
    """The stand-in for ``package``'s converter ``original``, with its signature."""
    if package == "mmengine":

        def convert(module: nn.Module, implementation: str = "torch") -> nn.Module:
            """mmengine's converter while patched: ``"torch"`` gives tritonbn's layers; ``"mmcv"`` mmcv's, as before."""
            return convert_sync_batchnorm(module) if implementation == "torch" else original(module, implementation)

    else:

        def convert(module: nn.Module, process_group=None) -> nn.Module:
            """timm's converter while patched (its ``BatchNormAct2d`` keeps its activation, as tritonbn converts it)."""
            return convert_sync_batchnorm(module, process_group)

    return convert


def _loaded(package: str, home: str) -> types.ModuleType | None:
    """The module ``home`` of an installed ``package``, imported now; ``None`` where it is not installed, or,
    with a warning, where it cannot be imported (then nothing can call its converter either)."""
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return importlib.import_module(home)
    except Exception as error:  # such as timm beside a torchvision built for another torch
        warnings.warn(
            f"tritonbn.patch_sync_batchnorm: {package} is installed but {home} does not import "
            f"({type(error).__name__}: {error}); its converter is left as it is",
            UserWarning,
            stacklevel=3,
        )
        return None


def _rebind(swaps: dict, replaced: list) -> None:
    """In every loaded module but this one, replace each value whose id is a key of ``swaps`` by ``swaps[id][0]``."""
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType) or module.__name__ == __name__:
            continue
        for name, value in list(vars(module).items()):
            if id(value) in swaps and swaps[id(value)][1] is value:
                replaced.append((module, name, value))
                setattr(module, name, swaps[id(value)][0])


def _label(owner, name: str) -> str:
    return f"{owner.__module__}.{owner.__qualname__}.{name}" if isinstance(owner, type) else f"{owner.__name__}.{name}"


def patch_sync_batchnorm() -> list[str]:
    """Make the frameworks' sync-BN switches convert to tritonbn; returns what it patched.

    After it, ``torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=None)`` is
    :func:`tritonbn.convert_sync_batchnorm`: it converts ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` and timm's
    norm-act layers to tritonbn's, and leaves tritonbn's layers alone. So are mmengine's and timm's own converters
    where they are installed (imported here, so that modules imported later take the patched one). Ignite's
    ``auto_model(model, sync_bn=True)``, fastai's ``distrib_ctx()``, Lightning's ``sync_batchnorm=True``,
    mmengine's ``sync_bn="torch"`` and timm's ``train.py --sync-bn`` then give tritonbn's layers, which run on CPU
    (gloo) too. A second call does nothing; :func:`unpatch_sync_batchnorm` undoes it.

    Returns the names it replaced, such as ``"torch.nn.modules.batchnorm.SyncBatchNorm.convert_sync_batchnorm"``
    and ``"mmengine.model.convert_sync_batchnorm"`` (none when already patched).
    """
    global _patched
    if _patched is not None:
        return []
    replaced = [(nn.SyncBatchNorm, NAME, nn.SyncBatchNorm.__dict__[NAME])]
    setattr(nn.SyncBatchNorm, NAME, classmethod(_torch_switch))
    swaps = {}
    for package, home in FRAMEWORKS.items():
        original = getattr(_loaded(package, home), NAME, None)
        if original is not None:
            swaps[id(original)] = (_switch(package, original), original)
    _rebind(swaps, replaced)
    _patched = {"replaced": replaced, "switches": {id(new): (old, new) for new, old in swaps.values()}}
    return [_label(owner, name) for owner, name, _ in replaced]


def unpatch_sync_batchnorm() -> None:
    """Undo :func:`patch_sync_batchnorm`: torch's classmethod and the frameworks' converters are the very objects
    they were before it, also in modules imported since that took a patched converter by name. Does nothing when
    not patched."""
    global _patched
    if _patched is None:
        return
    patched, _patched = _patched, None
    for owner, name, original in reversed(patched["replaced"]):
        setattr(owner, name, original)
    _rebind(patched["switches"], [])  # modules imported while patched
