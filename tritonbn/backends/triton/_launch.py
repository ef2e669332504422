"""Launching a kernel the way torch inductor does: find its compiled kernel once, then call it.

``kernel[grid](*args)`` runs Triton's ``JITFunction.run`` on every call: it binds and specializes
every argument, hashes a cache key, checks the kernel's globals and builds launch metadata, about
20 µs of Python per launch before the C launcher (``benchmarks/host_overhead.py`` measures it).
tritonbn's launchers already know most of what Triton specializes on: every integer argument and
constexpr follows from the plan and the dtypes, which their own caches are keyed by (see
:class:`Launch`). What is left is each pointer's 16-byte alignment (read for the tensors the launcher
is given, not for those it allocates), and the current device. So a :class:`Launch` finds the
``CompiledKernel`` once per (device, alignment) through Triton's own path (``kernel[grid](...)``,
which also launches it), keeps it alive, and from then on calls its C launcher directly, with the
same positional layout ``JITFunction.run`` ends in (the Triton versions in
:data:`tritonbn._compat.DIRECT_LAUNCH_VERIFIED`)::

    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *every_argument)

where the metadata and both hooks are ``None`` (Triton passes empty hook chains, and metadata that
only hooks read; the C launcher accepts ``None`` for all three). Every parameter is passed, the
constexprs included, which the C launcher skips. ``tests/kernels/test_launch.py`` checks, over a fake
driver, that every launch of the module path calls the same ``CompiledKernel`` with the same grid,
stream and arguments as ``JITFunction.run`` would.

Triton's own path runs instead:

* under the Triton interpreter (CPU tensors: there is no compiled kernel);
* while a launch hook is set (a profiler such as proton) or the kernel has pre-run hooks;
* when the installed Triton is not one whose launch layout was checked (``DIRECT_LAUNCH_VERIFIED``);
* for the first launch of each (plan, device, alignment), which compiles or finds the kernel;
* when Triton has no active GPU driver (``benchmarks/kernel_audit.py`` records launches on a machine
  without a GPU through Triton's path).

**Occupancy.** Before the first launch of a plan on a GPU, a :class:`Launch` given ``refit`` compiles
its kernel without launching it (``JITFunction.warmup``, as Triton's persistent-kernel tutorials do),
reads its registers and shared memory, works out how many of its programs one SM holds
(:func:`programs_per_sm`, with the GPU's own per-SM limits, :func:`device_sm`), and takes the plan ``refit``
makes for that occupancy: a grid of one wave, every program resident at once, instead of a last partial
wave that keeps few bytes in flight. The first launch already runs the fitted plan, so every launch of a
plan merges in the same order. A kernel that spills is compiled again with its own register count as
ptxas's ceiling (:meth:`Launch._compile`).

Triton's compile options that it reads from the environment on each call (``TRITON_DEBUG``, the
instrumentation mode) are read when a kernel is first found for a plan, as in inductor.
"""

from __future__ import annotations

import functools

import torch
import triton

from tritonbn._compat import (
    COMPILE_OPTIONS,
    DIRECT_LAUNCH_VERIFIED,
    direct_entry,
    interpreter_shims,
    launch_hooks_set,
    load_binary,
    triton_driver,
    triton_runtime_knobs,
    version_tuple,
)
from tritonbn.backends.triton._plan import fits_occupancy, planned_target

_knobs = triton_runtime_knobs()  # ``interpret``
if _knobs.interpret:
    interpreter_shims()  # Triton 3.4 to 3.6 with NumPy 2.4 (see there)
hooks_set = launch_hooks_set()  # a hook set there must see every launch
driver = triton_driver()


def direct_supported() -> bool:
    """Whether launches may skip ``JITFunction.run``: a checked Triton, and no interpreter."""
    if _knobs.interpret:
        return False
    low, high = DIRECT_LAUNCH_VERIFIED
    return low <= version_tuple(triton.__version__) <= high


DIRECT = direct_supported()

