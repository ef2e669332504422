"""Activation-checkpointing recomputes: the first forward's statistics again, with no second collective.

Activation checkpointing runs a segment's forward a second time during backward (a *recompute*). A tritonbn layer's
recompute takes the global statistics its first forward all-reduced instead of all-reducing again, and leaves the
running statistics, ``num_batches_tracked`` and an ``accumulate_stats`` sink alone: one collective per pass. The
first forward's ``stats`` are those the non-checkpointed step would use, so outputs and gradients are bitwise the same.

Where the statistics are kept, a *region*: the object the first forward and its recompute both see, which holds a
ledger (per layer name, the statistics of its calls in call order) for as long as the recompute may come:

* ``torch.utils.checkpoint(use_reentrant=False)``, ``checkpoint_sequential`` over it, selective checkpointing: the
  checkpoint's frame (:func:`tritonbn._compat.checkpoint_frame`), whose saved-tensor hooks run both passes;
* an autograd Function whose backward runs its forward again: ``use_reentrant=True`` checkpointing, and the graph
  ``torch.compile`` builds, whose backward graph recomputes what AOT autograd's partitioner chose to. The first forward
  runs inside the Function's forward (found up the Python stack, once per autograd sequence number: see
  :func:`enclosing_function`), the recompute while the engine runs that Function's node.

A recompute takes the next entry of its layer in its region (per backward, so that a second backward over a retained
graph takes them again): torch's checkpoint replays saved tensors in that order too. It makes its first forward's
launches (the local sums, then the output: the PyTorch backend writes the output over the copy its sums leave), not
its collective. It checks that the entry is its own, and raises where it is not (with ``TRITONBN_DEBUG=1`` at this
rank's next signature check, where every rank raises):

* always, on the host and for free: the input's shape, dtype and device, the mask's shape, and the versions of the
  layer's weight and bias (an optimizer step between the forward and its recompute);
* on CPU tensors, and with ``TRITONBN_DEBUG=1`` on any device: this rank's local sums, bitwise, against its first
  forward's. On a GPU that comparison would synchronize the host, so without ``TRITONBN_DEBUG=1`` a recompute whose
  values differ (a random layer before the BatchNorm without checkpoint's RNG preservation) is not detected there:
  it normalizes with the first forward's statistics.

A recompute that finds no region or no entry (a checkpoint implementation other than torch's, nested checkpoints)
all-reduces again, as every rank does alike.
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch

from tritonbn._compat import (
    checkpoint_frame,
    current_autograd_node,
    current_graph_task_id,
    function_of_ctx,
    sequence_nr,
    version_of,
)
from tritonbn._signature import check_signature, debug_enabled, defer_error, signature
from tritonbn.lockstep import all_reduce_stats

_LEDGER = "_tritonbn_ledger"  # the attribute a region keeps its ledger in


class _Entry:
    """One first forward: its global ``stats`` and what its recompute must match."""

    __slots__ = ("stats", "shape", "dtype", "device", "mask_shape", "versions", "local")

    def __init__(self, operands, stats, local) -> None:
        x, mask = operands.input, operands.mask
        self.stats, self.shape, self.dtype, self.device = stats, x.shape, x.dtype, x.device
        self.mask_shape = None if mask is None else mask.shape
        self.versions = _versions(operands)
        self.local = local  # this rank's own sums, kept with TRITONBN_DEBUG=1

    def difference(self, operands) -> str | None:
        x, mask = operands.input, operands.mask
        if (x.shape, x.dtype, x.device) != (self.shape, self.dtype, self.device):
            return (
                f"its input is {tuple(x.shape)} {x.dtype} on {x.device}, the first forward's "
                f"{tuple(self.shape)} {self.dtype} on {self.device}"
            )
        if (None if mask is None else mask.shape) != self.mask_shape:
            return "its mask differs in shape from the first forward's"
        if _versions(operands) != self.versions:
            return "its weight or bias changed in place since the first forward (an optimizer step before backward?)"
        return None


def _versions(operands) -> tuple:
    return tuple(None if p is None else version_of(p) for p in (operands.weight, operands.bias))


class _Ledger:
    """A region's first forwards, per layer name in call order, and each backward's position in them."""

    __slots__ = ("calls", "next")

    def __init__(self) -> None:
        self.calls: dict[str, list[_Entry]] = {}
        self.next: dict[tuple[int, str], int] = {}


# --- finding the region -------------------------------------------------------------------------------------


_found = threading.local()  # per thread (sequence numbers are per thread): (sequence number, weakref or None)


def enclosing_function():
    """The ``ctx`` of the autograd Function (not tritonbn's) whose forward runs this call, or ``None``.

    Walks up the Python stack to the nearest frame of a Function's forward, once per autograd sequence number: a
    Function's node is made before its forward runs and no node is made under its no-grad forward, so every call in
    one such forward shares a number. The answer kept for a number may outlive the forward it was found in (calls
    made after it returns, before any new node): they are added after the forward's own calls, which are replayed
    first.
    """
    stamp = sequence_nr()
    kept = getattr(_found, "last", None)
    if kept is not None and kept[0] == stamp:
        return None if kept[1] is None else kept[1]()
    ctx = None
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "ctx":
            found = frame.f_locals.get("ctx")
            function = function_of_ctx(found)
            if function is not None and not function.__module__.startswith("tritonbn"):
                ctx = found
                break
        frame = frame.f_back
    _found.last = (stamp, None if ctx is None else weakref.ref(ctx))
    return ctx


def region(backward: bool, enclosing: bool):
    """``(region, replaying)`` of a training call that synchronizes: where its first forward keeps its statistics
    (``replaying`` False) or where its recompute finds them (True); ``(None, False)`` when neither applies.

    ``backward``: the call runs inside a backward pass. ``enclosing``: the call may run inside another autograd
    Function's forward (a reentrant checkpoint's, a compiled graph's), so look for one.
    """
    found = checkpoint_frame()
    if found is not None:
        return found
    if backward:
        node = current_autograd_node()
        if node is not None and getattr(node, _LEDGER, None) is not None:
            return node, True
        return None, False
    if enclosing:
        return enclosing_function(), False
    return None, False


# --- the statistics -------------------------------------------------------------------------------------------


def global_stats(backend, settings, operands, backward: bool, enclosing: bool):
    """``(stats, replayed)``: the global packed sums of a training call over ``settings.group``.

    Both passes make the same launches: the local sums, then (the caller) the output. A first forward all-reduces
    the sums and keeps them in its region; a recompute that finds its entry takes a copy of them instead (``replayed``:
    the caller updates no running statistics and adds nothing to a sink), and one that does not all-reduces again,
    after the signature check ``TRITONBN_DEBUG=1`` makes before a collective.
    """
    t = operands
    where, replaying = region(backward, enclosing)
    stats = backend.stats(t.input, t.mask)  # the PyTorch backend's output is written over its copy
    if replaying:
        entry = _entry_of(where, settings, t, stats)
        if entry is not None:
            return entry.stats.clone(), True  # a copy: an op's output, which nothing else may hold
    if backward and debug_enabled():  # inside backward, the dispatch left the check to the pass that communicates
        check_signature(settings.group, "forward", signature(t.input, True, t.input.requires_grad), name=settings.name)
    compared = where is not None and not replaying and (t.input.device.type == "cpu" or debug_enabled())
    local = stats.clone() if compared else None
    stats = all_reduce_stats(stats, settings.group, settings.name)  # checked: ranks out of step raise
    if where is not None and not replaying:
        ledger = getattr(where, _LEDGER, None)
        if ledger is None:
            ledger = _Ledger()
            setattr(where, _LEDGER, ledger)
        ledger.calls.setdefault(settings.name, []).append(_Entry(t, stats, local))
    return stats, False


def _entry_of(where, settings, operands, local) -> _Entry | None:
    """The recompute's entry in ``where``'s ledger, checked against the recompute's input and its ``local`` sums
    (see the module docstring), or ``None``: none left."""
    ledger = getattr(where, _LEDGER, None)
    if ledger is None:
        return None
    calls = ledger.calls.get(settings.name, ())
    key = (current_graph_task_id(), settings.name)
    i = ledger.next.get(key, 0)
    if i >= len(calls):
        return None
    ledger.next[key] = i + 1
    entry = calls[i]
    difference = entry.difference(operands)
    if difference is None and entry.local is not None and not torch.equal(local, entry.local):
        difference = "its input's values differ from the first forward's (this rank's sums differ)"
    if difference is not None:
        error = RuntimeError(
            f"tritonbn: the activation-checkpointing recompute of layer {settings.name or '<functional>'!r} does not "
            f"replay its first forward: {difference}. tritonbn normalizes a recompute with the first forward's "
            "statistics; a recompute must compute what its forward computed (keep checkpoint's preserve_rng_state=True "
            "for random layers before a BatchNorm, and step the optimizer after backward)"
        )
        if not debug_enabled():
            raise error
        defer_error(settings.group, error)  # every rank raises at this rank's next signature check
    return entry
