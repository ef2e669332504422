"""Every launch of the module path, direct and through Triton's ``JITFunction.run``, side by side.

Run as a script (``python tests/helpers/launch_check.py``; ``tests/kernels/test_launch.py`` does), never under the
Triton interpreter: it needs Triton's JIT path, over a fake driver, with CPU tensors that no kernel
ever reads. Compilation is replaced by a fake ``CompiledKernel`` per Triton cache key; its "C
launcher" records what it is called with. For every launch, the real :class:`tritonbn.kernels._launch.Launch`
runs first, then Triton's own ``JITFunction.run`` with the same arguments. Both must reach the same
fake kernel (the one Triton's key selects) with the same grid, stream, function handle, packed
metadata and argument tuple: the kernel's parameters in order, compared by identity for tensors
and by value and type for the rest. Launch metadata and hooks are ``None`` in the direct call, by
design (see the module docstring of ``_launch``), and Triton's own objects in its call.

Prints one JSON object: the number of launches checked, how many took the direct path, the
mismatches, and the cases covered.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from types import SimpleNamespace

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("launch_check: run without TRITON_INTERPRET (the check needs Triton's JIT path)")
os.environ["TRITONBN_BACKEND"] = "triton"
os.environ.pop("TRITONBN_DEBUG", None)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import tritonbn  # noqa: E402
from tritonbn import backend  # noqa: E402
from tritonbn.kernels import _launch, _plan  # noqa: E402

# --- a fake driver whose device and stream the cases switch ----------------------------------------


# The fake devices' target: an H100 (sm_90), or with LAUNCH_CHECK_TARGET=gfx942 (or gfx90a) an AMD GPU, whose
# launches Triton binds and specializes with its HIP backend (torch's CUDA API is HIP on ROCm).
_name = os.environ.get("LAUNCH_CHECK_TARGET", "90")
TARGET = GPUTarget("hip", _name, 64) if _name.startswith("gfx") else GPUTarget("cuda", int(_name), 32)


class FakeDriver:
    device = 0
    stream = 0

    def get_current_device(self):
        return FakeDriver.device

    def get_current_stream(self, device=None):
        assert device == FakeDriver.device, "the stream was asked for another device than the current one"
        return FakeDriver.stream

    def get_current_target(self):
        return TARGET


RECORDS: list[tuple] = []
FAKE_REGISTERS = 80


class FakeCompiled:
    """One compiled kernel per Triton cache key and device; its C launcher records its call. It reports
    FAKE_REGISTERS registers and no shared memory, which is what a launch fits its grid to."""

    def __init__(self, fn, key, device):
        self.fn, self.key, self.device = fn, key, device
        self.function = object()  # a distinct handle per kernel, as cuModuleGetFunction gives
        self.packed_metadata = object()
        self.n_regs = FAKE_REGISTERS
        self.metadata = SimpleNamespace(shared=0)

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *call):
        RECORDS.append((self, call))


def fake_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    kernel = FakeCompiled(self, key, device)
    self.device_caches[device][0][key] = kernel
    return kernel


def install_fake_compile() -> None:
    """Triton 3.5 and newer compile in ``JITFunction._do_compile``; Triton 3.4 inline in ``JITFunction.run``,
    through the ``triton.compiler.compile`` that each device's binder imports (``create_binder``)."""
    if hasattr(JITFunction, "_do_compile"):
        JITFunction._do_compile = fake_compile
        return
    import triton.compiler

    def compile_34(src, target=None, options=None):
        key = f"{src.signature}{src.constants}{sorted((options or {}).items())}"
        return FakeCompiled(src.fn, key, driver.active.get_current_device())

    triton.compiler.compile = compile_34


# --- the comparison --------------------------------------------------------------------------------

REAL_CALL = _launch.Launch.__call__
COUNTER = None  # the CountingRun installed as JITFunction.run
STATS = {"launches": 0, "direct": 0, "through_triton": 0, "mismatches": [], "kernels": set(), "fits": []}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


def describe(record) -> dict:
    kernel, call = record
    return {"kernel": kernel.fn.__name__, "key": kernel.key[:200], "device": kernel.device, "grid": call[:3],
            "stream": call[3], "arguments": len(call) - 9}  # fmt: skip


