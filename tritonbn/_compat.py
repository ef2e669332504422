"""Every private torch and Triton API that tritonbn uses, in one place.

An upgrade of torch or Triton is checked here first. Each entry says what it is for, the versions
it was read in (torch 2.13 and Triton 3.9 unless said otherwise; the Triton launch layout in 3.4,
3.5, 3.6 and 3.9), and the public fallback where one exists. Nothing else in the package reads a private
attribute of torch or Triton. Importing this module imports torch only: the Triton entries import
Triton when called, so ``import tritonbn`` works without it.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.autograd import forward_ad as _forward_ad

# --- Python: the environment, read on every call -------------------------------------------------------------


def environ_reader(key: str):
    """A function that reads ``os.environ[key]`` (``None`` where unset) at each call, as ``os.environ.get`` does.

    ``os.environ.get`` of an unset variable costs a caught ``KeyError`` (about 0.7 us, at every layer call): CPython's
    ``os.environ`` keeps the current values in ``_data`` (what ``putenv``, ``monkeypatch.setenv`` and ``del`` update),
    which is read here directly where it exists."""
    environ = os.environ
    data, encode, decode = (getattr(environ, name, None) for name in ("_data", "encodekey", "decodevalue"))
    if not (isinstance(data, dict) and callable(encode) and callable(decode)):
        return lambda: environ.get(key)
    encoded = encode(key)
    last = [None, None]  # the last value read and its decoding

    def read() -> str | None:
        value = data.get(encoded)
        if value is None:
            return None
        if value is not last[0]:
            last[:] = value, decode(value)
        return last[1]

    return read


# --- torch: foreach ops (one call over a list of tensors, as torch.optim uses them) ---------------------------

# ``r + momentum * (value - r)`` over both running buffers in one call each (the PyTorch backend's float64 update of
# buffers of another type: tritonbn/backends/torch/local.py). Lists of mixed dtypes take torch's per-tensor path,
# with each op's usual type promotion. torch._foreach_sub / _foreach_add_, read in torch 2.8 and 2.13. No public
# equivalent (two calls of torch.sub / Tensor.add_ each).
foreach_sub = torch._foreach_sub
foreach_add_ = torch._foreach_add_
# The float32 copies of 16-bit running buffers, copied back into them in one call (the same file): 2 µs less than two
# Tensor.copy_ calls on a small layer. torch._foreach_copy_ (since torch 2.1, pytorch#107226; read in torch 2.13): lists
# of two dtypes take its per-tensor path, each a Tensor.copy_ that rounds into the destination's dtype.
foreach_copy_ = torch._foreach_copy_


# --- torch: autograd state, read on every call (kept as direct aliases: the host path counts ns) -----

# The id of the graph task that autograd's engine is running, -1 outside backward: a forward inside a
# backward is an activation-checkpointing recompute, which must not update the running statistics.
# No public equivalent.
current_graph_task_id = torch._C._current_graph_task_id

# Whether a torch.func transform (vmap, grad, jvp, ...) is active. Eager calls skip the custom ops
# only when none is. No public equivalent (torch._C._functorch.is_functorch_wrapped_tensor is per tensor).
functorch_transforms_active = torch._C._are_functorch_transforms_active

# The autograd node the engine is running (None outside backward): a forward inside backward that an autograd
# Function's backward runs (use_reentrant=True checkpointing, a torch.compile'd graph's backward) runs under that
# Function's node, the very ``ctx`` object its forward was given. Read in torch 2.8 and 2.13. No public equivalent.
current_autograd_node = torch._C._current_autograd_node

# This thread's autograd sequence number: every node made (every Function.apply, with or without grad) takes the
# next one, so it stays the same through the forward of one Function (its node made first, nothing recorded under
# its no-grad forward). torch.autograd._get_sequence_nr, read in torch 2.8 and 2.13. No public equivalent.
sequence_nr = torch.autograd._get_sequence_nr

# How many TorchDispatchModes are active (make_fx, FakeTensorMode, ...). Public fallback where it
# disappears: torch.utils._python_dispatch._get_current_dispatch_mode() is not None (also private).
dispatch_stack_len = torch._C._len_torch_dispatch_stack


def torch_function_subclass(t) -> bool:
    """Whether ``t`` is a tensor subclass that works at the ``__torch_function__`` level only (as MONAI's
    MetaTensor): its own ``__torch_function__`` (not disabled, as ``nn.Parameter``'s is) and no
    ``__torch_dispatch__`` (FakeTensor, FunctionalTensor and DTensor have one: they trace the custom ops).
    ``torch._C._disabled_torch_function_impl`` / ``_disabled_torch_dispatch_impl``, read in torch 2.8 to 2.13.
    No public equivalent (``torch.overrides.has_torch_function`` is also true under a dispatch subclass)."""
    cls = type(t)
    return (
        cls is not torch.Tensor
        and isinstance(t, torch.Tensor)
        and cls.__torch_function__ is not torch._C._disabled_torch_function_impl
        and cls.__torch_dispatch__ is torch._C._disabled_torch_dispatch_impl
    )


def forward_ad_active() -> bool:
    """Whether forward-mode AD (``torch.autograd.forward_ad.dual_level``) is on: its private level counter."""
    return _forward_ad._current_level >= 0


def checkpoint_frame():
    """``(frame, replaying)`` when torch.utils.checkpoint's non-reentrant form (``use_reentrant=False``, also behind
    ``checkpoint_sequential`` and selective checkpointing) runs the current call: its ``_CheckpointFrame`` (one per
    checkpointed call), ``replaying`` True in the recompute; else ``None``.

    The first forward runs under the frame's ``_checkpoint_hook`` and the recompute under its
    ``_recomputation_hook``, both ``saved_tensors_hooks`` whose pack hook closes over the frame (``frame``, or the
    weak reference ``target_frame_ref``): read through ``torch._C._autograd._top_saved_tensors_default_hooks`` and
    the closure cells, in torch 2.8 and 2.13 (2.13 wraps the recompute's pack hook in ``torch._dynamo.disable``,
    unwrapped through ``__wrapped__``). Other saved-tensor hooks (``save_on_cpu``, other libraries') give ``None``.
    No public equivalent.
    """
    hooks = _top_saved_tensors_hooks(False)
    if hooks is None:
        return None
    pack = getattr(hooks[0], "__wrapped__", hooks[0])
    where = getattr(pack, "__qualname__", "")
    if not where.startswith(("_checkpoint_hook.", "_recomputation_hook.")) or pack.__closure__ is None:
        return None
    cells = dict(zip(pack.__code__.co_freevars, pack.__closure__, strict=True))
    if "frame" in cells:
        return cells["frame"].cell_contents, False
    if "target_frame_ref" in cells:
        frame = cells["target_frame_ref"].cell_contents()
        return (frame, True) if frame is not None else None
    return None


def function_of_ctx(ctx):
    """The autograd Function class whose forward got ``ctx``, or ``None`` when ``ctx`` is no Function's context:
    ``torch.autograd.function.BackwardCFunction`` and its ``_forward_cls`` (torch 2.8 to 2.13)."""
    if isinstance(ctx, torch.autograd.function.BackwardCFunction):
        return getattr(type(ctx), "_forward_cls", None)
    return None


# Whether torch.jit.trace (or the TorchScript ONNX exporter, which traces with it) records the current call: what
# torch.jit.is_tracing() returns outside TorchScript, without its two Python frames (read at every eager call).
# torch._C._is_tracing, read in torch 2.8 and 2.13; public fallback torch.jit.is_tracing.
jit_tracing = getattr(torch._C, "_is_tracing", torch.jit.is_tracing)


def version_of(tensor: torch.Tensor) -> int:
    """``tensor._version``: autograd's count of in-place changes to ``tensor`` (documented in autograd's notes)."""
    return tensor._version


_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None)


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Check a one-element bool tensor on its device, without a host synchronization (masked BatchNorm's
    ``lengths`` on a GPU): ``aten._assert_async.msg``, a device-side assertion on CUDA, a ``RuntimeError``
    with ``message`` on CPU. Read in torch 2.8 to 2.13. No public equivalent."""
    torch.ops.aten._assert_async.msg(condition, message)


