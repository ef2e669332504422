"""The one selector of a backend (:mod:`tritonbn.backends`): the Triton kernels or the pure-PyTorch backend.

``TRITONBN_BACKEND`` (read at each call) chooses:

* ``auto`` (default): Triton for CUDA tensors; for CPU tensors Triton only when the kernels were
  loaded under the Triton interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is imported),
  otherwise the PyTorch backend. Below the tested floor (torch 2.8 with Triton 3.4,
  :func:`tritonbn._compat.kernels_version_problem`) a call that would run the kernels raises an
  error naming the versions found and needed.
* ``triton``: always the kernels; an error explains why when they cannot run on the input.
* ``torch``: always the PyTorch backend.

:func:`ops_for` returns a :class:`Backend`: the four launchers of the chosen backend (in the data path's form and
under their public signatures), and its local path where it has one. The data path, ``running_stats`` and
``diagnose`` all reach a backend through it.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from tritonbn import _compat
from tritonbn.backends import torch as _torch_module
from tritonbn.backends.launchers import Launchers, Operands, Options

BACKENDS = ("auto", "triton", "torch")


class Backend(Launchers):
    """One backend, as the data path sees it: its ``name``; its four launchers (:class:`Launchers`: ``stats``,
    ``elemt``, ``backward_reduce``, ``backward_elemt``, and the public ``batch_norm_stats`` and the rest over them);
    ``local``: the module of its local path (``forward``, ``backward``, ``recorded``: see
    :mod:`tritonbn.backends.torch.local`), or ``None`` where it has none (the Triton kernels); and ``prepare``:
    ``record -> launchers``, the same launchers for the eager calls of one layer that match a checked record, which
    find their launches once (:mod:`tritonbn.backends.triton._prepared`), or ``None`` (the PyTorch backend)."""

    __slots__ = ("name", "local", "prepare")

    def __init__(self, name: str, module: ModuleType) -> None:
        own = module.launchers
        super().__init__(own.stats, own.elemt, own.backward_reduce, own.backward_elemt)
        self.name = name
        self.local = getattr(module, "local", None)  # capabilities a backend may offer
        self.prepare = getattr(module, "prepare", None)

    def __repr__(self) -> str:
        return f"<tritonbn backend {self.name!r}>"


_torch_backend = Backend("torch", _torch_module)
_kernels: Backend | None = None
_kernels_error: str | None = None
_below_floor = False  # torch or Triton older than tritonbn's floor (_compat.TORCH_FLOOR, TRITON_FLOOR)


def _load_kernels() -> Backend | None:
    global _kernels, _kernels_error, _below_floor
    if _kernels is None and _kernels_error is None:
        try:
            problem = _compat.kernels_version_problem()
            if problem is not None:  # checked before the kernels' modules import what these versions lack
                _kernels_error, _below_floor = problem, True
                return None
            from tritonbn.backends import triton

            _kernels = Backend("triton", triton)
        except ImportError as e:  # triton missing or broken on this platform
            _kernels_error = f"triton could not be imported ({e})"
    return _kernels


_interpreted: bool | None = None


def interpreted() -> bool:
    """Whether the Triton kernels were loaded under the Triton interpreter."""
    global _interpreted
    if _interpreted is None:
        kernels = _load_kernels()
        if kernels is None:
            return False
        from tritonbn.backends.triton.stats import _batch_norm_stats_kernel

        _interpreted = type(_batch_norm_stats_kernel).__name__ == "InterpretedFunction"
    return _interpreted


def _triton_unusable(x: torch.Tensor) -> str | None:
    """Why the kernels cannot run on ``x``, or ``None`` when they can."""
    if _load_kernels() is None:
        return _kernels_error
    if x.is_cuda or interpreted():
        return None
    return _needs_interpreter("cpu" if x.is_cpu else x.device.type)  # (read at every CPU call: no string built)


@functools.cache
def _needs_interpreter(device_type: str) -> str:
    return (
        f"tensors on {device_type} need the Triton interpreter: set TRITON_INTERPRET=1 before triton is "
        "imported (before importing tritonbn), or use TRITONBN_BACKEND=torch"
    )


backend_variable = _compat.environ_reader("TRITONBN_BACKEND")  # its value (None where unset), read at each call


def selected() -> str:
    """The value of ``TRITONBN_BACKEND``, checked."""
    name = backend_variable()
    if name is None or name in BACKENDS:  # the common cases, without string work
        return name or "auto"
    name = name.strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"TRITONBN_BACKEND must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def ops_for(x: torch.Tensor) -> Backend:
    """The backend whose launchers (``batch_norm_stats`` and the rest) run on ``x``."""
    name = selected()
    if name == "torch":
        return _torch_backend
    why = _triton_unusable(x)
    if why is None:
        return _kernels
    if name == "triton":
        raise RuntimeError(f"TRITONBN_BACKEND=triton, but the Triton kernels cannot run here: {why}")
    if _below_floor and (x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")):
        raise RuntimeError(why)  # the kernels were asked for (a GPU, or the interpreter): not a silent fallback
    return _torch_backend


def name_for(x: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the backend a call on ``x`` would use."""
    return ops_for(x).name


def update_running_stats(stats: torch.Tensor, running_mean, running_var, num_batches_tracked, momentum, eps) -> None:
    """One update of running statistics from the global sums ``stats`` (pooled micro-batches, or another rank's step)
    with a layer's ``momentum`` and ``eps``: the training forward's own update, by the chosen backend's elementwise
    launcher on an empty batch, on the device."""
    mean = running_mean
    empty = torch.empty((0, mean.shape[0]), dtype=mean.dtype, device=mean.device)
    t = Operands(empty, None, None, mean, running_var, num_batches_tracked)
    ops_for(empty).elemt(Options(momentum, eps, None, 0.01), t, stats.to(mean.device), True)
