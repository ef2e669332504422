"""What the always-on out-of-step check costs (issue 55): bytes and time per ResNet-50 step over gloo on CPU.

    python benchmarks/lockstep_cost.py [--world 2] [--rounds 15] [--steps 5]

Per step, the 106 BatchNorm collectives of one ResNet-50 training step (53 layers, channels from
``tritonbn/cli/resnet50.py``; forward in layer order, backward reversed), in three forms:

* ``before``: what tritonbn sent before the check: 2C+1 float64 forward, 2C float32 backward, plain all-reduces;
* ``sizes``: plain all-reduces of the checked messages' sizes (2C+3 float64 each pass), without the check's host
  code: what the bytes alone cost;
* ``checked`` (what tritonbn sends now): the real code, :func:`tritonbn.lockstep.all_reduce_stats` and
  :func:`~tritonbn.lockstep.all_reduce_sums`, 2C+3 float64 each pass: the copy into the message, the all-reduce,
  the host check of the two identity slots, the backward's sums rounded back to float32;
* ``padded``: the option against different channel counts: every message of the group as wide as its widest layer
  (2 * 2048 + 3 float64), the same check.

The forms alternate round by round (so drift on a shared machine hits them alike); each round times ``--steps``
steps per form, each step the slowest rank's; reported: the median over rounds of the per-round median, and rank 0's
CPU time per step (median): on an oversubscribed machine the wall time of a step also pays for every time slice a
rank loses to other processes, the more so the more Python it runs between collectives.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scaling import resnet50_channels  # noqa: E402

FORMS = ("before", "sizes", "checked", "padded")


def _bytes(form: str, channels) -> int:
    widest = max(channels)
    if form == "before":
        return sum(8 * (2 * c + 1) + 4 * 2 * c for c in channels)
    if form in ("sizes", "checked"):
        return sum(2 * 8 * (2 * c + 3) for c in channels)
    return len(channels) * 2 * 8 * (2 * widest + 3)


def _step(form: str, channels, group) -> None:
    from tritonbn.lockstep import all_reduce_stats, all_reduce_sums

    widest = max(channels)
    for i, c in enumerate(channels):  # forward
        stats = torch.ones(2 * c + 1, dtype=torch.float64)
        if form == "before":
            dist.all_reduce(stats, group=group)
        elif form == "sizes":
            dist.all_reduce(torch.ones(2 * c + 3, dtype=torch.float64), group=group)
        elif form == "checked":
            all_reduce_stats(stats, group, f"layer{i}")
        else:
            padded = torch.zeros(2 * widest + 1, dtype=torch.float64)
            padded[: stats.numel()] = stats
            all_reduce_stats(padded, group, f"layer{i}")[: stats.numel()]
    for i, c in reversed(list(enumerate(channels))):  # backward
        sums = torch.ones(2, c, dtype=torch.float32)
        if form == "before":
            dist.all_reduce(sums, group=group)
        elif form == "sizes":
            dist.all_reduce(torch.ones(2 * c + 3, dtype=torch.float64), group=group)
        elif form == "checked":
            all_reduce_sums(sums, group, f"layer{i}")
        else:
            padded = torch.zeros(2, widest, dtype=torch.float32)
            padded[:, :c] = sums
            all_reduce_sums(padded, group, f"layer{i}")[:, :c]


def _worker(rank: int, world: int, init: str, rounds: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    channels = resnet50_channels()
    group = dist.group.WORLD
    for form in FORMS:  # warm-up
        for _ in range(2):
            _step(form, channels, group)
    per_round = {form: [] for form in FORMS}
    cpu = {form: [] for form in FORMS}  # this process's CPU time per step (its own threads and gloo's)
    for _ in range(rounds):
        for form in FORMS:
            times = torch.zeros(steps, dtype=torch.float64)
            for s in range(steps):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                _step(form, channels, group)
                times[s] = time.perf_counter() - t0
                cpu[form].append(time.process_time() - c0)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            per_round[form].append(statistics.median(times.tolist()))
    if rank == 0:
        lines = [f"world {world}, {len(channels)} layers, {rounds} rounds x {steps} steps, torch {torch.__version__}"]
        base = statistics.median(per_round["before"])
        for form in FORMS:
            med = statistics.median(per_round[form])
            q = statistics.quantiles(per_round[form], n=4)
            lines.append(
                f"{form:8s} {_bytes(form, channels):>10,} B/step  {med * 1e3:7.2f} ms/step "
                f"(quartiles {q[0] * 1e3:.2f}-{q[2] * 1e3:.2f})  x{med / base:.3f}  "
                f"CPU {statistics.median(cpu[form]) * 1e3:6.2f} ms/step (rank 0)"
            )
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.txt")
        mp.spawn(_worker, args=(args.world, os.path.join(d, "init"), args.rounds, args.steps, out), nprocs=args.world)
        print(open(out).read(), end="")


if __name__ == "__main__":
    main()
