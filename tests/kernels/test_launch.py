"""The direct launch (tritonbn/kernels/_launch.py) calls what Triton's own ``JITFunction.run`` would.

``tests/helpers/launch_check.py`` runs the module path over a fake driver in a subprocess (this process runs
the kernels under the interpreter, which has no compiled kernels) and, for every launch of a training
forward, backward and eval, compares the direct call with Triton's: the same ``CompiledKernel`` (the
one Triton's cache key selects), grid, stream and argument tuple. The cases cover fp32, fp16, bf16
and fp64; contiguous, channels_last, channels_last_3d and 2-D inputs; a view off 16-byte alignment, and each
other tensor a launch reads (parameters, buffers, residual, gradient, mask) off it in turn;
a packed plan (7x7 NCHW) with a fused residual and relu; int64 offsets; two devices and two streams;
and a layer planned as on a 132-SM GPU, whose launches fit their grids to the fake kernels' occupancy.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tritonbn.kernels import _launch
from tritonbn.kernels._launch import CDNA, SM90, SM_LIMITS, Launch, programs_per_sm, sm_limits

SCRIPT = pathlib.Path(__file__).parents[1] / "helpers" / "launch_check.py"


# An H100, and an MI300X: on ROCm the direct launch calls Triton's HIP launcher with the same layout.
@pytest.fixture(scope="module", params=["90", "gfx942"])
def check(request):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LAUNCH_CHECK_TARGET"] = request.param
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = json.loads(result.stdout[result.stdout.index("{") :])
    assert out["target"] == ("hip:gfx942" if request.param == "gfx942" else "cuda:90")
    return out


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
    assert len(check["covered"]) == 4 * 4 + 8, check["covered"]


def test_a_launch_hook_takes_tritons_path(check):
    """A profiler's launch hook (proton's, say) must see every launch: those go through ``JITFunction.run``."""
    assert check["hooks_take_tritons_path"]


def test_programs_per_sm():
    """sm_90 occupancy in programs: registers are given out per warp in units of 256, at most 2048
    threads and 228 KB of shared memory (1 KB reserved per block) per SM."""
    assert programs_per_sm(80, 8, 0) == 3  # 80 * 32 = 2560 per warp: 25 warps, 3 programs of 8
    assert programs_per_sm(81, 8, 0) == 2  # 88 * 32 = 2816 per warp: 23 warps
    assert programs_per_sm(72, 8, 0) == 3
    assert programs_per_sm(128, 8, 0) == 2
    assert programs_per_sm(80, 4, 0) == 6
    assert programs_per_sm(32, 4, 0) == 16  # threads: 2048 / 128
    assert programs_per_sm(32, 4, 50 * 1024) == 4  # shared memory: 228 KB / (50 KB + 1 KB)
    assert programs_per_sm(255, 8, 0) == 1


def test_programs_per_sm_on_each_nvidia_target():
    """Each target's own per-SM limits (CUDA C++ Programming Guide, per compute capability): 64 warps on
    sm_80 and sm_100 as on sm_90, 48 on sm_86/89; 164 KB of shared memory on sm_80, 100 KB on sm_86/89,
    228 KB on sm_100; 16 resident blocks on sm_86, 24 on sm_89."""
    assert programs_per_sm(32, 4, 0, sm_limits(89)) == 12  # threads: 1536 / 128 (16 on sm_90)
    assert programs_per_sm(32, 4, 0, sm_limits(80)) == 16 == programs_per_sm(32, 4, 0, sm_limits(100))
    assert programs_per_sm(32, 4, 50 * 1024, sm_limits(80)) == 3  # 164 KB / 51 KB (4 on sm_90)
    assert programs_per_sm(32, 4, 30 * 1024, sm_limits(89)) == 3  # 100 KB / 31 KB (7 on sm_90)
    assert programs_per_sm(32, 4, 50 * 1024, sm_limits(100)) == 4
    assert programs_per_sm(16, 1, 0, sm_limits(86)) == 16 and programs_per_sm(16, 1, 0, sm_limits(89)) == 24
    assert programs_per_sm(128, 8, 0, sm_limits(80)) == 2 == programs_per_sm(128, 8, 0, sm_limits(89))
    # a capability without a row takes the newest one below it
    assert sm_limits(87) is SM_LIMITS[86] and sm_limits(120) is SM_LIMITS[100] and sm_limits(90) is SM90


def test_device_sm_reads_the_device(monkeypatch):
    """On a GPU the fit takes the device's own registers, threads and shared memory per SM, and its
    capability's row for what torch does not report (resident blocks), or for all of it."""
    l40s = SimpleNamespace(major=8, minor=9, max_threads_per_multi_processor=1536, regs_per_multiprocessor=65536,
                           shared_memory_per_multiprocessor=100 * 1024)  # fmt: skip
    a100 = SimpleNamespace(major=8, minor=0)  # reporting nothing of its own
    devices = {0: l40s, 1: a100}
    monkeypatch.setattr(torch.cuda, "get_device_properties", devices.__getitem__)
    monkeypatch.setattr(torch.version, "hip", None)
    _launch.device_sm.cache_clear()
    try:
        sm = _launch.device_sm(0)
        assert (sm["warps"], sm["smem"], sm["blocks"]) == (48, 100 * 1024, 24)
        assert programs_per_sm(32, 4, 0, sm) == 12
        assert _launch.device_sm(1) == SM_LIMITS[80]
    finally:
        _launch.device_sm.cache_clear()


