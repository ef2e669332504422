"""``import tritonbn.mmengine``: registers ``"TritonSyncBN"`` for OpenMMLab configs, at its kept import path.

See :mod:`tritonbn.integrations.mmengine`.
"""

from tritonbn.integrations.mmengine import NAME, SyncBatchNorm

__all__ = ["NAME", "SyncBatchNorm"]