def checked_call(self, *pointers):
    """The real launch, then Triton's ``JITFunction.run`` on the same arguments; the two calls compared."""
    STATS["launches"] += 1
    before = len(RECORDS)
    runs = COUNTER.calls
    unfitted = self.grid if self.refit is not None else None
    REAL_CALL(self, *pointers)
    if unfitted is not None:  # this first launch fitted the plan: it must already run the fitted grid
        STATS["fits"].append({"kernel": self.fn.__name__, "unfitted": unfitted, "fitted": self.grid,
                              "launched": RECORDS[-1][1][:2], "num_warps": self.options["num_warps"],
                              "refit_left": self.refit is not None})  # fmt: skip
    direct = unfitted is None and COUNTER.calls == runs  # a fitting launch compiles (JITFunction.warmup)
    STATS["direct" if direct else "through_triton"] += 1
    assert len(RECORDS) == before + 1, "the launch did not reach a C launcher exactly once"
    self.fn.run(*pointers, *self.scalars, grid=self.grid, warmup=False, **self.options)  # Triton's own path
    ours, triton = RECORDS[-2], RECORDS[-1]
    STATS["kernels"].add(self.fn.__name__)
    (k1, c1), (k2, c2) = ours, triton
    problems = []
    if k1 is not k2:
        problems.append("another CompiledKernel than Triton's cache key selects")
    if c1[:6] != c2[:6] or not all(same(a, b) for a, b in zip(c1[:6], c2[:6], strict=True)):
        problems.append("grid, stream, function or packed metadata differ")
    if len(c1) != len(c2) or not all(same(a, b) for a, b in zip(c1[9:], c2[9:], strict=False)):
        problems.append("the argument tuples differ")
    if direct and c1[6:9] != (None, None, None):
        problems.append("the direct call passed launch metadata or hooks")
    if problems:
        STATS["mismatches"].append({"problems": problems, "ours": describe(ours), "triton": describe(triton),
                                    "case": CASE})  # fmt: skip


class CountingRun:
    """``JITFunction.run`` that counts its calls (what the direct path must avoid)."""

    def __init__(self, run):
        self.run, self.calls = run, 0

    def __get__(self, obj, cls=None):
        def bound(*args, **kwargs):
            self.calls += 1
            return self.run(obj, *args, **kwargs)

        return bound


# --- the cases -------------------------------------------------------------------------------------

CASE = ""


def step(model, x, residual=None, eval_too=True):
    """A training forward and backward, then an eval forward, each twice (the second launch of a plan is direct)."""
    for _ in range(2):
        model.train()
        x_in = x.detach().requires_grad_()
        y = model(x_in) if residual is None else model(x_in, residual)
        y.backward(torch.ones_like(y))
        if eval_too:
            model.eval()
            with torch.no_grad():
                model(x) if residual is None else model(x, residual)


def layout(x, kind):
    if kind == "channels_last":
        return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x


def misaligned(shape, dtype):
    """A view whose data pointer is 4 bytes past a 16-byte boundary (or 2, for 16-bit types)."""
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + 1).to(dtype)[1:].view(shape)


