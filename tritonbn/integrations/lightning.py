"""Lightning plugin: synchronized BatchNorm with tritonbn under any Lightning strategy.

    import tritonbn.lightning
    trainer = Trainer(strategy="ddp", plugins=[tritonbn.lightning.TritonSyncBatchNorm()])

:class:`TritonSyncBatchNorm` is a ``LayerSync`` plugin: Lightning calls ``apply`` (which is
:func:`tritonbn.convert_sync_batchnorm`) before fitting and ``revert``
(:func:`tritonbn.revert_sync_batchnorm`) after it. Unlike Lightning's ``sync_batchnorm=True``
it works on CPU (gloo) too (so does that switch after :func:`tritonbn.patch_sync_batchnorm`, which makes it
convert to tritonbn, though Lightning then reverts only torch's layers after fitting). Lightning accepts a
plugin only from its own namespace, so the class derives from the ``LayerSync`` of every namespace installed,
``lightning.pytorch`` and ``pytorch_lightning``, and either kind of ``Trainer`` takes it. This module imports
Lightning; ``import tritonbn`` does not.
"""

from __future__ import annotations

import importlib

from torch import nn

from tritonbn.convert import convert_sync_batchnorm, revert_sync_batchnorm

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def _layer_sync_bases() -> tuple[type, ...]:
    bases = []
    for namespace in NAMESPACES:
        try:
            bases.append(importlib.import_module(f"{namespace}.plugins.layer_sync").LayerSync)
        except ImportError:
            continue
    if not bases:
        raise ImportError("tritonbn.lightning needs Lightning: pip install lightning (or pytorch-lightning)")
    return tuple(bases)


class TritonSyncBatchNorm(*_layer_sync_bases()):
    """A ``LayerSync`` plugin that converts the model's BatchNorm layers to ``tritonbn.SyncBatchNorm``.

    ``process_group`` (default: the world group) and ``strict`` are passed to
    :func:`tritonbn.convert_sync_batchnorm`; ``revert`` restores the original classes.
    """

    def __init__(self, process_group=None, *, strict: bool = False) -> None:
        self.process_group = process_group
        self.strict = strict

    def apply(self, model: nn.Module) -> nn.Module:
        return convert_sync_batchnorm(model, self.process_group, strict=self.strict)

    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)
