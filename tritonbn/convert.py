"""The conversions' kept import path: :func:`convert_sync_batchnorm` and :func:`revert_sync_batchnorm` live beside
the class, in :mod:`tritonbn.modules`."""

from tritonbn.modules import convert_sync_batchnorm, revert_sync_batchnorm, unconverted_batchnorms

__all__ = ["convert_sync_batchnorm", "revert_sync_batchnorm", "unconverted_batchnorms"]
