"""``tritonbn.join``: ranks that run different numbers of training iterations, as torch's ``Join`` does for DDP.

Inside ``with tritonbn.join(model, *joinables, **join_kwargs):`` a rank that has run out of data keeps answering the
other ranks' collectives until every rank is done: DDP's (``model`` a ``DistributedDataParallel``: its own join hook,
with Join's semantics for parameters), those of the other ``joinables`` (a ``ZeroRedundancyOptimizer``), and
tritonbn's BatchNorm all-reduces, to which it contributes no samples. So at every step the ranks still training
normalize with the statistics of their own batches (exactly one process over their concatenation), and every rank,
joined ones included, ends with the running statistics and ``num_batches_tracked`` that one process updating once
per step over those batches would hold.

How, without a hang in any order of events:

* While the block runs, the model's tritonbn layers all-reduce over a process group of their own (made on entering,
  with the members of the layers' group), in one fixed-size message per pass: a small header (what the pass is, which
  layer, how many values, whether the running statistics take them) and the sums, padded to the model's largest.
  Still one collective per pass; the message is larger (``2 C_max + 6`` doubles) and backward's float32 sums are
  added in float64.
* A joined rank answers those messages from a thread of its own, with zeros, reading each header to keep its layers'
  running statistics following the others'. DDP's join hook runs on the main thread meanwhile, over DDP's group: the
  two never wait on each other (DDP's buffer broadcast comes before the BatchNorm forward, its gradient all-reduces
  during the BatchNorm backward). When every rank has joined, the ranks whose thread was not running send the message
  that ends the others', and each joined rank writes its final running statistics.

Limits: the layers synchronize over the world (the default group; ``syncbn_group`` subgroups are refused); eager
calls only; no ``TRITONBN_DEBUG=1`` signature checks for the layers inside the block (a joined rank would have to
answer them too), no ``accumulate_stats`` block and no double backward inside it.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

from tritonbn._compat import group_timeout, run_first
from tritonbn._core.call import in_backward, settings_for
from tritonbn.backend import update_running_stats
from tritonbn.distributed import Relay, resolve_group
from tritonbn.modules import ACCUMULATOR, SyncBatchNorm

JOIN = "_tritonbn_join"  # set on each layer inside the block: what SyncBatchNorm asks for its settings
_HEADER = 5  # [ranks sending (1 each) | kind | layer | values | running statistics take them]
_FORWARD, _BACKWARD, _STOP = 1.0, 2.0, 3.0


class _LayerRelay(Relay):
    """One layer's collectives inside the block: over the block's group, in the fixed-size message."""

    def __init__(self, block: join, index: int, module: SyncBatchNorm) -> None:
        self.block, self.index, self.module = block, index, module
        self._base = self._settings = None

    def __call__(self, settings):
        """The settings of a training call of the layer inside the block (its group: this relay)."""
        if torch.compiler.is_compiling():
            raise RuntimeError("tritonbn.join needs eager calls: it does not work under torch.compile")
        if ACCUMULATOR in self.module.__dict__:
            raise RuntimeError("tritonbn.join: an accumulate_stats block cannot run inside tritonbn.join")
        if settings is not self._base:
            s = settings
            self._base, self._settings = (
                s,
                settings_for(
                    True, s.momentum, s.eps, s.activation, s.negative_slope, self, debug_group=None, name=s.name
                ),
            )
        return self._settings

    def all_reduce_sum(self, buffer: torch.Tensor) -> None:
        forward = buffer.dim() == 1  # forward's [sum x | sum x^2 | n]; backward's sums are (2, C)
        takes = forward and self.module.track_running_stats and not in_backward()  # not a checkpoint's recompute
        header = [1.0, _FORWARD if forward else _BACKWARD, float(self.index), float(buffer.numel()), float(takes)]
        message = self.block.message(buffer.device, header)
        message[_HEADER : _HEADER + buffer.numel()].copy_(buffer.reshape(-1))
        dist.all_reduce(message, op=dist.ReduceOp.SUM, group=self.block.group)
        buffer.copy_(message[_HEADER : _HEADER + buffer.numel()].view_as(buffer))


class _Shadow(JoinHook):
    """A joined rank's side: a thread that answers the layers' messages, and the message that ends it."""

    def __init__(self, block: join) -> None:
        self.block = block
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.state: list | None = None  # per layer: its running statistics, followed on this rank

    def main_hook(self) -> None:
        if self.thread is None:  # the first iteration of the others since this rank joined
            self.state = [
                tuple(None if b is None else b.detach().clone() for b in _buffers(m)) for m in self.block.layers
            ]
            self.thread = threading.Thread(target=self._answer, name="tritonbn.join", daemon=True)
            self.thread.start()

    def _answer(self) -> None:
        try:
            while True:
                message = self.block.message(self.block.device, [0.0] * _HEADER)
                dist.all_reduce(message, op=dist.ReduceOp.SUM, group=self.block.group)
                senders, kind, index, count, takes = message[:_HEADER].tolist()
                if round(kind / senders) == _STOP:
                    return
                if round(kind / senders) == _FORWARD and takes:
                    self._follow(round(index / senders), message[_HEADER : _HEADER + round(count / senders)].clone())
        except BaseException as error:  # noqa: BLE001 - raised again on the main thread, in post_hook
            self.error = error

    def _follow(self, index: int, stats: torch.Tensor) -> None:
        """The running-statistics update the others made with ``stats``: the forward kernel's own, on an empty batch
        (as tritonbn.accumulate_stats applies its pooled sums), into this rank's copy and then the layer's buffers."""
        module, (mean, var, count) = self.block.layers[index], self.state[index]
        update_running_stats(stats, mean, var, count, module.momentum, module.eps)
        _write(module, self.state[index])

    def post_hook(self, is_last_joiner: bool) -> None:
        if self.thread is None:  # every rank has joined: end the threads of the ranks that joined before
            message = self.block.message(self.block.device, [1.0, _STOP, 0.0, 0.0, 0.0])
            dist.all_reduce(message, op=dist.ReduceOp.SUM, group=self.block.group)
            return
        self.thread.join()
        if self.error is not None:
            raise self.error
        for module, state in zip(self.block.layers, self.state, strict=True):
            _write(module, state)  # after DDP's buffer broadcasts, which may have landed after the thread's writes


def _buffers(module):
    return module.running_mean, module.running_var, module.num_batches_tracked


def _write(module, state) -> None:
    with torch.no_grad():
        for buffer, value in zip(_buffers(module), state, strict=True):
            if buffer is not None and value is not None:
                buffer.copy_(value)


class _BatchNormJoinable(Joinable):
    """tritonbn's layers as a torch ``Joinable``."""

    def __init__(self, block: join) -> None:
        super().__init__()
        self.block = block

    def join_hook(self, **kwargs) -> JoinHook:
        return _Shadow(self.block)

    @property
    def join_device(self) -> torch.device:
        return self.block.device

    @property
    def join_process_group(self):
        return self.block.world  # Join's per-iteration count (before DDP's collectives, on every rank): not the layers'


