"""Below the tested floor (torch 2.8 with Triton 3.4): ``import tritonbn`` works, and the first call that
needs the kernels raises an error naming tritonbn, the versions found and the versions needed."""

import os
import subprocess
import sys

import pytest

from tritonbn import _compat


@pytest.mark.parametrize(
    "torch_version, triton_version, ok",
    [
        ("2.13.0+cpu", "3.9.0", True),
        ("2.8.0+cu128", "3.4.0", True),
        ("2.10.0", "3.10.0rc1", True),
        ("2.7.1+cu126", "3.3.1", False),
        ("2.8.0", "3.3.1", False),  # a Triton older than the one torch pins
        ("2.5.1", "3.4.0", False),
    ],
)
def test_version_problem(torch_version, triton_version, ok):
    problem = _compat.kernels_version_problem(torch_version, triton_version)
    if ok:
        assert problem is None
    else:
        assert problem.startswith("tritonbn")
        for needed in (torch_version, triton_version, "torch>=2.8", "triton>=3.4", "TRITONBN_BACKEND=torch"):
            assert needed in problem


def test_version_tuple():
    assert _compat.version_tuple("3.10.0rc1") == (3, 10)
    assert _compat.version_tuple("2.8.0+cu128") == (2, 8)
    assert _compat.version_tuple("3.4") == (3, 4)


# Torch 2.7 with Triton 3.3, simulated: their version strings, and a triton without ``triton.knobs``
# (added in 3.4; importing the kernels' launch module would fail on it).
_OLD = """
import sys
import torch, triton
torch.__version__, triton.__version__ = "2.7.1", "3.3.1"
sys.modules["triton.knobs"] = None  # `from triton import knobs` raises ImportError, as on Triton 3.3
import tritonbn
from torch import nn
model = tritonbn.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
x = torch.randn(2, 3, 4, 4)
try:
    model(x)
except RuntimeError as e:
    print("RAISED", e)
else:
    print("RAN", tritonbn.backend.name_for(x))
"""


@pytest.mark.parametrize("interpret, backend", [("1", "auto"), ("0", "auto"), ("1", "torch")])
def test_below_floor_import_works_first_call_explains(interpret, backend):
    env = dict(os.environ, TRITON_INTERPRET=interpret, TRITONBN_BACKEND=backend)
    result = subprocess.run([sys.executable, "-c", _OLD], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.strip()
    if interpret == "1" and backend == "auto":  # the kernels were asked for: a clear error, no silent fallback
        assert out.startswith("RAISED tritonbn's Triton kernels need torch>=2.8 with triton>=3.4"), out
        assert "found torch 2.7.1 with triton 3.3.1" in out, out
    else:  # the PyTorch backend needs neither (CPU tensors without the interpreter, or chosen)
        assert out == "RAN torch", out
