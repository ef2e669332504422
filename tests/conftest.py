"""Test set-up: the Triton kernels run on CPU under the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported; conftest is imported first, and spawned
ranks inherit the environment.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tritonbn import backend  # noqa: E402


def pytest_configure(config):
    torch.set_num_threads(1)


@pytest.fixture(params=["triton", "torch"])
def backend_name(request, monkeypatch):
    """Run the test once with the Triton kernels (interpreted) and once with the torch backend."""
    monkeypatch.setenv("TRITONBN_BACKEND", request.param)
    probe = torch.empty(0)
    assert backend.name_for(probe) == request.param, "the requested backend is not the one that runs"
    return request.param
