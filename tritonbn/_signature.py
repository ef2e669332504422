"""``TRITONBN_DEBUG=1``: the cross-rank signature check, before every collective, in one module.

Every rank states what it is about to do (the call, the pass, the layer, and a few fields such as the
channels and dtype) in one small all-reduce; a mismatch raises the same error on every rank instead of
leaving them waiting in a collective that will never pair up. Opt-in: it reads the result on the host.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from tritonbn._compat import environ_reader
from tritonbn.distributed import Relay, collective_device

_debug_variable = environ_reader("TRITONBN_DEBUG")


def debug_enabled() -> bool:
    """``TRITONBN_DEBUG=1``: check a signature across ranks before each collective."""
    value = _debug_variable()
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, 0)


def signature(input, training: bool, input_grad: bool) -> dict[str, float]:
    """What every rank must agree on before a collective, besides the call and the layer."""
    ok = isinstance(input, torch.Tensor) and input.dim() >= 2
    return {
        "channels": input.shape[1] if ok else -1,
        "ndim": input.dim() if ok else -1,
        "dtype": dtype_code(input.dtype) if ok else 0,
        "training": int(training),
        "input_grad": int(input_grad),
    }


class RemoteInputError(ValueError):
    """Raised on the ranks whose input was fine when another rank rejected its input (debug mode)."""


# Fields described in an error but not compared: a float32 rank and a float64 rank of one layer compute the right
# answer in both passes (both pass float64 messages, tritonbn.lockstep), so debug mode accepts them too.
_UNCOMPARED = frozenset({"dtype"})
_FIELDS = 6  # signature fields a call site may compare; the packed signature has a fixed size
_calls: dict[str, int] = {}  # per process group: how many signature checks this rank has made
_deferred: dict[str, BaseException] = {}  # per process group: an error for this rank's next check (defer_error)


def _key(group) -> str:
    return getattr(group, "group_name", None) or str(id(group))


def defer_error(group, error: BaseException) -> None:
    """Raise ``error`` at this rank's next signature check on ``group``, where every rank of it raises, instead of
    now, where the others would wait for this rank in their next collective (a call that found the error without a
    collective of its own: an activation-checkpointing recompute that does not replay its forward)."""
    _deferred.setdefault(_key(group), error)


def text_code(text: str) -> int:
    """A stable integer for ``text``, the same in every process (Python's ``hash`` is salted per process)."""
    return zlib.crc32(text.encode("utf-8"))


def check_signature(
    group, where: str, fields: dict[str, float], local_error: BaseException | None = None, name: str = ""
) -> None:
    """Compare a call's signature across the ranks of ``group``; raise the same error on every rank on a mismatch.

    Every rank must call this at the same point: debug mode calls it before each collective, and
    also in eval so that a rank in eval while others train is caught. The signature is what
    identifies the call, the same on every rank when the code is the same: the number of checks
    this rank has made on ``group`` before (a per-group call counter), ``where`` (the pass, such as
    ``"forward"``), the layer's identity ``name`` (see :class:`tritonbn.SyncBatchNorm`), then ``fields``
    (at most 6 numbers; a ``dtype`` is described, not compared). Strings travel as CRC-32 codes, in one
    small all-reduce of fixed size, so that even different call sites pair up and compare instead of hanging.

    On a mismatch, which every rank sees alike, a second small all-reduce gathers each rank's own
    description (its layer name, pass, fields) so that the error names what each rank was doing.
    A rank that rejected its input passes ``local_error``: it re-raises that error, and the other
    ranks raise :class:`RemoteInputError`, naming that rank, instead of waiting forever in the next
    collective. It reads the result on the host: a synchronization, which is why it is opt-in.
    """
    if len(fields) > _FIELDS:
        raise ValueError(f"check_signature compares at most {_FIELDS} fields, got {len(fields)}")
    if isinstance(group, Relay):  # inside tritonbn.join, whose joined ranks answer the layers' collectives alone
        return
    key = _key(group)
    if local_error is None:
        local_error = _deferred.pop(key, None)
    call = _calls.get(key, 0)
    _calls[key] = call + 1
    numbers = [
        call,
        text_code(where),
        text_code(name),
        *(0.0 if k in _UNCOMPARED else float(v) for k, v in fields.items()),
    ]
    numbers += [0.0] * (3 + _FIELDS - len(numbers))
    values = torch.tensor([1.0 if local_error is not None else 0.0, *numbers], dtype=torch.float64)
    both = torch.cat([values, -values]).to(collective_device(group))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[: values.numel()].cpu().tolist(), (-both[values.numel() :]).cpu().tolist()
    rejected = hi[0] > 0
    # What differs, in terms every rank states alike: fields are comparable only at the same call site.
    differ = [f"call ({int(lo[1]) + 1} vs {int(hi[1]) + 1})"] if hi[1] != lo[1] else []
    differ += [what for i, what in ((2, "pass"), (3, "layer")) if hi[i] != lo[i]]
    if hi[2] == lo[2]:
        differ += [
            f"{what} ({_show(what, lo[i])} vs {_show(what, hi[i])})"
            for i, what in enumerate(fields, start=4)
            if hi[i] != lo[i]
        ]
    if not differ and not rejected:
        return
    mine = _describe(where, name, fields, local_error)
    ranks = _gather_texts(group, mine)
    if local_error is not None:
        raise local_error
    place = f"tritonbn {where}" if hi[2] == lo[2] else "tritonbn"
    at = f" at call {call + 1} on this process group" if hi[1] == lo[1] else ""
    if rejected:
        who = [str(r) for r, text in enumerate(ranks) if "rejected its input" in text]
        raise RemoteInputError(
            f"{place}: another rank rejected its input{at} (rank{'s' if len(who) > 1 else ''} {', '.join(who)}); "
            f"see the error on that rank{_by_rank(ranks)}"
        )
    raise ValueError(
        f"{place}: ranks disagree on {', '.join(differ)}{at}{_by_rank(ranks)}\nEvery rank of the process group "
        "must call the same SyncBatchNorm layers in the same order, in the same mode (train/eval), with the same "
        "channels and dtype (TRITONBN_DEBUG=1 checks this before every collective)"
    )


def _describe(where: str, name: str, fields: dict[str, float], local_error: BaseException | None) -> str:
    text = f"{where} of layer {name!r}" if name else where
    text += " (" + ", ".join(f"{name}={_show(name, float(v))}" for name, v in fields.items()) + ")"
    if local_error is not None:
        first = str(local_error).strip().splitlines()[0] if str(local_error).strip() else ""
        text += f", rejected its input: {type(local_error).__name__}: {first}"
    return text


def _gather_texts(group, text: str) -> list[str]:
    """Every rank's ``text``, by rank in ``group`` (``all_gather_object``: only on the error path)."""
    texts: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(texts, text, group=group)
    return texts


def _by_rank(texts: list[str]) -> str:
    """``":\n  rank 0: ...\n  ranks 1, 2: ..."``, ranks with the same text on one line."""
    same: dict[str, list[int]] = {}
    for rank, text in enumerate(texts):
        same.setdefault(text, []).append(rank)
    lines = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}" for text, r in same.items()]
    return ":\n  " + "\n  ".join(lines)


def _show(name: str, value: float) -> str:
    v = int(value)
    if name == "dtype":
        return next((str(d).replace("torch.", "") for d, c in _DTYPE_CODES.items() if c == v), "other")
    if name in ("training", "input_grad"):
        return {"training": ("eval", "train"), "input_grad": ("no", "yes")}[name][v]
    return str(v)
