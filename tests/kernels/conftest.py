"""Fixtures of the tests that compile the kernels for GPU targets without a GPU (in subprocesses: this process
runs under TRITON_INTERPRET=1).

* ``compile_cache``: one Triton cache for the whole test run, which the xdist workers share, so that a
  specialization is compiled once per run (ptxas's figures are kept beside each kernel, see
  ``benchmarks/kernel_audit.py --cache-dir``). ``TRITONBN_TEST_TRITON_CACHE`` names another folder: CI gives the
  test run and the compile sweep the same one, so the sweep compiles only what the run did not.
* ``kernel_audit``: runs ``benchmarks/kernel_audit.py`` jobs in one process per worker (``--serve``): one
  interpreter start, and each job charged to the test that asks for it.

The exhaustive sweeps (``compile_sweep`` marker) are left out of the README's test command (pyproject's
addopts); CI runs them with ``scripts/compile_sweep.sh``.
"""

import os
import pathlib

import pytest
from compile_jobs import AuditServer


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> pathlib.Path:
    if os.environ.get("TRITONBN_TEST_TRITON_CACHE"):
        path = pathlib.Path(os.environ["TRITONBN_TEST_TRITON_CACHE"])
        path.mkdir(parents=True, exist_ok=True)
        return path
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' base folders share this parent
        base = base.parent
    path = base / "triton-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def kernel_audit(compile_cache, tmp_path_factory):
    """``kernel_audit(*args)``: the audit's stdout, after one job of ``benchmarks/kernel_audit.py`` with these
    arguments (skips where the audit cannot run here: no nvdisasm)."""
    server = AuditServer(compile_cache, tmp_path_factory.mktemp("audit_server") / "stderr.txt")
    yield server.run
    server.close()
