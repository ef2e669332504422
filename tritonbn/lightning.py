"""``import tritonbn.lightning``: the Lightning plugin, at its kept import path.

See :mod:`tritonbn.integrations.lightning`.
"""

from tritonbn.integrations.lightning import NAMESPACES, TritonSyncBatchNorm

__all__ = ["NAMESPACES", "TritonSyncBatchNorm"]
