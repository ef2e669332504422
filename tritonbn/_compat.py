"""Every private torch and Triton API that tritonbn uses, in one place.

An upgrade of torch or Triton is checked here first. Each entry says what it is for, the versions
it was read in (torch 2.13 and Triton 3.9 unless said otherwise; the Triton launch layout also in
3.6), and the public fallback where one exists. Nothing else in the package reads a private
attribute of torch or Triton. Importing this module imports torch only: the Triton entries import
Triton when called, so ``import tritonbn`` works without it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import forward_ad as _forward_ad

# --- torch: autograd state, read on every call (kept as direct aliases: the host path counts ns) -----

# The id of the graph task that autograd's engine is running, -1 outside backward: a forward inside a
# backward is an activation-checkpointing recompute, which must not update the running statistics.
# No public equivalent.
current_graph_task_id = torch._C._current_graph_task_id

# Whether a torch.func transform (vmap, grad, jvp, ...) is active. Eager calls skip the custom ops
# only when none is. No public equivalent (torch._C._functorch.is_functorch_wrapped_tensor is per tensor).
functorch_transforms_active = torch._C._are_functorch_transforms_active

# How many TorchDispatchModes are active (make_fx, FakeTensorMode, ...). Public fallback where it
# disappears: torch.utils._python_dispatch._get_current_dispatch_mode() is not None (also private).
dispatch_stack_len = torch._C._len_torch_dispatch_stack


def forward_ad_active() -> bool:
    """Whether forward-mode AD (``torch.autograd.forward_ad.dual_level``) is on: its private level counter."""
    return _forward_ad._current_level >= 0


# --- torch.distributed ----------------------------------------------------------------------------


def resolve_process_group(name: str):
    """The process group registered as ``name``: the custom ops take a group by name (a str is traceable).

    ``torch.distributed.distributed_c10d._resolve_process_group`` (torch 2.4 to 2.13; functional
    collectives use the same registry).
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


if dist.is_available():
    from torch.distributed.distributed_c10d import GroupMember

    def default_group():
        """The default process group object, ``None`` before ``init_process_group``.

        ``GroupMember.WORLD`` (public in practice, though not documented); a layer keeps the world it
        resolved its groups against and resolves again when a new one is made.
        """
        return GroupMember.WORLD

else:

    def default_group():
        return None


# --- torch.cuda -------------------------------------------------------------------------------------

# The raw cudaStream_t of a device's current stream, without building a torch.cuda.Stream object (a
# workspace is kept per stream). Public fallback: torch.cuda.current_stream(index).cuda_stream (slower).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(index: int) -> int:
    if _raw_stream is None:
        return torch.cuda.current_stream(index).cuda_stream
    return _raw_stream(index)


# --- Triton -----------------------------------------------------------------------------------------

# Triton versions whose launch layout the direct launch follows (tritonbn.kernels._launch): the
# JITFunction.run -> CompiledKernel.run call, read in runtime/jit.py, compiler/compiler.py, knobs.py and
# the nvidia driver of each release in this range. Outside it, every launch goes through Triton's own
# JITFunction.run (public, slower on the host).
DIRECT_LAUNCH_VERIFIED = ((3, 6), (3, 9))


def triton_runtime_knobs():
    """``triton.knobs.runtime``: whether the interpreter is on, and the launch-hook chains.

    Triton >= 3.4. Read for ``interpret`` (``TRITON_INTERPRET``) and ``launch_enter_hook`` /
    ``launch_exit_hook`` (a profiler such as proton sets them; the direct launch then steps aside).
    """
    from triton import knobs

    return knobs.runtime


def launch_hook_chains() -> tuple:
    """Triton's launch-hook chains ``(enter, exit)``: a hook is set on a chain when its ``calls`` list is not
    empty (Triton 3.6 to 3.9); the direct launch then steps aside, so that the hook sees every launch."""
    runtime = triton_runtime_knobs()
    return runtime.launch_enter_hook, runtime.launch_exit_hook


def triton_driver():
    """``triton.runtime.driver.driver``: its ``active`` driver gives the current device and stream."""
    from triton.runtime.driver import driver

    return driver


def load_binary(compiled) -> None:
    """Load a ``CompiledKernel``'s module so that ``n_regs`` is known: ``CompiledKernel._init_handles()``
    (Triton 3.0 to 3.9; absent in the interpreter)."""
    if hasattr(compiled, "_init_handles"):
        compiled._init_handles()


def direct_entry(compiled) -> tuple | None:
    """What the direct launch keeps of a ``CompiledKernel``: ``(run, function, packed_metadata, compiled)``.

    ``compiled.run`` is the C launcher; it is called as
    ``run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook,
    exit_hook, *every_argument)`` (Triton 3.6 to 3.9), ``None`` for the last three. ``compiled`` is kept
    alive too: since Triton 3.8 a collected CompiledKernel unloads its module. ``None`` where the kernel
    has no such launcher.
    """
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return None
    return compiled.run, compiled.function, compiled.packed_metadata, compiled
