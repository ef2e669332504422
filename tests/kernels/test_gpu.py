"""Runs tests/helpers/gpu_checks.py (CUDA graphs, no host sync) with the compiled kernels when a GPU is present."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA-graph capture and sync debug mode")
def test_gpu_checks():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = pathlib.Path(__file__).parents[1] / "helpers" / "gpu_checks.py"
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpu checks passed" in result.stdout