@contextlib.contextmanager
def tracer_paused():
    """Pause ``torch.jit.trace``'s tracer (also the TorchScript ONNX exporter's) for the body: tensor sizes read there
    are Python ints, and nothing is recorded. The argument checks run so on the example input, as in eager, where
    traced sizes would make every comparison warn (``TracerWarning``) that it becomes a constant of the trace.
    ``torch._C._get_tracing_state`` / ``_set_tracing_state``, present in torch 2.8 to 2.13. No public equivalent
    (``torch.jit.is_tracing()`` only reads the state)."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


# --- torch.export -----------------------------------------------------------------------------------


def exporting() -> bool:
    """Whether ``torch.export`` is tracing this call, not ``torch.compile``: strict and non-strict export, and so
    ``torch.onnx.export(dynamo=True)`` and AOTInductor, which go through it.

    ``torch.compiler._is_exporting_flag``: ``torch._export.utils._compiling_state_context`` sets it around strict
    export's dynamo trace and non-strict export's make_fx trace (torch/export/_trace.py, torch/_dynamo/eval_frame.py),
    and ``torch.compile`` never does. Dynamo reads a module's bool attribute as a constant with a guard (a change of
    the flag recompiles), so inside a traced graph this is the flag's value at trace time. The public
    ``torch.compiler.is_exporting()`` returns the same flag in eager code, but dynamo does not call it: torch 2.8 to
    2.11 fold it to the constant True whenever dynamo traces (``tracing_state_functions`` in
    torch/_dynamo/variables/torch.py), under ``torch.compile`` too; 2.12 and 2.13 read the flag there. Checked on
    torch 2.8, 2.9, 2.10, 2.11, 2.12 and 2.13: false under ``torch.compile``, true under strict and non-strict
    export, and under ``torch.onnx.export(dynamo=True)`` (2.8, 2.11 and 2.13; it calls ``torch.export.export``).
    Public fallback, where the flag disappears: ``torch.compiler.is_exporting()``.
    """
    if _exporting_flag_known:
        return torch.compiler._is_exporting_flag
    return torch.compiler.is_exporting()


_exporting_flag_known = hasattr(torch.compiler, "_is_exporting_flag")


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


def group_timeout(group, device: torch.device):
    """The timeout ``group`` was made with (its backend's options for ``device``), for a group made from it to fail
    as soon; ``None`` where it cannot be read. ``ProcessGroup._get_backend(device).options._timeout``, read in torch
    2.8 and 2.13 (gloo and NCCL). No public equivalent."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def run_first(join, index: int) -> None:
    """Make the hook of ``join``'s joinable ``index`` the first that ``Join.__exit__`` runs, main and post hooks
    alike, leaving the joinables' order (the first one's per-iteration count, which DDP divides by) as it is.
    ``Join._join_hooks``, read in torch 2.8 and 2.13 (a list, one hook per joinable, in their order). No public
    equivalent."""
    hooks = join._join_hooks
    hooks.insert(0, hooks.pop(index))


# --- torch.cuda -------------------------------------------------------------------------------------

# The raw cudaStream_t of a device's current stream, without building a torch.cuda.Stream object (a
# workspace is kept per stream). Public fallback: torch.cuda.current_stream(index).cuda_stream (slower).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(index: int) -> int:
    if _raw_stream is None:
        return torch.cuda.current_stream(index).cuda_stream
    return _raw_stream(index)


# --- Triton -----------------------------------------------------------------------------------------

# The oldest torch and Triton tritonbn is tested with (the oldest pair CI runs, scripts/oldest.sh). Below
# them: Triton 3.3 and older have no ``triton.knobs`` and crash compiling ``tl.gather`` for sm_90
# (``GatherLoweringHelper`` assertion, 3.3), Triton 3.1's interpreter gives wrong numbers, and torch 2.7
# and older pin those Tritons. ``import tritonbn`` works below the floor; the first call that needs the
# kernels raises :func:`kernels_version_problem`'s message.
TORCH_FLOOR = (2, 8)
TRITON_FLOOR = (3, 4)


def version_tuple(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string: ``"2.8.0+cu128"`` -> ``(2, 8)``, ``"3.10.0rc1"`` -> ``(3, 10)``."""
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def kernels_version_problem(torch_version: str | None = None, triton_version: str | None = None) -> str | None:
    """Why the Triton kernels cannot run with these versions (the installed ones by default), or ``None``.

    The message names tritonbn, the versions found and the versions needed.
    """
    if torch_version is None:
        torch_version = torch.__version__
    if triton_version is None:
        import triton

        triton_version = triton.__version__
    if version_tuple(torch_version) >= TORCH_FLOOR and version_tuple(triton_version) >= TRITON_FLOOR:
        return None
    need = f"torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]} with triton>={TRITON_FLOOR[0]}.{TRITON_FLOOR[1]}"
    return (
        f"tritonbn's Triton kernels need {need}; found torch {torch_version} with triton {triton_version}. "
        "Upgrade torch (it brings its Triton), or use the PyTorch backend: TRITONBN_BACKEND=torch"
    )


# Compile options every launch passes, whatever the environment says. ``enable_fp_fusion``: the kernels'
# numerics were audited with FMA fusion on, Triton's default up to 3.9 (``TRITON_DEFAULT_FP_FUSION``,
# read when the option is not given; Triton 3.9 warns that 3.10 turns its default off). Passing it
# keeps fusion on in 3.4 to 3.10+ and silences 3.9's warning. The interpreter ignores it.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


def interpreter_shims() -> list[str]:
    """Fix the Triton interpreter where it fails on this NumPy; returns what was patched.

    Triton 3.4 to 3.6: a scalar tensor's ``__index__`` (used by ``range`` bounds and ``tl.static_range``)
    is ``int(handle.data)`` of a one-element array, which NumPy 2.4 refuses ("only 0-dimensional arrays
    can be converted to Python scalars"; deprecated since NumPy 1.25). Triton 3.7 squeezes the array
    first; the shim does the same, in ``triton.runtime.interpreter._patch_lang_tensor``, which
    re-patches ``triton.language.tensor`` on every launch. Called once, when the kernels are loaded
    under the interpreter.
    """
    import triton
    from triton.runtime import interpreter

    if not (3, 4) <= version_tuple(triton.__version__) <= (3, 6):
        return []
    original = interpreter._patch_lang_tensor
    if getattr(original, "_tritonbn_shim", False):
        return ["_patch_lang_tensor"]

    def patch_lang_tensor(tensor, *args, **kwargs):
        original(tensor, *args, **kwargs)
        tensor.__index__ = _scalar_index

    patch_lang_tensor._tritonbn_shim = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return ["_patch_lang_tensor"]


def _scalar_index(self) -> int:
    return int(self.handle.data.reshape(()))


# Triton versions whose launch layout the direct launch follows (tritonbn.kernels._launch): the
# JITFunction.run -> CompiledKernel.run call, read in runtime/jit.py, compiler/compiler.py, knobs.py and
# the nvidia driver of 3.4, 3.5, 3.6 and 3.9, and checked over a fake driver with each of them
# (tests/helpers/launch_check.py: 240 launches, 130 direct, no mismatch). Outside it, every launch goes
# through Triton's own JITFunction.run (public, slower on the host).
DIRECT_LAUNCH_VERIFIED = ((3, 4), (3, 9))


def triton_runtime_knobs():
    """``triton.knobs.runtime``: whether the interpreter is on, and the launch-hook chains.

    Triton >= 3.4. Read for ``interpret`` (``TRITON_INTERPRET``) and ``launch_enter_hook`` /
    ``launch_exit_hook`` (a profiler such as proton sets them; the direct launch then steps aside).
    """
    from triton import knobs

    return knobs.runtime


def launch_hooks_set():
    """A function telling whether a Triton launch hook is set: the direct launch then steps aside, so that
    the hook sees every launch (a profiler such as proton sets one).

    Triton 3.5 to 3.9: ``launch_enter_hook`` / ``launch_exit_hook`` are hook chains, set when their ``calls``
    list is not empty. Triton 3.4: plain attributes, a callable or ``None`` (read in its knobs.py).
    """
    runtime = triton_runtime_knobs()
    if hasattr(runtime.launch_enter_hook, "calls"):
        enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
        return lambda: bool(enter.calls or exit_.calls)
    return lambda: runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None


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
    exit_hook, *every_argument)`` (Triton 3.4 to 3.9), ``None`` for the last three. ``compiled`` is kept
    alive too: since Triton 3.8 a collected CompiledKernel unloads its module. ``None`` where the kernel
    has no such launcher.
    """
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return None
    return compiled.run, compiled.function, compiled.packed_metadata, compiled
