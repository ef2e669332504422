"""Every kernel compiles, with compiled Triton and no GPU, for the GPUs users train on: sm_90 (H100/H200) in the
quick form, and sm_80 (A100), sm_89 (L40S), sm_100 (B200), gfx90a (MI250X), gfx942 (MI300X) each kernel once
per plan, with the launches' compile options turning FMA fusion on whatever TRITON_DEFAULT_FP_FUSION says.

The README's test command checks the FMA fusion on every target and each kernel once per plan for sm_90; the
kernel audits (test_kernel_audit*.py) compile every kernel of real launches for sm_90 and the five other
targets. The matrices (``--quick`` for sm_90, ``--smoke`` per other target) are the exhaustive sweep
(``compile_sweep``), which CI runs with scripts/compile_sweep.sh.
"""

import pathlib
import subprocess
import sys

import pytest
from compile_jobs import compile_env

SCRIPT = pathlib.Path(__file__).parents[1] / "helpers" / "aot_compile.py"
NAMES = ("sm_80", "sm_89", "sm_90", "sm_100", "gfx90a", "gfx942")


def _run(cache, *args: str, **env: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), *args], env=compile_env(cache, **env), capture_output=True,
                            text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return result.stdout


def test_fma_fusion_on_every_target(compile_cache):
    # Triton 3.10 turns fusion off by default (TRITON_DEFAULT_FP_FUSION): the launch options must win over it.
    out = _run(compile_cache, "--arch", "all", "--fma-only", TRITON_DEFAULT_FP_FUSION="0")
    for name in NAMES:
        assert f"{name}: forward kernel with the launch options" in out, out


def test_each_kernel_compiles_once_per_plan_for_sm90(compile_cache):
    """Each kernel of each plan (plane by plane, packed, masked), with a residual and an activation, which the
    audits' launches have not; and the out-of-step check's kernel (tritonbn/lockstep.py)."""
    assert "compiled 13 kernel specializations for sm_90" in _run(compile_cache, "--smoke")


# The sweep in parts of about a minute each, so that CI's two workers stay busy to the end (scripts/compile_sweep.sh).
@pytest.mark.compile_sweep
@pytest.mark.parametrize("dtypes", ["bf16", "fp64"])
def test_kernels_compile_for_sm90(compile_cache, dtypes):
    assert "kernel specializations for sm_90" in _run(compile_cache, "--quick", "--dtypes", dtypes)


@pytest.mark.compile_sweep
# sm_90's kernels once per plan, and its FMA check, are the README's command's (the two tests above).
@pytest.mark.parametrize("archs", [("80",), ("89",), ("100", "gfx90a", "gfx942")], ids="-".join)
def test_kernels_compile_for_every_target_with_fma_fusion(compile_cache, archs):
    out = _run(compile_cache, "--arch", ",".join(archs), "--smoke", "--fma-check", TRITON_DEFAULT_FP_FUSION="0")
    names = [name if name.startswith("gfx") else f"sm_{name}" for name in archs]
    assert set(names) < set(NAMES) - {"sm_90"}
    for name in names:
        assert f"compiled 13 kernel specializations for {name}" in out, out
        assert f"{name}: forward kernel with the launch options" in out, out
