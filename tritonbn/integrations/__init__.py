"""Glue for training frameworks, each imported only when asked for: :mod:`tritonbn.lightning`
(Lightning's ``LayerSync`` plugin) and :mod:`tritonbn.mmengine` (``"TritonSyncBN"`` in OpenMMLab configs).

timm's ``BatchNormAct2d`` needs no import of timm: :func:`tritonbn.convert_sync_batchnorm` recognizes it by
structure (see :mod:`tritonbn.convert`).
"""