def _notify(joinable, *_) -> None:
    """A forward pre-hook of the model: this rank has not joined (Join's per-iteration count, which ours makes)."""
    Join.notify_join_context(joinable)


class join:  # noqa: N801 - used like a function: ``with tritonbn.join(model):``
    """Context manager: ranks may run different numbers of training iterations inside it (see :mod:`tritonbn.uneven`).

    ::

        with tritonbn.join(ddp_model, optimizer_if_zero):
            for x, t in loader:  # ranks may hold different numbers of batches, none at all included
                loss_fn(ddp_model(x), t).backward()
                optimizer.step()
                optimizer.zero_grad()

    ``model``: a ``DistributedDataParallel`` or a plain module holding :class:`tritonbn.SyncBatchNorm` layers.
    ``joinables``: other torch ``Joinable`` objects. ``join_kwargs``: ``Join``'s (``divide_by_initial_world_size``,
    ``enable``, ``throw_on_early_termination``), which behave as under ``Join([model, *joinables], **join_kwargs)``.
    """

    def __init__(self, model: nn.Module, *joinables, **join_kwargs) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"tritonbn.join: model must be a torch.nn.Module, got {type(model).__name__}")
        self.model, self.joinables, self.join_kwargs = model, joinables, join_kwargs
        self.layers: list[SyncBatchNorm] = []
        self.group = self.world = None
        self.device = torch.device("cpu")
        self.largest = 0
        self._join: Join | None = None
        self._hook = None

    def message(self, device, header) -> torch.Tensor:
        """A zeroed message of the block's size on ``device``, with ``header`` written in."""
        message = torch.zeros(_HEADER + self.largest, dtype=torch.float64, device=device)
        message[:_HEADER] = torch.tensor(header, dtype=torch.float64)
        return message

    def __enter__(self) -> join:
        enabled = self.join_kwargs.get("enable", True)
        layers = list(dict.fromkeys(m for m in self.model.modules() if isinstance(m, SyncBatchNorm)))
        synced = [m for m in layers if resolve_group(m.process_group) is not None]
        ours = None
        if enabled and synced:
            self.world = dist.group.WORLD
            for m in synced:
                if dist.get_world_size(resolve_group(m.process_group)) != dist.get_world_size():
                    raise ValueError(
                        "tritonbn.join: every tritonbn layer must synchronize over the world (the default process "
                        f"group); a layer with a smaller process group (syncbn_group) is not supported: {m!r}"
                    )
            self.layers, self.largest = synced, max(2 * m.num_features + 1 for m in synced)
            buffer = next((b for m in synced for b in m.buffers()), None)
            self.device = buffer.device if buffer is not None else torch.device("cpu")
            if dist.get_backend() == "nccl" and self.device.type == "cpu":
                self.device = torch.device("cuda", torch.cuda.current_device())
            timeout = group_timeout(self.world, self.device)  # a hang fails as soon as it would in the world's group
            ranks = list(range(dist.get_world_size()))
            self.group = dist.new_group(ranks, timeout=timeout)  # a collective: every rank enters the block
            for index, m in enumerate(synced):
                setattr(m, JOIN, _LayerRelay(self, index, m))
            ours = _BatchNormJoinable(self)
        ddp = [self.model] if isinstance(self.model, DistributedDataParallel) else []
        order = [*ddp, *self.joinables]
        if ours is not None:
            # Join's per-iteration count is its first joinable's, notified before each forward. With DDP, DDP's:
            # its reducer divides the gradients by that count (divide_by_initial_world_size=False), and its forward
            # raises for throw_on_early_termination, as under Join([ddp, ...]). Without DDP, ours, notified by a
            # forward pre-hook of the model (a ZeroRedundancyOptimizer notifies only in step(), after the layers'
            # collectives).
            if ddp:
                order.append(ours)
            else:
                order.insert(0, ours)
                self._hook = self.model.register_forward_pre_hook(functools.partial(_notify, ours))
        if order:
            self._join = Join(order, **self.join_kwargs)
            if ours is not None:
                # Our hook runs first all the same, so that a joined rank starts its thread before DDP's hook waits
                # for the gradients (which wait for the layers' backward, and so for that thread).
                run_first(self._join, order.index(ours))
            self._join.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._join is not None:
                self._join.__exit__(*exc)
        finally:
            if self._hook is not None:
                self._hook.remove()
            for m in self.layers:
                m.__dict__.pop(JOIN, None)
            if self.group is not None and exc[0] is None:
                dist.destroy_process_group(self.group)
            self.layers, self.group = [], None
