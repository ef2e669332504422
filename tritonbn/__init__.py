"""tritonbn: synchronized batch normalization for PyTorch, as Triton kernels.

* :class:`SyncBatchNorm`: a drop-in for ``torch.nn.SyncBatchNorm`` and ``nn.BatchNorm*d``.
* :func:`convert_sync_batchnorm` / :func:`revert_sync_batchnorm`: swap a model's batch norms.
* :func:`syncbn_group`: node-local BatchNorm groups of ``group_size`` consecutive ranks.
* :func:`sync_batch_norm`: the functional form.
* :func:`fuse_batchnorm_activations`: fuse BatchNorm -> (add ->) activation into tritonbn modules.
* :func:`fold_batchnorm`: fold eval-mode BatchNorms into the convolutions before them, for serving
  (torch.export, ONNX and jit.trace see torch's own ops anyway: :mod:`tritonbn.export`).
* :mod:`tritonbn.diagnose`, :func:`sync_running_stats`, :func:`recalibrate_batchnorm`: find and
  repair BatchNorm statistics that drifted apart across ranks.
* :mod:`tritonbn.kernels`: the Triton launchers, for custom layers.
* :func:`accumulate_stats`: one running-statistics update per optimizer step under gradient accumulation.
* :func:`explain`: which route (backend, path, synchronization) each BatchNorm layer of a model takes, and why.
* :func:`check`, :class:`OutOfStepError`: ranks that call their BatchNorms out of step (:mod:`tritonbn.lockstep`).
* :func:`join`: ranks with different numbers of batches, as torch's ``Join`` (DDP's) with tritonbn's BatchNorms.
* :func:`patch_sync_batchnorm` / :func:`unpatch_sync_batchnorm`: the frameworks' own sync-BN switches (Ignite, fastai,
  Lightning, mmengine, timm's train script) give tritonbn's layers.
* :mod:`tritonbn.lightning`: the Lightning plugin ``TritonSyncBatchNorm`` (imported on first use).
* :mod:`tritonbn.mmengine`: ``"TritonSyncBN"`` for OpenMMLab configs (imported on first use).

Set ``TRITONBN_BACKEND=auto|triton|torch`` to choose the implementation (see :mod:`tritonbn.backend`).
"""

from importlib.metadata import PackageNotFoundError, version

from tritonbn import diagnose
from tritonbn._explain import explain
from tritonbn.convert import convert_sync_batchnorm, revert_sync_batchnorm
from tritonbn.export import fold_batchnorm
from tritonbn.functional import sync_batch_norm
from tritonbn.fusion import fuse_batchnorm_activations
from tritonbn.groups import syncbn_group
from tritonbn.lockstep import OutOfStepError, check
from tritonbn.modules import SyncBatchNorm
from tritonbn.patching import patch_sync_batchnorm, unpatch_sync_batchnorm
from tritonbn.running_stats import accumulate_stats, recalibrate_batchnorm, sync_running_stats
from tritonbn.uneven import join

try:
    __version__ = version("tritonbn")  # the one version source: pyproject.toml, through the installed metadata
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    if name in ("lightning", "mmengine"):  # they import Lightning / mmengine, so only when asked for
        import importlib

        return importlib.import_module(f"tritonbn.{name}")
    raise AttributeError(f"module 'tritonbn' has no attribute {name!r}")


__all__ = [
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "syncbn_group",
    "sync_batch_norm",
    "fuse_batchnorm_activations",
    "fold_batchnorm",
    "sync_running_stats",
    "recalibrate_batchnorm",
    "accumulate_stats",
    "join",
    "explain",
    "patch_sync_batchnorm",
    "unpatch_sync_batchnorm",
    "check",
    "OutOfStepError",
    "diagnose",
    "__version__",
]