# What one SM holds, per NVIDIA compute capability (CUDA C++ Programming Guide, "Technical Specifications per
# Compute Capability"; the Ampere and Ada tuning guides, "Occupancy"): 64K registers, given out per warp in
# units of ``reg_unit``; resident warps; shared memory, of which the driver keeps ``smem_per_block`` bytes per
# resident block; resident blocks. A GPU's own registers, warps and shared memory replace the row's
# (:func:`device_sm`); plans made without a GPU, as the kernel audit makes them, take the row of their target.
_SM = {"regs": 65536, "reg_unit": 256, "smem_per_block": 1024}
SM_LIMITS = {
    80: dict(_SM, warps=64, smem=164 * 1024, blocks=32),  # A100
    86: dict(_SM, warps=48, smem=100 * 1024, blocks=16),  # A10, A40, RTX 30
    89: dict(_SM, warps=48, smem=100 * 1024, blocks=24),  # L4, L40S, RTX 40
    90: dict(_SM, warps=64, smem=228 * 1024, blocks=32),  # H100, H200
    100: dict(_SM, warps=64, smem=228 * 1024, blocks=32),  # B200
}
SM90 = SM_LIMITS[90]
# Registers a thread may hold in every plan: 2 programs of 8 warps (4 of 4) resident per SM, on every target.
MAX_REGISTERS = 128
# The same for one AMD CDNA2/CDNA3 compute unit (gfx90a MI250X, gfx942 MI300X; AMD's CDNA3 ISA guide), an
# assumption until a ROCm GPU is run: 4 SIMDs, each with 512 VGPRs per lane, given out in units of 8, and at
# most 8 wavefronts of 64 lanes (a wavefront's registers come from one SIMD); 64 KiB of LDS per CU.
CDNA = {
    "regs": 4 * 512 * 64,
    "reg_unit": 8 * 64,
    "warps": 32,
    "smem": 64 * 1024,
    "smem_per_block": 0,
    "blocks": 32,
    "warp_size": 64,
    "simds": 4,
}


