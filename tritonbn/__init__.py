"""tritonbn: synchronized batch normalization for PyTorch, as Triton kernels.

* :class:`SyncBatchNorm`: a drop-in for ``torch.nn.SyncBatchNorm`` and ``nn.BatchNorm*d``.
* :func:`convert_sync_batchnorm` / :func:`revert_sync_batchnorm`: swap a model's batch norms.
* :func:`sync_batch_norm`: the functional form.
* :mod:`tritonbn.kernels`: the Triton launchers, for custom layers.

Set ``TRITONBN_BACKEND=auto|triton|torch`` to choose the implementation (see :mod:`tritonbn.backend`).
"""

from tritonbn.functional import sync_batch_norm
from tritonbn.modules import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm

__version__ = "0.1.0"

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm", "sync_batch_norm", "__version__"]
