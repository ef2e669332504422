"""Ranks out of step: every BatchNorm message carries what identifies its call, always, at 16 bytes a message.

Every rank of a process group must call its synchronized BatchNorms in the same order, in the same pass. A rank that
does not (layers called in another order or skipped, a layer in eval on one rank only, a head whose output reaches the
loss on one rank only) pairs its all-reduce with another call's. When the two messages have the same size, the sums
of different layers or passes would mix silently; so each message ends with two float64 slots, ``[f | f*f]``, where
``f`` is a small integer fingerprint of the call (its layer's qualified name, pass, channel count). After the SUM
over the ``W`` ranks of the group, ``S1 = sum f`` and ``S2 = sum f^2`` satisfy ``S1^2 == W * S2`` exactly when every
rank sent the same ``f`` (the equality case of Cauchy-Schwarz). Every rank holds the same sums, so every rank reaches
the same verdict, with no extra collective. ``f`` stays below ``2^b`` with ``W^2 * 4^b <= 2^52``, so both sides are
exact integers in float64 (``b`` is 20 up to 64 ranks, 16 at 1024).

Both passes send one message formula: ``2C + 3`` float64 values (forward ``[sum x | sum x^2 | count | f | f^2]``,
backward ``[sum dz | sum dz*xhat | 0 | f | f^2]``, the backward sums added in float64 and rounded back to their
dtype). So a forward that meets a backward of the same channel count, or a float32 rank that meets a float64 one in
backward, pairs up and is compared instead of aborting gloo (a float32 and a float64 rank of one layer compute the
right answer in both passes). Messages of different channel counts still differ in size; what that does is in
``docs/limits.md``.

What a mismatch does, with every rank alike:

* messages on the CPU (the PyTorch backend, the Triton kernels under the interpreter): reading the two slots costs
  nothing there, so every rank raises :class:`OutOfStepError` before any output or buffer is written, naming what
  each rank called (gathered on the error path alone, where every rank is at the same collective);
* messages on a GPU: nothing is read on the host. One small kernel compares the slots on the device and, on a
  mismatch, writes NaN over the whole message and notes the call in a device flag. The forward kernel then outputs
  NaN and leaves the running statistics and ``num_batches_tracked`` as they were (a NaN count is not positive), the
  backward kernel outputs NaN gradients, and :func:`check` (which synchronizes: call it where the loop syncs anyway,
  e.g. where it logs the loss) raises :class:`OutOfStepError` naming the first such call on this rank. This holds
  under CUDA graphs and ``torch.compile``.

``TRITONBN_DEBUG=1`` (:mod:`tritonbn._signature`) remains the full check, before each collective, in eval too.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from tritonbn.distributed import Relay, all_reduce_sum

__all__ = ["OutOfStepError", "check"]

TAIL = 2  # the identity slots at the end of every message: [f | f*f]
FORWARD, BACKWARD = "forward", "backward"

# Device types whose messages are checked on the host (free there); the others on the device. Tests empty it to run
# the device check (a Triton kernel, under the interpreter) on CPU tensors.
host_checked = {"cpu"}


class OutOfStepError(RuntimeError):
    """The ranks of a process group called their synchronized BatchNorms out of step (raised on every rank)."""


class _Call:
    """One kind of call (layer, pass, channels) on one group and device: its message tail, and how it is checked."""

    __slots__ = ("tail", "world", "code", "text", "launch", "fields")

    def __init__(self, name: str, where: str, C: int, group, device: torch.device) -> None:
        world = dist.get_world_size(group)
        bits = 20
        while bits > 8 and world * world * (1 << (2 * bits)) > (1 << 52):
            bits -= 1  # both sides of S1^2 == W * S2 exact in float64
        # A construction index ("SyncBatchNorm#3") is not compared: a rank that builds extra layers (an EMA copy, a
        # second model on rank 0) shifts it, and that must not stop a training that is in step. Qualified names
        # (convert_sync_batchnorm's, "layer1.0.bn1") are.
        identity = "" if "#" in name else name
        f = float(zlib.crc32(f"{identity}\x00{where}\x00{C}".encode()) & ((1 << bits) - 1))
        pad = 1 if where == BACKWARD else 0  # the backward's sums are 2C long: one slot where forward has the count
        self.tail = torch.tensor([0.0] * pad + [f, f * f], dtype=torch.float64, device=device)
        self.world = world
        layer = f"layer {name!r}" if name else "a functional call"
        self.fields = {"pass": where, "layer": layer, "C": C}  # what the CPU's error compares across ranks
        self.text = f"the {where} all-reduce of {layer} (C={C})"
        self.code = len(_calls_by_code) + 1  # this rank's device flag names it
        self.launch = None  # the device check's launch, found at the first message on a GPU
        _calls_by_code.append(self.text)


_calls: dict[tuple, _Call] = {}
_calls_by_code: list[str] = []
_flags: dict[torch.device, torch.Tensor] = {}  # per device: 0, or the code of this rank's first mismatched call


def _call(name: str, where: str, C: int, group, device: torch.device) -> _Call:
    key = (name, where, C, group, device)
    call = _calls.get(key)
    if call is None:
        call = _calls[key] = _Call(name, where, C, group, device)
    return call


def _error(text: str, later: bool = False, ranks: str = "") -> OutOfStepError:
    when = "found on the device at" if later else "at"
    what = ranks or (
        "another rank sent a different call to this collective (another layer, the other pass, or another channel "
        "count)"
    )
    return OutOfStepError(
        f"tritonbn: ranks out of step {when} {text} on this rank: {what}.\nEvery rank of the process group must "
        "call the same SyncBatchNorm layers in the same order and mode (train/eval); a layer whose output reaches "
        "the loss on some ranks only (an unused head) must reach it on every rank. "
        + ("Its outputs were NaN and its running statistics were left as they were. " if later else "Nothing was "
           "updated. ")
        + "TRITONBN_DEBUG=1 checks every call before its collective"
    )  # fmt: skip


def _what_differs(group, call: _Call) -> str:
    """Each rank's call, gathered on the error path alone (every rank found the mismatch at this same collective, so
    every rank joins the gather): ``"ranks disagree on layer: rank 0: ..., rank 1: ..."``."""
    fields: list = [None] * call.world
    dist.all_gather_object(fields, call.fields, group=group)
    differ = [k for k in call.fields if len({repr(f[k]) for f in fields}) > 1]
    same: dict[str, list[int]] = {}
    for rank, f in enumerate(fields):
        same.setdefault(f"the {f['pass']} all-reduce of {f['layer']} (C={f['C']})", []).append(rank)
    lines = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}" for text, r in same.items()]
    return f"ranks disagree on {', '.join(differ) or 'the call'}:\n  " + "\n  ".join(lines)


def _checked(message: torch.Tensor, call: _Call, group) -> None:
    """Compare the identity slots of a summed message: raise here (host-checked devices) or poison it on the device."""
    if message.device.type in host_checked:
        s1, s2 = message[-TAIL:].tolist()
        if s1 * s1 != call.world * s2:
            raise _error(call.text, ranks=_what_differs(group, call))
        return
    flag = _flags.get(message.device)
    if flag is None:
        flag = _flags[message.device] = torch.zeros(1, dtype=torch.int64, device=message.device)
    if call.launch is None:
        from tritonbn.backends.triton.lockstep import check_launch  # the GPU's: Triton is there

        call.launch = check_launch(message.numel(), call.world, call.code)
    call.launch(message, flag)


def all_reduce_stats(stats: torch.Tensor, group, name: str) -> torch.Tensor:
    """The forward collective: ``stats`` (the local ``(2C + 1,)`` float64 sums) summed over ``group`` and checked; a
    view of the message (``stats`` itself for a :class:`~tritonbn.distributed.Relay`, whose message has its own header,
    or no group)."""
    if group is None or isinstance(group, Relay):
        return all_reduce_sum(stats, group)
    call = _call(name, FORWARD, (stats.numel() - 1) // 2, group, stats.device)
    message = torch.cat((stats, call.tail))
    dist.all_reduce(message, op=dist.ReduceOp.SUM, group=group)
    _checked(message, call, group)
    return message[:-TAIL]


def all_reduce_sums(sums: torch.Tensor, group, name: str) -> torch.Tensor:
    """The backward collective: ``sums`` (the local ``(2, C)`` sums) summed over ``group`` in float64 and checked, in
    ``sums``'s dtype (``sums`` itself for a :class:`~tritonbn.distributed.Relay` or no group)."""
    if group is None or isinstance(group, Relay):
        return all_reduce_sum(sums, group)
    C = sums.shape[1]
    call = _call(name, BACKWARD, C, group, sums.device)
    message = torch.cat((sums.reshape(-1), call.tail))  # float64: the tail's dtype wins
    dist.all_reduce(message, op=dist.ReduceOp.SUM, group=group)
    _checked(message, call, group)
    summed = message[: 2 * C].view(2, C)
    return summed if summed.dtype == sums.dtype else sums.copy_(summed)  # rounded back, into the local sums


def check() -> None:
    """Raise :class:`OutOfStepError` if a BatchNorm collective on a GPU found the ranks out of step since the last
    :func:`check` (its outputs were NaN, its running statistics left alone). Reads a flag per device: a host
    synchronization, so call it where the loop synchronizes anyway (where it logs the loss, at the end of an epoch).
    Every rank's flag is set at the same calls, so every rank that calls it at the same point raises alike.
    CPU messages raise at the call itself, and never set a flag."""
    for flag in _flags.values():
        code = int(flag.item())
        if code:
            flag.zero_()
            raise _error(_calls_by_code[code - 1], later=True)