def misaligned_like(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose data pointer is one element past an aligned one (1, 4 or 8 bytes off 16)."""
    base = torch.zeros(t.numel() + 1, dtype=t.dtype)
    base[1:] = t.reshape(-1)
    out = base[1:].view(t.shape)
    assert out.data_ptr() % 16
    return out


def misaligned_step(which: str) -> None:
    """:func:`step` with the tensor ``which`` misaligned: a parameter, a buffer, the residual (silu: backward reads
    it), the upstream gradient or the mask."""
    bn = tritonbn.SyncBatchNorm(6, momentum=None, activation="silu")  # momentum=None: the kernel reads the count
    if which in ("weight", "bias"):
        getattr(bn, which).data = misaligned_like(getattr(bn, which).data)
    elif which in ("running_mean", "running_var", "num_batches_tracked"):
        setattr(bn, which, misaligned_like(getattr(bn, which)))
    x, residual = torch.randn(3, 6, 5, 4), torch.randn(3, 6, 5, 4)
    kwargs = {"mask": misaligned_like(torch.rand(3, 5, 4) > 0.3)} if which == "mask" else {}
    if which == "residual":
        residual = misaligned_like(residual)
    for _ in range(2):
        bn.train()
        y = bn(x.detach().requires_grad_(), residual.detach().requires_grad_(), **kwargs)
        grad = torch.randn_like(y)
        y.backward(misaligned_like(grad) if which == "grad" else grad)
        bn.eval()
        with torch.no_grad():
            bn(x, residual, **kwargs)


def run_cases() -> list[str]:
    global CASE
    covered = []
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for shape, kind in (((3, 6, 5, 4), "contiguous"), ((3, 6, 5, 4), "channels_last"),
                            ((2, 6, 3, 4, 5), "channels_last"), ((7, 6), "contiguous")):  # fmt: skip
            CASE = f"{dtype} {shape} {kind}"
            bn = tritonbn.SyncBatchNorm(shape[1], momentum=None if dtype == torch.float64 else 0.1).to(dtype)
            step(bn, layout(torch.randn(shape, dtype=dtype), kind))
            covered.append(CASE)
    CASE = "misaligned view"
    bn = tritonbn.SyncBatchNorm(6)
    x = misaligned((3, 6, 5, 4), torch.float32)
    assert x.data_ptr() % 16
    step(bn, x)
    step(bn, torch.randn(3, 6, 5, 4))  # the same plan, aligned: another kernel
    covered.append(CASE)
    for which in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked", "residual", "grad", "mask"):
        CASE = f"misaligned {which}"  # each pointer the launches read the alignment of, off 16 bytes in turn
        misaligned_step(which)
    covered.append("misaligned tensors other than the input")
    CASE = "packed plan, 7x7 NCHW, fused residual and relu"
    bn = tritonbn.SyncBatchNorm(16, activation="relu")
    x = torch.randn(2, 16, 7, 7)
    assert _plan.plan(x.shape, x).PLANE == 49
    step(bn, x, residual=torch.randn(2, 16, 7, 7))
    covered.append(CASE)
    CASE = "int64 offsets"
    _plan._INT32_MAX = 10
    _plan.clear_caches()
    x = torch.randn(3, 6, 5, 4)
    assert _plan.plan(x.shape, x).use_int64
    step(tritonbn.SyncBatchNorm(6), x)
    _plan._INT32_MAX = 2**31 - 1
    _plan.clear_caches()
    covered.append(CASE)
    for device, stream in ((1, 0), (1, 7), (0, 7)):
        CASE = f"device {device}, stream {stream}"
        FakeDriver.device, FakeDriver.stream = device, stream
        step(tritonbn.SyncBatchNorm(6), torch.randn(3, 6, 5, 4))
        covered.append(CASE)
    FakeDriver.device, FakeDriver.stream = 0, 0
    CASE = "fitted to the occupancy (planned as on 132 SMs)"
    with _plan.planned_as("cuda", 132):  # CPU tensors planned as for a GPU: launches fit their grids
        x = torch.empty(32, 64, 56, 56).to(memory_format=torch.channels_last)
        step(tritonbn.SyncBatchNorm(64), x)
    covered.append(CASE)
    return covered


def hooks_take_tritons_path() -> bool:
    """With a launch hook set, launches go through ``JITFunction.run`` and Triton passes the hooks."""
    calls = []
    hook = calls.append
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton 3.5 and newer: a hook chain, passed to the launcher as a whole
        chain.add(hook)
    else:  # Triton 3.4: one hook, passed as it is
        knobs.runtime.launch_enter_hook = hook
    try:
        runs = COUNTER.calls
        before = len(RECORDS)
        bn = tritonbn.SyncBatchNorm(6)
        x = torch.randn(3, 6, 5, 4)
        for _ in range(2):
            REAL_LAUNCH_ONLY[0] = True
            bn(x)
        through = COUNTER.calls - runs
        hooked = all(call[7] is knobs.runtime.launch_enter_hook for _, call in RECORDS[before:])
        return through == len(RECORDS) - before == 4 and hooked
    finally:
        if hasattr(chain, "add"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
        REAL_LAUNCH_ONLY[0] = False


REAL_LAUNCH_ONLY = [False]


def launch(self, *pointers):
    if REAL_LAUNCH_ONLY[0]:
        return REAL_CALL(self, *pointers)
    return checked_call(self, *pointers)


def main() -> int:
    if not _launch.DIRECT:
        print(json.dumps({"error": f"the direct launch is off here (triton {_launch.triton.__version__})"}))
        return 2
    driver.set_active(FakeDriver())
    install_fake_compile()
    global COUNTER
    COUNTER = CountingRun(JITFunction.run)
    JITFunction.run = COUNTER
    backend._load_kernels()
    backend._triton_unusable = lambda x: None  # the kernels "run" on CPU tensors: only their launches are real
    _launch.Launch.__call__ = launch
    _launch.device_sm = lambda index: _launch.SM90  # the fake devices are sm_90s (torch has no CUDA here)
    covered = run_cases()
    hooks = hooks_take_tritons_path()
    out = {
        "triton": _launch.triton.__version__,
        "target": f"{TARGET.backend}:{TARGET.arch}",
        "launches": STATS["launches"],
        "direct": STATS["direct"],
        "through_triton": STATS["through_triton"],
        "kernels": sorted(STATS["kernels"]),
        "mismatches": STATS["mismatches"][:5],
        "mismatch_count": len(STATS["mismatches"]),
        "hooks_take_tritons_path": hooks,
        "covered": covered,
        "fits": STATS["fits"],
        "fake_registers": FAKE_REGISTERS,
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