def test_programs_per_cu_on_cdna():
    """gfx90a/gfx942 occupancy: waves per SIMD as LLVM's AMDGPU backend reports it in the assembly
    (``; Occupancy:``): 144 VGPRs gave 3, 9 gave 8 (tests/helpers/aot_compile.py's kernels and a toy, Triton 3.9)."""
    assert programs_per_sm(144, 4, 0, CDNA) == 3  # 3 waves on each of 4 SIMDs, programs of 4 wavefronts
    assert programs_per_sm(9, 4, 0, CDNA) == 8  # 8 waves a SIMD, the most
    assert programs_per_sm(128, 4, 0, CDNA) == 4
    assert programs_per_sm(129, 4, 0, CDNA) == 3  # rounded up to 136 VGPRs: 3 a SIMD
    assert programs_per_sm(200, 1, 0, CDNA) == 8  # 2 a SIMD (not 10 from the CU's pooled registers)
    # LLVM's figures in the gfx942 quick audit: 66 VGPRs 7 waves a SIMD (allocated in units of 8: 72), 74 gave 6
    assert [programs_per_sm(v, 1, 0, CDNA) for v in (66, 74, 90, 98)] == [28, 24, 20, 16]
    assert programs_per_sm(32, 4, 40 * 1024, CDNA) == 1  # LDS: 64 KiB per CU


def test_plans_keep_256_threads_on_wavefronts_of_64():
    from tritonbn.kernels import _plan

    x = torch.empty(32, 64, 28, 28).to(memory_format=torch.channels_last)
    with _plan.planned_as("cuda", 132):
        nvidia = _plan.plan(x.shape, x)
    with _plan.planned_as("cuda", 304, warp_size=64):
        amd = _plan.plan(x.shape, x)
    assert nvidia.num_warps == 8 and amd.num_warps == 4


def test_first_launch_runs_the_fitted_grid(check):
    """Planned as on a 132-SM GPU, every kernel's first launch compiles it unlaunched, reads its occupancy
    (the fake kernels report 80 registers) and already launches the fitted grid: one wave, at most
    132 * programs_per_sm programs, fewer than the plan made before the occupancy was known."""
    fits = check["fits"]
    assert {f["kernel"] for f in fits} == set(check["kernels"]), fits
    for f in fits:
        wave = 132 * programs_per_sm(check["fake_registers"], f["num_warps"], 0)
        assert f["launched"] == f["fitted"] and not f["refit_left"], f
        assert f["fitted"][0] * f["fitted"][1] <= wave < f["unfitted"][0] * f["unfitted"][1], f


