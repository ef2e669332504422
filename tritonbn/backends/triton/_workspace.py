"""Where the reducing kernels keep their ticket counters and partials: one workspace per device and stream."""

from __future__ import annotations

import torch

from tritonbn._compat import current_raw_stream


class Workspace:
    """Per device and stream: ticket counters at zero, and scratch memory for the reductions' partials.

    A kernel that takes tickets (see :mod:`tritonbn.backends.triton._common`) leaves them at zero, and the
    partials are read only by the launch that wrote them, so launches on one stream, which run one
    after another, share one workspace: no memset and no allocation per launch, nor in a captured
    CUDA graph once the workspace exists. A workspace that must grow is replaced, and the old buffers
    are kept alive: a graph captured with them may still replay.
    """

    __slots__ = ("tickets", "scratch", "retired", "n_tickets", "n_scratch")

    def __init__(self, device: torch.device) -> None:
        self.tickets = torch.zeros(1024, dtype=torch.int32, device=device)
        self.scratch = torch.empty(4096, dtype=torch.float64, device=device)
        self.n_tickets, self.n_scratch = 1024, 4096  # their sizes, read on every launch without a numel() each
        self.retired: list[torch.Tensor] = []

    def grow(self, tickets: int, scratch: int) -> None:
        if tickets > self.n_tickets:
            self.retired.append(self.tickets)
            self.tickets = torch.zeros(2 * tickets, dtype=torch.int32, device=self.tickets.device)
            self.n_tickets = 2 * tickets
        if scratch > self.n_scratch:
            self.retired.append(self.scratch)
            self.scratch = torch.empty(2 * scratch, dtype=torch.float64, device=self.scratch.device)
            self.n_scratch = 2 * scratch


_workspaces: dict = {}
_is_cuda: dict = {}  # device -> whether it has streams (device.type builds a new string on each read)


def workspace(device: torch.device, tickets: int = 0, scratch: int = 0) -> Workspace:
    """The :class:`Workspace` of ``device`` and its current stream, with room for ``tickets`` counters
    and ``scratch`` float64 values."""
    cuda = _is_cuda.get(device)
    if cuda is None:
        cuda = _is_cuda[device] = device.type == "cuda"
    key = (device, current_raw_stream(device.index) if cuda else 0)
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = Workspace(device)
    if tickets > ws.n_tickets or scratch > ws.n_scratch:
        ws.grow(tickets, scratch)
    return ws
