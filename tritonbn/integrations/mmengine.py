"""OpenMMLab: tritonbn as the norm layer of mmengine-based configs (mmdetection, mmsegmentation, mmpretrain).

    import tritonbn.mmengine  # registers "TritonSyncBN" in mmengine's MODELS registry

    norm_cfg = dict(type="TritonSyncBN", requires_grad=True)  # where configs say type="SyncBN"

``mmcv.cnn.build_norm_layer(norm_cfg, C)`` then returns ``("bn", tritonbn.SyncBatchNorm(C))`` with
``requires_grad`` applied to its parameters, and the other keys (``eps``, ``momentum``,
``process_group``, ``activation``) passed to the constructor. Downstream registries (``mmdet.registry.MODELS``
and the like) are children of mmengine's ``MODELS``, so they find the name too. Import this module
before the model is built: in the training script, or with ``custom_imports =
dict(imports=["tritonbn.mmengine"])`` in the config. This module imports mmengine; ``import tritonbn``
does not.

mmengine's Runner leaves tritonbn layers alone when it is not distributed (its
``revert_sync_batchnorm`` only reverts ``torch.nn.SyncBatchNorm`` and mmcv's ``SyncBatchNorm``), but
its ``sync_bn="torch"`` option (``mmengine.model.convert_sync_batchnorm``) replaces every
BatchNorm, tritonbn's included, by ``torch.nn.SyncBatchNorm``, unless :func:`tritonbn.patch_sync_batchnorm`
was called first: then it converts plain ``BN`` layers to tritonbn's and keeps these. Without it, leave
``sync_bn`` unset.
"""

from __future__ import annotations

try:
    from mmengine.registry import MODELS
except ImportError as error:
    raise ImportError(
        "tritonbn.mmengine needs mmengine: pip install mmengine (and mmcv or mmcv-lite for mmcv.cnn.build_norm_layer)"
    ) from error

from tritonbn.modules import SyncBatchNorm

NAME = "TritonSyncBN"

if MODELS.module_dict.get(NAME) is not SyncBatchNorm:
    MODELS.register_module(NAME, module=SyncBatchNorm)

__all__ = ["NAME", "SyncBatchNorm"]