def resident_limits(registers: int, num_warps: int, shared: int, sm: dict = SM90) -> dict[str, int]:
    """Programs of a kernel one SM holds at once, by what limits them (registers, threads, shared
    memory, blocks), for ``registers`` per thread, ``num_warps`` warps and ``shared`` bytes per program."""
    regs_per_warp = -(-max(registers, 1) * sm.get("warp_size", 32) // sm["reg_unit"]) * sm["reg_unit"]
    simds = sm.get("simds", 1)
    return {
        "registers": simds * ((sm["regs"] // simds) // regs_per_warp) // num_warps,
        "threads": sm["warps"] // num_warps,
        "shared memory": sm["smem"] // max(1, shared + sm["smem_per_block"]),
        "blocks": sm["blocks"],
    }


def programs_per_sm(registers: int, num_warps: int, shared: int, sm: dict = SM90) -> int:
    """The occupancy in programs: the least of :func:`resident_limits` (at least 1)."""
    return max(1, min(resident_limits(registers, num_warps, shared, sm).values()))


def sm_limits(arch: int) -> dict:
    """The :data:`SM_LIMITS` row of compute capability ``arch`` (``major * 10 + minor``), or of the newest one
    below it (the oldest row below them all)."""
    return SM_LIMITS.get(arch) or SM_LIMITS[max([a for a in SM_LIMITS if a <= arch], default=80)]


@functools.cache
def device_sm(index: int) -> dict:
    """What one SM of CUDA device ``index`` holds: its capability's :func:`sm_limits`, with the registers,
    threads and shared memory its properties report (:data:`CDNA`'s figures on ROCm, with its wavefront size).

    ``max_threads_per_multi_processor``, ``regs_per_multiprocessor`` (torch 2.2, pytorch#115094; not on ROCm) and
    ``shared_memory_per_multiprocessor`` (torch 2.6, pytorch#143119) are public, in every supported torch."""
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        return dict(CDNA, warp_size=getattr(props, "warp_size", 64))
    row = sm_limits(props.major * 10 + props.minor)
    return dict(
        row,
        regs=getattr(props, "regs_per_multiprocessor", row["regs"]),
        warps=getattr(props, "max_threads_per_multi_processor", 32 * row["warps"]) // 32,
        smem=getattr(props, "shared_memory_per_multiprocessor", row["smem"]),
    )


_data_ptr = torch.Tensor.data_ptr


@functools.cache
def address_bits(checked: tuple[int, ...]):
    """``pointers -> int``: the bitwise OR of the data pointers at positions ``checked`` (its low 4 bits are 0 when all
    of them are 16-byte aligned), written out as one expression, as Triton writes its binders: reading them through
    ``map`` and ``reduce`` cost 0.8 us a launch, a quarter of the launch path (``benchmarks/host_overhead.py``)."""
    if not checked or not all(isinstance(i, int) and i >= 0 for i in checked):
        raise ValueError(f"tritonbn: checked must be pointer positions, got {checked!r}")
    return eval("lambda p: " + " | ".join(f"ptr(p[{i}])" for i in checked), {"ptr": _data_ptr})  # noqa: S307


def refit_with(build, *args, device: torch.device):
    """``per_sm -> build(*args, per_sm=per_sm)``, a :class:`Launch`'s ``refit``, when launches on ``device``
    are planned for a GPU (else ``None``: nothing to fit). It holds ``args`` until the first launch."""
    if not fits_occupancy(device):
        return None
    return functools.partial(_rebuild, build, args)


def _rebuild(build, args: tuple, per_sm: int):
    return build(*args, per_sm=per_sm)


class Launch:
    """One kernel, launched with one plan: the grid, the arguments after the pointers, the constexprs.

    ``tail`` holds the non-pointer arguments in the kernel's order, then come the ``constexprs``
    (by name). The kernel's parameters must be its pointers first and its constexprs last, which
    the constructor checks. A launcher builds one ``Launch`` per key that fixes everything Triton
    specializes on except the pointers' alignment and the device: the plan (sizes and strides),
    every pointer's dtype, the flags. ``launch(*pointers)`` then launches the kernel.
    """

    __slots__ = ("fn", "grid", "scalars", "options", "args_after", "compiled", "tickets", "scratch", "refit", "checked")

    def __init__(
        self,
        fn,
        grid: tuple[int, int],
        tail: tuple,
        constexprs: dict,
        num_warps: int,
        pointers: int,
        tickets: int = 0,
        scratch: int = 0,
        refit=None,
        checked: tuple[int, ...] | None = None,
    ):
        self.fn = fn
        # ``checked``: the positions of the pointers whose alignment the launch reads (None: all). The launcher
        # leaves out those it allocates itself at every call (torch.empty, the workspace: the allocator aligns
        # them to 16 bytes and more) and the stand-ins for absent tensors that repeat a checked or allocated one.
        if checked is None:
            checked = tuple(range(pointers))
        self.checked = address_bits(tuple(checked))
        self.tickets = tickets  # ticket counters and float64 scratch values it needs from the workspace
        self.scratch = scratch
        self.grid = grid
        self.scalars = tail
        self.options = dict(constexprs, num_warps=num_warps, **COMPILE_OPTIONS)  # fp fusion on, see _compat
        names = list(fn.arg_names)
        last = names[len(names) - len(constexprs) :]
        if len(names) != pointers + len(tail) + len(constexprs) or set(last) != set(constexprs):
            raise TypeError(
                f"tritonbn: {fn.__name__} takes ({', '.join(names)}); a launch must give its {pointers} pointers, "
                f"then {len(names) - pointers - len(constexprs)} more arguments, then the constexprs by name, "
                f"got {len(tail)} arguments and {sorted(constexprs)}"
            )
        self.args_after = tail + tuple(constexprs[name] for name in last)
        self.compiled: dict = {}
        # refit(programs_per_sm) -> the Launch of the same kernel planned for that occupancy; used
        # once, before the first launch on a GPU (see the module docstring). Its plan may ask for no
        # more tickets or scratch than this one's.
        self.refit = refit

    def _fit(self, pointers: tuple, sm: dict) -> None:
        """Take the plan ``refit`` makes for the compiled kernel's occupancy (compiling it, unlaunched).

        A fitted plan can compile to another kernel (a merge tile that follows the grid), with more
        registers: then it is fitted again to that one's occupancy, which only ever lowers it.
        """
        refit, self.refit = self.refit, None
        planned = None  # programs per SM the current plan is made for (None: before the occupancy was known)
        for _ in range(3):
            compiled = self._compile(pointers, sm)
            if compiled is None:
                return
            registers = getattr(compiled, "n_regs", None)
            if not registers:
                return
            per_sm = programs_per_sm(registers, self.options["num_warps"], compiled.metadata.shared, sm)
            if planned is not None and per_sm >= planned:
                return
            new = refit(per_sm)
            if new.tickets > self.tickets or new.scratch > self.scratch:
                raise RuntimeError(f"tritonbn: {self.fn.__name__}'s fitted plan needs more workspace than it was given")
            self.grid, self.scalars, self.options, self.args_after = new.grid, new.scalars, new.options, new.args_after
            self.tickets, self.scratch = new.tickets, new.scratch
            self.compiled = {}
            planned = per_sm

    def _compile(self, pointers: tuple, sm: dict):
        """The kernel compiled (unlaunched) with this launch's options, its binary loaded (``None`` if Triton
        gives none).

        A CUDA kernel that spills is compiled again with a register ceiling for ptxas (``maxnreg``): first the
        count ptxas gave it (the same occupancy), then :data:`MAX_REGISTERS`, the budget every plan assumes;
        the one that spills least is kept. ptxas 12.9 spills the sm_80 statistics kernel of a 32x64x112x112
        fp16 NCHW input at the 80 registers it picks itself, and not at all at a ceiling of 80; on sm_89 a
        32x1024x14x14 fp32 one spills 24 bytes at its 80, 8 at a ceiling of 80, none at 128.
        """
        compiled = self.fn.warmup(*pointers, *self.scalars, grid=self.grid, **self.options)
        if compiled is None:
            return None
        load_binary(compiled)  # registers and spills are known once the binary is loaded
        if not getattr(compiled, "n_spills", 0) or "simds" in sm or "maxnreg" in self.options:
            return compiled
        best, kept = compiled, None
        for ceiling in sorted({compiled.n_regs, MAX_REGISTERS}):
            options = dict(self.options, maxnreg=ceiling)
            again = self.fn.warmup(*pointers, *self.scalars, grid=self.grid, **options)
            load_binary(again)
            if getattr(again, "n_spills", 0) < best.n_spills:
                best, kept = again, options
            if not best.n_spills:
                break
        if kept is not None:
            self.options, self.compiled = kept, {}
        return best

    def __call__(self, *pointers: torch.Tensor) -> None:
        if DIRECT:
            fn = self.fn
            try:
                active = driver.active
            except RuntimeError:  # no GPU driver: Triton's own path decides (the kernel audit records it there)
                if self.refit is not None:  # planned as for a GPU: the audit's recorder compiles for its target
                    warp_size, arch = planned_target()
                    self._fit(pointers, CDNA if warp_size == 64 else sm_limits(arch))
                self.fn[self.grid](*pointers, *self.scalars, **self.options)
                return
            device = active.get_current_device()
            # Triton specializes a pointer on whether it is 16-byte aligned: all of them, usually.
            if self.checked(pointers) & 15:
                key = (device, tuple([p & 15 == 0 for p in map(_data_ptr, pointers)]))
            else:
                key = device
            found = self.compiled.get(key)
            if found is not None and not (fn.pre_run_hooks or hooks_set()):
                run, function, metadata, _ = found
                run(
                    *self.grid,
                    1,
                    active.get_current_stream(device),
                    function,
                    metadata,
                    None,
                    None,
                    None,
                    *pointers,
                    *self.args_after,
                )
                return
            if self.refit is not None:
                self._fit(pointers, device_sm(device))
            entry = direct_entry(fn[self.grid](*pointers, *self.scalars, **self.options))
            if entry is not None:
                self.compiled[key] = entry
            return
        if self.refit is not None and not _knobs.interpret:  # a Triton not in VERIFIED, on a GPU
            self._fit(pointers, device_sm(torch.cuda.current_device()))
        self.fn[self.grid](*pointers, *self.scalars, **self.options)
