"""The Triton backend: the four launchers over the Triton kernels, one module per pass (public as
:mod:`tritonbn.kernels`, whose docstring shows a training step).

``stats.py``, ``elemt.py``, ``backward_reduce.py``, ``backward_elemt.py``: each pass's kernel and launcher;
``_common.py`` the tile code they share; ``_plan.py`` block sizes and grids (``_tiles.py``, its tile shapes);
``_workspace.py`` partials and tickets; ``_launch.py`` the direct launch of a compiled kernel; ``_prepared.py``
the launches of one layer's eager calls, found once.
"""

from tritonbn.backends.triton._plan import Plan, plan
from tritonbn.backends.triton._prepared import prepare  # noqa: F401 (the Backend's capability, not public)
from tritonbn.backends.triton.backward_elemt import batch_norm_backward_elemt
from tritonbn.backends.triton.backward_reduce import batch_norm_backward_reduce
from tritonbn.backends.triton.elemt import batch_norm_elemt
from tritonbn.backends.triton.stats import batch_norm_stats

__all__ = [
    "Plan",
    "plan",
    "batch_norm_stats",
    "batch_norm_elemt",
    "batch_norm_backward_reduce",
    "batch_norm_backward_elemt",
]
