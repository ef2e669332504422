"""``tritonbn demo``: see BatchNorm statistics drift under DDP, and tritonbn prevent it.

It trains one small CNN a few steps on each rank's own (deliberately different) data, several
ways, and prints for each: how far the ranks' running statistics drifted apart, how far their eval
outputs differ, and how far the result is from the same network trained in one process on the
global batch. It spawns 2 CPU ranks over gloo by default, one rank per GPU when there are enough
GPUs, and runs as it is under ``torchrun``.
"""

from __future__ import annotations

import copy
import gc
import inspect
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tritonbn
from tritonbn.backend import name_for
from tritonbn.cli._spawn import process_group, spawn
from tritonbn.diagnose import check_bn_sync

PER_RANK = 8
LR = 0.05


def make_model(widths: tuple[int, int, int] = (8, 16, 10), classes: int = 4) -> nn.Module:
    """The demo's small CNN, seeded: two conv+BatchNorm2d+ReLU stages (the second at stride 2), pooling, and a
    linear+BatchNorm1d+ReLU head of ``widths[2]`` features before ``classes`` outputs."""
    torch.manual_seed(0)
    c1, c2, hidden = widths
    return nn.Sequential(
        nn.Conv2d(3, c1, 3, padding=1),
        nn.BatchNorm2d(c1),
        nn.ReLU(),
        nn.Conv2d(c1, c2, 3, stride=2, padding=1),
        nn.BatchNorm2d(c2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c2, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def rank_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: each rank's data has its own offset and scale (non-IID shards)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(PER_RANK, 3, 12, 12, generator=g) * (1.0 + rank) + 2.0 * rank
    return x, torch.randint(0, 4, (PER_RANK,), generator=g)


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [rank_batch(step, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def ddp_without_buffer_sync(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP that leaves buffers alone after init, so that drifting running statistics stay visible.

    (With DDP's default, rank 0's buffers overwrite the others at every forward: the ranks then agree,
    but on rank 0's statistics alone.)
    """
    params = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **no_sync)


def train(
    model: nn.Module, steps: int, rank: int, world: int, device: torch.device, trace: list | None = None
) -> nn.Module:
    """``steps`` SGD steps under DDP; with ``trace``, append ``(stats spread, eval spread)`` after each step."""
    ddp = ddp_without_buffer_sync(model, device)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        x, t = rank_batch(step, rank)
        opt.zero_grad()
        # DDP averages gradients over ranks; scale so that the average is the global mean loss's gradient.
        loss = F.cross_entropy(ddp(x.to(device)), t.to(device), reduction="sum") * world / (PER_RANK * world)
        loss.backward()
        opt.step()
        if trace is not None:
            trace.append((stats_spread(model), eval_spread(model, device)))
            model.train()
    return model


def train_reference(steps: int, world: int, device: torch.device) -> nn.Module:
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        x, t = global_batch(step, world)
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), t.to(device)).backward()
        opt.step()
    return model


def eval_spread(model: nn.Module, device: torch.device) -> float:
    """Max over a fixed probe batch of (max - min) across ranks of the eval output."""
    model.eval()
    probe = torch.randn(16, 3, 12, 12, generator=torch.Generator().manual_seed(99)) * 2 + 1
    with torch.no_grad():
        y = model(probe.to(device)).double().flatten()
    both = torch.cat([y, -y])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return float((both[: y.numel()] + both[y.numel() :]).max())


def distance(model: nn.Module, reference: nn.Module | None) -> float:
    if reference is None:
        return float("nan")
    ref = reference.state_dict()
    return max(
        float((v.double() - ref[k].double().to(v.device)).abs().max())
        for k, v in model.state_dict().items()
        if v.is_floating_point()
    )


def stats_spread(model: nn.Module) -> float:
    """The largest relative difference across ranks of a BN running mean or var (a collective)."""
    return max((max(r.mean_rel, r.var_rel) for r in check_bn_sync(model).layers), default=0.0)


def figures(model: nn.Module, reference: nn.Module | None, device: torch.device) -> tuple[float, float, float]:
    """A table row: running-stat spread across ranks (largest relative), eval spread, distance to 1 process."""
    return stats_spread(model), eval_spread(model, device), distance(model, reference)


PLOTTED = ("plain BatchNorm under DDP", "tritonbn.SyncBatchNorm")


def draw(traces: dict[str, list[tuple[float, float]]], path: str, world: int, device: torch.device) -> str:
    """Two panels, per training step: the BN running-stat spread and the eval-output spread across ranks.

    The figures go to a CSV beside ``path`` first (``FILE.csv``), whose name is returned.
    """
    table = os.path.splitext(path)[0] + ".csv"
    with open(table, "w") as f:
        f.write("method,step,bn_stats_spread,eval_spread\n")
        for label, trace in traces.items():
            f.writelines(f"{label},{step},{s!r},{e!r}\n" for step, (s, e) in enumerate(trace, 1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.1))
    styles = {PLOTTED[0]: ("tab:red", "o"), PLOTTED[1]: ("tab:blue", "s")}
    panels = ("BN running-stat spread across ranks", "eval-output spread across ranks")
    for i, (ax, title) in enumerate(zip(axes, panels, strict=True)):
        for label, trace in traces.items():
            color, marker = styles[label]
            steps = range(1, len(trace) + 1)
            ax.plot(steps, [t[i] for t in trace], color=color, marker=marker, markersize=3, label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("training step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("largest relative difference", fontsize=8)
    axes[1].set_ylabel("largest difference", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"tritonbn demo: {world} {device.type.upper()} ranks, each with its own data "
        "(tritonbn: 0, identical on every rank)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return table


def _worker(rank: int, world: int, device: torch.device, steps: int, plot: str | None = None) -> None:
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    probe = torch.empty(0, device=device)
    say(
        f"tritonbn demo: {world} ranks over {dist.get_backend()} on {device.type}, tritonbn backend "
        f"'{name_for(probe)}', {steps} SGD steps, {PER_RANK} samples per rank, each rank's data shifted"
    )
    t0 = time.perf_counter()
    reference = None
    if rank == 0:
        say("  [0/4] one process on the global batch (the reference) ...")
        reference = train_reference(steps, world, device)
    rows = []
    methods = [
        ("plain BatchNorm under DDP", lambda m: m),
        ("torch.nn.SyncBatchNorm", nn.SyncBatchNorm.convert_sync_batchnorm),
        ("tritonbn.SyncBatchNorm", tritonbn.convert_sync_batchnorm),
    ]
    plain = None
    traces: dict[str, list] = {}
    for i, (label, convert) in enumerate(methods, 1):
        say(f"  [{i}/4] {label} ...")
        model = convert(make_model()).to(device)
        trace = traces.setdefault(label, []) if plot and label in PLOTTED else None
        try:
            train(model, steps, rank, world, device, trace)
        except (ValueError, RuntimeError) as e:  # torch.nn.SyncBatchNorm refuses CPU tensors
            rows.append((label, None, None, None, str(e).splitlines()[0]))
            continue
        if plain is None:
            plain = model
        rows.append((label, *figures(model, reference, device), None))
    say("  [4/4] plain BatchNorm, repaired with tritonbn.sync_running_stats ...")
    repaired = copy.deepcopy(plain)
    tritonbn.sync_running_stats(repaired)
    rows.append(("plain BN + sync_running_stats", *figures(repaired, reference, device), None))
    say(f"  done in {time.perf_counter() - t0:.1f} s\n")
    head = ("method", "BN stats spread", "eval spread", "distance to 1 process")
    table = [head] + [
        (label, "n/a", "n/a", f"n/a: {why}") if why else (label, f"{rel:.2e}", f"{spread:.2e}", f"{dist_:.2e}")
        for label, rel, spread, dist_, why in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    for row in table:
        say("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    say(
        "\nBN stats spread: the largest relative difference across ranks of a running mean or var.\n"
        "eval spread: the largest difference across ranks of the eval outputs on one probe batch.\n"
        "distance to 1 process: the largest difference of a parameter or buffer from the same network\n"
        "trained in one process on the global batch.\n"
        "\nPlain BatchNorm drifts: every rank keeps its own statistics. tritonbn.SyncBatchNorm keeps the\n"
        "ranks identical and matches one process on the global batch (to float32 rounding).\n"
        "sync_running_stats re-aligns a drifted model's statistics; its weights were still trained\n"
        "with per-rank statistics."
    )
    if plot and rank == 0:
        table = draw(traces, plot, world, device)
        say(f"\nwrote {plot} (figures in {table}): the two spreads after every step, plain BatchNorm against tritonbn")


def _run(device: torch.device, steps: int, plot: str | None = None) -> None:
    """The demo on this rank; the DDP wrappers (their reducers hold the group) are freed before the group goes."""
    _worker(dist.get_rank(), dist.get_world_size(), device, steps, plot)
    gc.collect()


def _spawned(rank: int, world: int, use_cuda: bool, steps: int, plot: str | None = None) -> None:
    _run(torch.device("cuda", rank) if use_cuda else torch.device("cpu"), steps, plot)


def main(world: int = 2, steps: int = 10, cpu: bool = False, plot: str | None = None) -> int:
    """Run the demo; ``plot``: also write that PNG of the spreads per step (needs matplotlib)."""
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("tritonbn demo --plot needs matplotlib: pip install 'tritonbn[plot]'", file=sys.stderr)
            return 2
        plot = os.path.abspath(plot)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: it set up the rendezvous
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if not cpu and torch.cuda.is_available() else torch.device("cpu")
        with process_group(device):
            _run(device, steps, plot)
        return 0
    use_cuda = not cpu and torch.cuda.device_count() >= world
    print(f"spawning {world} {'GPU' if use_cuda else 'CPU'} ranks ...", flush=True)
    spawn(world, _spawned, use_cuda, steps, plot, cuda=use_cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
