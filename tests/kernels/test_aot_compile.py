"""Every kernel compiles, with compiled Triton and no GPU, for the GPUs users train on: sm_90 (H100/H200) in the
quick form, and sm_80 (A100), sm_89 (L40S), sm_100 (B200), gfx90a (MI250X), gfx942 (MI300X) each kernel once
per plan, with the launches' compile options turning FMA fusion on whatever TRITON_DEFAULT_FP_FUSION says."""

import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).parents[1] / "helpers" / "aot_compile.py"


def _run(*args: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(SCRIPT), *args], env=dict(environ, **env), capture_output=True,
                            text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return result.stdout


def test_kernels_compile_for_sm90():
    assert "kernel specializations for sm_90" in _run("--quick")


def test_kernels_compile_for_every_target_with_fma_fusion():
    # Triton 3.10 turns fusion off by default (TRITON_DEFAULT_FP_FUSION): the launch options must win over it.
    out = _run("--arch", "all", "--smoke", "--fma-check", TRITON_DEFAULT_FP_FUSION="0")
    for name in ("sm_80", "sm_89", "sm_90", "sm_100", "gfx90a", "gfx942"):
        assert f"compiled 12 kernel specializations for {name}" in out, out
        assert f"{name}: forward kernel with the launch options" in out, out
