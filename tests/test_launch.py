"""The direct launch (tritonbn/kernels/_launch.py) calls what Triton's own ``JITFunction.run`` would.

``tests/launch_check.py`` runs the module path over a fake driver in a subprocess (this process runs
the kernels under the interpreter, which has no compiled kernels) and, for every launch of a training
forward, backward and eval, compares the direct call with Triton's: the same ``CompiledKernel`` (the
one Triton's cache key selects), grid, stream and argument tuple. The cases cover fp32, fp16, bf16
and fp64; contiguous, channels_last, channels_last_3d and 2-D inputs; a view off 16-byte alignment;
a grouped plan (7x7 NCHW) with a fused residual and relu; int64 offsets; two devices and two streams.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parent / "launch_check.py"


@pytest.fixture(scope="module")
def check():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(result.stdout[result.stdout.index("{") :])


def test_every_launch_matches_tritons(check):
    assert check["mismatch_count"] == 0, json.dumps(check["mismatches"], indent=1)
    assert check["kernels"] == [
        "_batch_norm_backward_elemt_kernel",
        "_batch_norm_backward_reduce_kernel",
        "_batch_norm_elemt_kernel",
        "_batch_norm_stats_kernel",
    ]


def test_cases_take_the_direct_path(check):
    """Every plan's first launch finds its kernel through Triton; the repeats launch it directly."""
    assert check["direct"] >= check["launches"] // 3, check
    assert check["through_triton"] > 0
    assert len(check["covered"]) == 4 * 4 + 6, check["covered"]


def test_a_launch_hook_takes_tritons_path(check):
    """A profiler's launch hook (proton's, say) must see every launch: those go through ``JITFunction.run``."""
    assert check["hooks_take_tritons_path"]