class _FakeKernel:
    """A kernel whose unlaunched compiles (``warmup``) report the given register counts in turn, and the spill
    bytes ``spills`` gives for their ``maxnreg`` option (none by default)."""

    arg_names = ["a_ptr", "n", "BLOCK"]
    __name__ = "_fake_kernel"

    def __init__(self, registers, spills=None):
        self.registers, self.grids, self.spills, self.ceilings = list(registers), [], spills or {}, []

    def warmup(self, *args, grid, **options):
        self.grids.append(grid)
        self.ceilings.append(options.get("maxnreg"))
        return SimpleNamespace(n_regs=self.registers.pop(0), n_spills=self.spills.get(options.get("maxnreg"), 0),
                               metadata=SimpleNamespace(shared=0))  # fmt: skip


def _fake_launch(fn, per_sm=None, tickets_per_program=1):
    """A launch of ``fn`` planned as one wave of ``per_sm`` programs per SM (8 before the occupancy is known)."""
    programs = 132 * (per_sm or 8)
    refit = None if per_sm else functools.partial(_fake_launch, fn, tickets_per_program=tickets_per_program)
    return Launch(fn, (1, programs), (7,), {"BLOCK": 4}, 8, pointers=1,
                  tickets=programs * tickets_per_program, refit=refit)  # fmt: skip


def test_fit_follows_the_occupancy_down():
    """The fitted plan compiles to a kernel with more registers (60, then 80): it is fitted again, to
    3 programs of 8 warps per SM, and stops when the occupancy holds."""
    fn = _FakeKernel([60, 80, 80])
    launch = _fake_launch(fn)
    launch._fit((torch.empty(1),), SM90)
    assert fn.grids == [(1, 132 * 8), (1, 132 * 4), (1, 132 * 3)]
    assert launch.grid == (1, 132 * 3) and launch.tickets == 132 * 3 and launch.refit is None


def test_fit_never_outgrows_the_workspace():
    """A refit that would need more tickets than the first call was given is an error, not a corruption."""
    fn = _FakeKernel([60])
    launch = _fake_launch(fn)
    launch.refit = functools.partial(_fake_launch, fn, tickets_per_program=4)
    with pytest.raises(RuntimeError, match="tritonbn: _fake_kernel's fitted plan needs more workspace"):
        launch._fit((torch.empty(1),), SM90)


def test_a_spilling_kernel_gets_its_own_registers_as_ceiling():
    """ptxas spills a kernel at the 80 registers it picked itself, and not when given 80 as a ceiling (as the
    sm_80 statistics kernel of a 32x64x112x112 fp16 input): the launch keeps ``maxnreg=80``, at the same
    occupancy, for every plan it fits (each is checked again)."""
    fn = _FakeKernel([80, 80, 80, 80], spills={None: 42, 80: 0})
    launch = _fake_launch(fn)
    launch._fit((torch.empty(1),), SM90)
    assert fn.ceilings == [None, 80, None, 80]
    assert launch.options["maxnreg"] == 80 and launch.grid == (1, 132 * 3)


def test_then_the_register_budget_as_ceiling():
    """Where a ceiling of its own count still spills (as the sm_89 statistics kernel of a 32x1024x14x14 fp32
    input: 24 bytes at 80 registers, 8 at a ceiling of 80), the plans' budget of 128 registers, which ptxas
    fills (2 programs of 8 warps per SM)."""
    fn = _FakeKernel([80, 80, 128] * 2, spills={None: 24, 80: 8, 128: 0})
    launch = _fake_launch(fn)
    launch._fit((torch.empty(1),), SM90)
    assert fn.ceilings == [None, 80, 128] * 2
    assert launch.options["maxnreg"] == 128 and launch.grid == (1, 132 * 2)


def test_a_ceiling_that_spills_as_much_is_dropped():
    fn = _FakeKernel([80, 80, 80] * 2, spills={None: 42, 80: 42, 128: 42})
    launch = _fake_launch(fn)
    launch._fit((torch.empty(1),), SM90)
    assert fn.ceilings == [None, 80, 128] * 2 and "maxnreg" not in launch.options


def test_no_ceiling_on_cdna():
    """AMD's compiler takes no ptxas ceiling: a kernel there is compiled once per plan."""
    fn = _FakeKernel([80, 80], spills={None: 42})
    launch = _fake_launch(fn)
    launch._fit((torch.empty(1),), CDNA)
    assert fn.ceilings == [None, None] and "maxnreg" not in launch.options
