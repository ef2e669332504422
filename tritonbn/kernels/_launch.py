"""Launching a kernel the way torch inductor does: find its compiled kernel once, then call it.

``kernel[grid](*args)`` runs Triton's ``JITFunction.run`` on every call: it binds and specializes
every argument, hashes a cache key, checks the kernel's globals and builds launch metadata, about
20 µs of Python per launch before the C launcher (``benchmarks/host_overhead.py`` measures it).
tritonbn's launchers already know most of what Triton specializes on: every integer argument and
constexpr follows from the plan and the dtypes, which their own caches are keyed by (see
:class:`Launch`). What is left is each pointer's 16-byte alignment, and the current device. So a
:class:`Launch` finds the ``CompiledKernel`` once per (device, alignment) through Triton's own path
(``kernel[grid](...)``, which also launches it), keeps it alive, and from then on calls its C
launcher directly, with the same positional layout ``JITFunction.run`` ends in (Triton 3.6 to 3.9)::

    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *every_argument)

where the metadata and both hooks are ``None`` (Triton passes empty hook chains, and metadata that
only hooks read; the C launcher accepts ``None`` for all three). Every parameter is passed, the
constexprs included, which the C launcher skips. ``tests/test_launch.py`` checks, over a fake
driver, that every launch of the module path calls the same ``CompiledKernel`` with the same grid,
stream and arguments as ``JITFunction.run`` would.

Triton's own path runs instead:

* under the Triton interpreter (CPU tensors: there is no compiled kernel);
* while a launch hook is set (a profiler such as proton) or the kernel has pre-run hooks;
* when the installed Triton is not one whose launch layout was checked (:data:`VERIFIED`);
* for the first launch of each (plan, device, alignment), which compiles or finds the kernel;
* when Triton has no active GPU driver (``benchmarks/kernel_audit.py`` records launches on a machine
  without a GPU through Triton's path).

Triton's compile options that it reads from the environment on each call (``TRITON_DEBUG``, the
instrumentation mode) are read when a kernel is first found for a plan, as in inductor.
"""

from __future__ import annotations

import operator
from functools import reduce

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver

# Triton versions whose JITFunction.run / CompiledKernel / C launcher layout the direct call follows
# (checked in each release's runtime/jit.py, compiler/compiler.py, knobs.py and nvidia driver).
VERIFIED = ((3, 6), (3, 9))


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def direct_supported() -> bool:
    """Whether launches may skip ``JITFunction.run``: a checked Triton, and no interpreter."""
    if knobs.runtime.interpret:
        return False
    low, high = VERIFIED
    return low <= _version(triton.__version__) <= high


DIRECT = direct_supported()
_data_ptr = torch.Tensor.data_ptr
_hooks = knobs.runtime  # its launch hook chains: a hook set there must see every launch


class Launch:
    """One kernel, launched with one plan: the grid, the arguments after the pointers, the constexprs.

    ``tail`` holds the non-pointer arguments in the kernel's order, then come the ``constexprs``
    (by name). The kernel's parameters must be its pointers first and its constexprs last, which
    the constructor checks. A launcher builds one ``Launch`` per key that fixes everything Triton
    specializes on except the pointers' alignment and the device: the plan (sizes and strides),
    every pointer's dtype, the flags. ``launch(*pointers)`` then launches the kernel.
    """

    __slots__ = ("fn", "grid", "scalars", "options", "args_after", "compiled", "tickets", "scratch")

    def __init__(
        self, fn, grid: tuple[int, int], tail: tuple, constexprs: dict, num_warps: int, pointers: int,
        tickets: int = 0, scratch: int = 0,
    ):  # fmt: skip
        self.fn = fn
        self.tickets = tickets  # ticket counters and float64 scratch values it needs from the workspace
        self.scratch = scratch
        self.grid = grid
        self.scalars = tail
        self.options = dict(constexprs, num_warps=num_warps)
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

    def __call__(self, *pointers: torch.Tensor) -> None:
        if DIRECT:
            fn = self.fn
            try:
                active = driver.active
            except RuntimeError:  # no GPU driver: Triton's own path decides (the kernel audit records it there)
                self.fn[self.grid](*pointers, *self.scalars, **self.options)
                return
            device = active.get_current_device()
            # Triton specializes a pointer on whether it is 16-byte aligned: all of them, usually.
            if reduce(operator.or_, map(_data_ptr, pointers)) & 15:
                key = (device, tuple([p & 15 == 0 for p in map(_data_ptr, pointers)]))
            else:
                key = device
            found = self.compiled.get(key)
            if found is not None and not (
                _hooks.launch_enter_hook.calls or _hooks.launch_exit_hook.calls or fn.pre_run_hooks
            ):
                run, function, metadata, _ = found
                run(*self.grid, 1, active.get_current_stream(device), function, metadata, None, None, None,
                    *pointers, *self.args_after)  # fmt: skip
                return
            compiled = fn[self.grid](*pointers, *self.scalars, **self.options)
            if compiled is not None and hasattr(compiled, "packed_metadata"):
                # Kept alive here: since Triton 3.8 a collected CompiledKernel unloads its module.
                self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata, compiled)
            return
        self.fn[self.grid](*pointers, *self.scalars, **self.options)
