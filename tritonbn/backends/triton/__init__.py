"""The Triton backend: the four launchers over the Triton kernels, one module per pass (public as
:mod:`tritonbn.kernels`, whose docstring shows a training step).

``stats.py``, ``elemt.py``, ``backward_reduce.py``, ``backward_elemt.py``: each pass's kernel and its launcher
(``launcher``, which the public one below calls); ``_common.py`` the tile code they share; ``_plan.py`` block sizes
and grids (``_tiles.py``, its tile shapes); ``_workspace.py`` partials and tickets; ``_launch.py`` the direct launch of
a compiled kernel; ``_prepared.py`` the launches of one layer's eager calls, found once.
"""

from tritonbn.backends.launchers import Launchers
from tritonbn.backends.triton import backward_elemt, backward_reduce, elemt, stats
from tritonbn.backends.triton._plan import Plan, plan
from tritonbn.backends.triton._prepared import prepare  # noqa: F401 (the Backend's capability, not public)

launchers = Launchers(stats.launcher, elemt.launcher, backward_reduce.launcher, backward_elemt.launcher)
batch_norm_stats = launchers.batch_norm_stats
batch_norm_elemt = launchers.batch_norm_elemt
batch_norm_backward_reduce = launchers.batch_norm_backward_reduce
batch_norm_backward_elemt = launchers.batch_norm_backward_elemt

# Each pass module's public launcher, where earlier releases had it (``tritonbn.kernels.elemt.batch_norm_elemt``).
stats.batch_norm_stats, elemt.batch_norm_elemt = batch_norm_stats, batch_norm_elemt
backward_reduce.batch_norm_backward_reduce = batch_norm_backward_reduce
backward_elemt.batch_norm_backward_elemt = batch_norm_backward_elemt

__all__ = [
    "Plan",
    "plan",
    "batch_norm_stats",
    "batch_norm_elemt",
    "batch_norm_backward_reduce",
    "batch_norm_backward_elemt",
]
