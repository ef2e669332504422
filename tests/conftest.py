"""Test set-up, for the test folders by area (kernels, autograd, distributed, integrations, cli, docs).

The helpers they share (gloo ranks, the float64 oracle, the interpreter speed-up, stand-ins and the
scripts some tests run in a subprocess) live in ``tests/helpers/``, which this file puts on ``sys.path``.

By default the Triton kernels run on CPU under the Triton interpreter: TRITON_INTERPRET must be set
before triton is imported, conftest is imported first, and spawned ranks inherit the environment.

Under the interpreter, tests/helpers/fast_interpreter.py removes two of its redundant costs, in this process
and in the spawned ranks.

``TRITONBN_TEST_DEVICE=cuda`` (the GPU check script) instead makes CUDA the default device, runs the
compiled kernels, and skips the multi-rank gloo tests, which are CPU-only.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))  # the helpers, one place
DEVICE = os.environ.get("TRITONBN_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from dist import pooled  # noqa: E402
from fast_interpreter import install as faster_interpreter  # noqa: E402

from tritonbn import backend  # noqa: E402

faster_interpreter()  # see tests/helpers/fast_interpreter.py: the same results, about 3x sooner


def pytest_configure(config):
    torch.set_num_threads(1)
    if DEVICE != "cpu":
        torch.set_default_device(DEVICE)


# The inner tier, ``pytest -m "not slow"`` (docs/contributing.md), leaves these out: test files (a path under tests/)
# or single tests (a node id's start) that compile for GPUs, start scripts, train whole networks or run gradcheck's
# many calls on the kernels; and every multi-rank test but INNER_RANKS, which runs both backends on two ranks.
SLOW = (
    "kernels/test_aot_compile.py",
    "kernels/test_kernel_audit.py",
    "kernels/test_kernel_audit_masked.py",
    "kernels/test_launch.py",
    "kernels/test_dtypes.py::test_gradcheck_float64",
    "autograd/test_crash_hunt.py",
    "autograd/test_compile.py",
    "autograd/test_eager_path.py::test_eager_matches_compiled_bitwise",
    "autograd/test_higher_order.py::test_gradgradcheck",
    "autograd/test_higher_order.py::test_forward_ad_under_compile",
    "autograd/test_properties.py",
    "cli/",
    "integrations/test_lightning.py",
    "integrations/test_mmengine.py",
    "integrations/test_export.py::test_aot_inductor_package_runs_on_cpu",
    "integrations/test_export.py::test_training_mode_compile_at_world_size_1",
    "api/test_versions.py",
    "api/test_docs.py",
    "api/test_layout.py::test_command_line_entry_points",
)
INNER_RANKS = "distributed/test_training.py"
# The longest modules, run first (longest first, in this order): under --dist loadscope a module is one worker's, and
# one of them left for last keeps one core busy alone at the end (about 20 s of the README command's 6 minutes).
# Measured with --durations=0 on 2026-12-06 (after the sweep took inductor's C++ builds and half the audit); a module
# left off merely runs in its collection order.
LONGEST_FIRST = (
    "kernels/test_kernel_audit.py",
    "distributed/test_checkpoint_loops.py",
    "autograd/test_crash_hunt.py",
    "kernels/test_aot_compile.py",
    "autograd/test_compile.py",
    "autograd/test_eager_path.py",
    "kernels/test_dtypes.py",
    "autograd/test_epilogue.py",
    "integrations/test_export.py",
)


def pytest_collection_modifyitems(config, items):
    root = os.path.dirname(os.path.abspath(__file__))
    wheres = {id(item): os.path.relpath(str(item.path), root).replace(os.sep, "/") for item in items}
    rank = {where: i for i, where in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(wheres[id(item)], len(rank)))  # stable: each module keeps its own order
    for item in items:
        where = wheres[id(item)]
        test = where + "::" + item.name
        distributed = item.get_closest_marker("distributed") is not None and where != INNER_RANKS
        if distributed or where.startswith(SLOW) or test.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
    if DEVICE == "cpu":
        return
    skip = pytest.mark.skip(reason=f"gloo multi-rank tests run on CPU only (TRITONBN_TEST_DEVICE={DEVICE})")
    for item in items:
        if "distributed" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def rank_pools():
    """The gloo ranks the tests spawn are kept for later runs (tests/helpers/dist.py), closed at the session's end."""
    with pooled():
        yield


@pytest.fixture(params=["triton", "torch"])
def backend_name(request, monkeypatch):
    """Run the test once with the Triton kernels and once with the torch backend."""
    monkeypatch.setenv("TRITONBN_BACKEND", request.param)
    probe = torch.empty(0)
    assert backend.name_for(probe) == request.param, "the requested backend is not the one that runs"
    return request.param


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiny tiles and many programs per channel block: every kernel runs many tiles per program, and
    the merge has many partials, two-level (groups of ceil(sqrt(programs)), the last one often short)."""
    from tritonbn.kernels import _plan

    monkeypatch.setattr(_plan, "_CPU_TILE", 8)
    monkeypatch.setattr(_plan, "_CPU_PROGRAMS", 16)
    monkeypatch.setattr(_plan, "_FLAT_MERGE", 3)
    monkeypatch.setattr(_plan, "_FLAT_MERGE_BYTES", 0)
    _plan.clear_caches()
    yield
    _plan.clear_caches()
