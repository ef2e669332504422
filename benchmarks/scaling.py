"""What synchronizing BatchNorm costs per training step: measured over gloo, modeled to 4096 GPUs.

    python benchmarks/scaling.py --json scaling.json --plot scaling.png [--results benchmarks/RESULTS.md]
    python benchmarks/scaling.py --smoke --json s.json --plot s.png      # CI: worlds 2 and 4, 2 timed steps

One ResNet-50 training step has 53 BatchNorm layers, so 106 collectives on the critical path (the
forward one feeds the normalization, the backward one feeds dx). Only the collectives run here,
with the message sizes of the 53 layers (channels from ``tritonbn/cli/resnet50.py``):

* ``tritonbn``: per layer, one all-reduce of 2C+3 fp64 forward (sums, the count and the call's two identity
  slots, ``tritonbn/lockstep.py``) and one of 2C+3 fp64 backward (2C sums, a spare slot, the identity), whatever
  the world size (``tests/distributed/test_sync.py`` checks these messages on the real layer);
* ``allgather``: ``torch.nn.SyncBatchNorm``'s algorithm, per layer an all-gather of 2C+1 fp32 per rank
  (mean, invstd, count: W x (2C+1) values gathered) forward and an all-reduce of 2C fp32 backward.

**Measured** (``measured`` in the JSON): W gloo processes on this machine, W = 2, 4, 8 (``--smoke``:
2 and 4), each implementation over the world and over ``tritonbn.syncbn_group(g)`` groups of g
consecutive ranks (every group running at once). Per step: the collectives one rank issues, the
bytes of their results on that rank (the reduced buffer; the gathered W x (2C+1) values), and the
time (the slowest rank's, median over steps).

**Model** (``model``): a latency-bandwidth model of each collective, NCCL's own
(``ncclTopoTuneModel`` in NCCL's ``src/graph/tuning.cc``): ring and tree all-reduce and ring
all-gather, LL and Simple protocols, NVLink hops inside a node and network hops between nodes; NCCL
takes the fastest, and so does the model. Every parameter is in ``ASSUMPTIONS`` with its source.
Before extrapolating, the same ring formula (a fixed cost, a cost per ring step, and bytes over a
bus bandwidth) is fitted to the gloo measurements, and ``model_check`` compares the two.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_file import write_section  # noqa: E402

from tritonbn.cli._spawn import spawn  # noqa: E402
from tritonbn.cli.resnet50 import resnet50  # noqa: E402

IMPLS = ("tritonbn", "allgather")
FULL_WORLDS, SMOKE_WORLDS = (2, 4, 8), (2, 4)
MODEL_WORLDS = tuple(2**k for k in range(3, 13))  # 8 .. 4096 GPUs
# fork where there is one: the ranks need nothing from a fresh interpreter and start in a fraction of the time
START_METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def resnet50_channels() -> list[int]:
    """C of the 53 BatchNorm layers of ResNet-50, in forward order."""
    channels = []

    def norm(c):
        channels.append(c)
        return torch.nn.BatchNorm2d(c)

    with torch.device("meta"):
        resnet50(norm_layer=norm)
    return channels


# ------------------------------------------------------------------------------------------------
# Measured: gloo processes on this machine
# ------------------------------------------------------------------------------------------------


def _messages(impl: str, channels: list[int], group_world: int):
    """Per layer, the tensors of one step: forward (all layers in order), then backward (reversed)."""
    forward = []
    for c in channels:
        if impl == "tritonbn":
            forward.append(("all_reduce", torch.ones(2 * c + 3, dtype=torch.float64), None))
        else:
            local = torch.ones(2 * c + 1, dtype=torch.float32)
            forward.append(("all_gather", local, torch.empty(group_world * (2 * c + 1), dtype=torch.float32)))
    backward = [
        ("all_reduce", torch.ones(2 * c + 3, dtype=torch.float64) if impl == "tritonbn" else torch.ones(2 * c), None)
        for c in reversed(channels)
    ]
    return forward + backward


def _step(messages, group, log=None) -> None:
    for kind, tensor, out in messages:
        if kind == "all_reduce":
            dist.all_reduce(tensor, group=group)
            if log is not None:
                log.append(tensor.numel() * tensor.element_size())
        else:  # torch.nn.SyncBatchNorm's call on gloo (all_gather_single on other backends)
            dist.all_gather(list(out.view(-1, tensor.numel())), tensor, group=group)
            if log is not None:
                log.append(out.numel() * out.element_size())


def _worker(rank: int, world: int, channels, group_sizes, warmup: int, steps: int, out_file: str):
    import tritonbn

    rows = []
    for group_size, impl in itertools.product(group_sizes, IMPLS):
        group = tritonbn.syncbn_group(group_size)
        messages = _messages(impl, channels, group_size)
        log: list[int] = []
        _step(messages, group, log)  # also the first warm-up step
        for _ in range(warmup - 1):
            _step(messages, group)
        dist.barrier()
        times = torch.zeros(steps, dtype=torch.float64)
        for s in range(steps):
            t0 = time.perf_counter()
            _step(messages, group)
            times[s] = time.perf_counter() - t0
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each step: the slowest rank
        rows.append(
            {
                "world": world,
                "impl": impl,
                "group_size": group_size,
                "collectives_per_step": len(log),
                "bytes_per_step": sum(log),
                "us_per_step": round(statistics.median(times.tolist()) * 1e6, 1),
                "us_quartiles": [round(q * 1e6, 1) for q in statistics.quantiles(times.tolist(), n=4)],
                "steps": steps,
            }
        )
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rows, f)


def measure(worlds, channels, warmup: int, steps: int) -> list[dict]:
    rows = []
    for world in worlds:
        group_sizes = [g for g in (2, 4, 8) if g <= world and world % g == 0]
        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "rows.json")
            spawn(world, _worker, channels, group_sizes, warmup, steps, out_file, start_method=START_METHOD)
            with open(out_file) as f:
                rows += json.load(f)
        print(f"measured world {world}", file=sys.stderr)
    return rows


# ------------------------------------------------------------------------------------------------
# The latency-bandwidth model
# ------------------------------------------------------------------------------------------------

_NCCL = "NVIDIA/nccl src/graph/tuning.cc @ b6475625 (ncclTopoTuneModel)"
PROTOCOLS = ("ll", "ll128", "simple")
# name: (value, unit, source). Latency tables: {algorithm: {protocol: µs}}.
ASSUMPTIONS = {
    "gpus_per_node": (8, "GPUs", "HGX H100/H200 nodes have 8 GPUs: MLCommons inference v4.1, NVIDIA "
                      "H200-SXM-141GBx8 system description (accelerators_per_node: 8)"),  # fmt: skip
    "base_latency_us": ({"ring": {"ll": 6.6, "ll128": 14.0, "simple": 8.4}, "tree": {"ll": 6.8, "ll128": 14.0,
                        "simple": 0.0}}, "µs", f"baseLat: the fixed cost of one collective, {_NCCL}"),  # fmt: skip
    "hop_nvlink_us": ({"ring": {"ll": 0.6, "ll128": 1.9, "simple": 3.4}, "tree": {"ll": 0.6, "ll128": 1.25,
                      "simple": 28.0}}, "µs", f"hwLat[NVLINK]: one step inside a node, {_NCCL}"),  # fmt: skip
    "hop_net_us": ({"ring": {"ll": 2.7, "ll128": 4.0, "simple": 14.0}, "tree": {"ll": 5.0, "ll128": 8.5,
                   "simple": 28.0}}, "µs", f"hwLat[NET]: one step between nodes, {_NCCL}"),  # fmt: skip
    "net_overhead_us": (1.0, "µs", f"getNetOverhead on x86 Intel hosts (x3 for Simple): the floor of an intra-node "
                        f"step in a ring that spans nodes, {_NCCL}"),  # fmt: skip
    "nic_latency_us": (0.0, "µs", "graphs->latencyInter, the NIC's own latency that NCCL adds per network step (twice "
                       "for Simple): unknown here, taken as 0 (optimistic)"),  # fmt: skip
    "bus_bw_nvlink_GBps": (370.0, "GB/s", "effective NVLink bus bandwidth of NCCL on H100, protocol overhead included: "
                           "NCCL maintainer in https://github.com/NVIDIA/nccl-tests/issues/212"),  # fmt: skip
    "bus_bw_net_GBps": (50.0, "GB/s", "one 400 Gb/s InfiniBand NIC per GPU (rail-optimized: NVIDIA HGX AI Factory "
                        "reference architecture, network logical architecture), at line rate (optimistic); the "
                        "bus bandwidth of every collective that spans nodes"),  # fmt: skip
    "protocol_bw": ("LL: ring 1/4 of the bus (1/3 for a one-node all-gather), tree 0.92/3.8, capped at llMaxBws "
                    "(87.7 GB/s on one Hopper node, 39.0 on 2 Intel-hosted nodes, 20.4 on more); LL128: ring 0.92, "
                    "tree 0.92 x 7/9 on one node, x 120/128 across nodes; Simple: ring 1, tree 0.92; a tree's "
                    "algorithm bandwidth is half its bus bandwidth, a ring's bus x ranks / steps", "",
                    f"the model refinements of {_NCCL} (per-channel caps left out: the channel count is unknown)"),
}  # fmt: skip


def _a(name: str):
    return ASSUMPTIONS[name][0]


def nccl_us(kind: str, ranks: int, nbytes: float) -> dict[str, float]:
    """Modeled time of one collective, per algorithm and protocol (``"ring_ll"``, ...): ``kind`` is
    ``"all_reduce"`` or ``"all_gather"``, ``nbytes`` the size of the result (NCCL's byte count).
    Key ``"best"``: the fastest, which is NCCL's choice.
    """
    if ranks == 1:
        return {"best": 0.0}
    nodes = max(1, math.ceil(ranks / int(_a("gpus_per_node"))))
    local = ranks // nodes
    out = {}
    for algo in ("ring", "tree") if kind == "all_reduce" else ("ring",):
        for proto in PROTOCOLS:
            base = _a("base_latency_us")[algo][proto]
            intra = _a("hop_nvlink_us")[algo][proto]
            inter = _a("hop_net_us")[algo][proto] + _a("nic_latency_us") * (2 if proto == "simple" else 1)
            bus = _a("bus_bw_nvlink_GBps") if nodes == 1 else _a("bus_bw_net_GBps")
            if algo == "ring":
                steps = 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1
                inter_steps = (2 * nodes if nodes > 1 else 0) if kind == "all_reduce" else nodes - 1
                if nodes > 1:
                    intra = max(intra, _a("net_overhead_us") * (3 if proto == "simple" else 1))
                latency = base + (steps - inter_steps) * intra + inter_steps * inter
                if proto == "ll":
                    bus = min(_ll_cap(nodes), bus * (1 / 4 if nodes > 1 or kind == "all_reduce" else 1 / 3))
                elif proto == "ll128":
                    bus *= 0.92
                algbw = bus * ranks / steps
            else:
                latency = base + 2 * ((local - 1) * intra + math.log2(nodes) * inter)
                bus *= 0.92
                if proto == "ll":
                    bus = min(bus / 3.8, _ll_cap(nodes))
                elif proto == "ll128":
                    bus *= 7 / 9 if nodes == 1 else 120 / 128
                algbw = bus * 0.5
            out[f"{algo}_{proto}"] = latency + nbytes / (algbw * 1e3)  # GB/s -> bytes per µs
    out["best"] = min(out.values())
    return out


def _ll_cap(nodes: int) -> float:
    return 87.7 if nodes == 1 else 39.0 if nodes == 2 else 20.4


def step_collectives(impl: str, channels: list[int], ranks: int) -> list[tuple[str, int]]:
    """(kind, result bytes) of every collective of one step, for ``ranks`` ranks per collective."""
    forward = [
        ("all_reduce", 8 * (2 * c + 3)) if impl == "tritonbn" else ("all_gather", 4 * ranks * (2 * c + 1))
        for c in channels
    ]
    return forward + [("all_reduce", 8 * (2 * c + 3) if impl == "tritonbn" else 4 * 2 * c) for c in channels]


def _best_of(times: dict[str, float], algo: str) -> float:
    """The fastest protocol of ``algo``; a collective without it (an all-gather has no tree) takes its ring."""
    keys = [k for k in times if k.startswith(algo + "_")] or [k for k in times if k.startswith("ring_")]
    return min(times[k] for k in keys)


def model_rows(channels: list[int]) -> list[dict]:
    rows = []
    for world in MODEL_WORLDS:
        for impl, group_size in dict.fromkeys((("tritonbn", world), ("tritonbn", 8), ("allgather", world))):
            times = [nccl_us(kind, group_size, n) for kind, n in step_collectives(impl, channels, group_size)]
            row = {"world": world, "impl": impl, "group_size": group_size,
                   "us_per_step": round(sum(t["best"] for t in times), 1)}  # fmt: skip
            for algo in ("ring", "tree"):  # every all-reduce with this algorithm (its best protocol)
                row[f"us_{algo}"] = round(sum(_best_of(t, algo) for t in times), 1)
            rows.append(row)
    return rows


# --- the same formula on gloo: ring steps, a fixed cost, a cost per step, a bus bandwidth -------------------------


def _gloo_features(impl: str, channels: list[int], ranks: int) -> list[float]:
    """Coefficients of (fixed µs, µs per ring step, µs per byte on the bus) summed over one step's collectives:
    NCCL's ring formula above with one protocol (gloo's all-reduce and all-gather are rings:
    pytorch/gloo gloo/allreduce.cc, gloo/allgather.cc)."""
    fixed = steps_total = bus_bytes = 0.0
    for kind, nbytes in step_collectives(impl, channels, ranks):
        steps = 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1
        fixed += 1
        steps_total += steps
        bus_bytes += nbytes * steps / ranks  # bytes / algbw, algbw = busbw * ranks / steps
    return [fixed, steps_total, bus_bytes]


def fit_gloo(measured: list[dict], channels: list[int]) -> dict:
    """Non-negative least squares, relative error, of the measured step times on the ring formula."""
    rows = [(_gloo_features(r["impl"], channels, r["group_size"]), r["us_per_step"]) for r in measured]
    best = None
    for keep in itertools.product((True, False), repeat=3):  # exact NNLS for 3 unknowns: try every support
        if not any(keep):
            continue
        a = torch.tensor([[f for f, k in zip(x, keep, strict=True) if k] for x, _ in rows], dtype=torch.float64)
        y = torch.tensor([t for _, t in rows], dtype=torch.float64)
        w = 1 / y
        sol = torch.linalg.lstsq(a * w[:, None], y * w).solution
        if (sol < 0).any():
            continue
        coef = iter(sol.tolist())
        full = [next(coef) if k else 0.0 for k in keep]
        err = float((((a @ sol) - y) / y).pow(2).sum())
        if best is None or err < best[0]:
            best = (err, full)
    fixed, per_step, per_byte = best[1]
    # The cost of a ring step alone (fixed cost and bytes left out), fitted separately for each world and ring
    # length: on a machine with fewer cores than processes it grows with both, which one constant cannot follow.
    # Both implementations share it, so what is left to the formula is their ratio of ring steps.
    by_case = {}
    for world, p in sorted({(r["world"], r["group_size"]) for r in measured}):
        xs = [(_gloo_features(r["impl"], channels, p)[1], r["us_per_step"]) for r in measured
              if (r["world"], r["group_size"]) == (world, p)]  # fmt: skip
        by_case[f"{world}/{p}"] = sum(x / y for x, y in xs) / sum((x / y) ** 2 for x, y in xs)
    return {
        "fixed_us": fixed,
        "per_ring_step_us": per_step,
        "bus_bw_GBps": (1e-3 / per_byte) if per_byte > 0 else math.inf,
        "rms_relative_error": math.sqrt(best[0] / len(rows)),
        "formula": "per collective: fixed + ring steps x per_ring_step + bytes x steps/ranks / bus_bw "
        "(ring all-reduce 2(p-1) steps, ring all-gather p-1 steps; p = ranks in the group)",
        "per_ring_step_us_by_world_and_ranks": by_case,
    }


def gloo_model_us(fit: dict, impl: str, channels: list[int], ranks: int) -> float:
    fixed, steps, bus_bytes = _gloo_features(impl, channels, ranks)
    per_byte = 0.0 if math.isinf(fit["bus_bw_GBps"]) else 1e-3 / fit["bus_bw_GBps"]
    return fixed * fit["fixed_us"] + steps * fit["per_ring_step_us"] + bus_bytes * per_byte


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "cpu": model, "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "load_average_at_start": load}  # fmt: skip


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=90)
    colors = {"tritonbn": "tab:blue", "allgather": "tab:red"}
    worlds = sorted({r["world"] for r in result["measured"]})
    for impl in IMPLS:
        rows = sorted((r for r in result["measured"] if r["impl"] == impl and r["group_size"] == r["world"]),
                      key=lambda r: r["world"])  # fmt: skip
        left.plot([r["world"] for r in rows], [r["us_per_step"] / 1e3 for r in rows], "o", color=colors[impl],
                  label=f"{impl}, world group")  # fmt: skip
        fitted = [gloo_model_us(result["fit"], impl, result["channels"], w) / 1e3 for w in worlds]
        left.plot(worlds, fitted, "-", color=colors[impl], alpha=0.5, label=f"{impl}, fitted ring formula")
        pairs = sorted((r["world"], r["us_per_step"] / 1e3) for r in result["measured"]
                       if r["impl"] == impl and r["group_size"] == 2 and r["world"] > 2)  # fmt: skip
        if pairs:
            left.plot(*zip(*pairs, strict=True), "s", mfc="none", color=colors[impl], label=f"{impl}, groups of 2")
    left.set(xscale="log", yscale="log", xlabel="processes (gloo, one 2-core machine)", ylabel="ms per step",
             title="measured")  # fmt: skip
    left.set_xticks(worlds)
    left.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.legend(fontsize=6)
    styles = {("tritonbn", "world"): ("tab:blue", "-", "tritonbn, world group"),
              ("tritonbn", 8): ("tab:green", "--", "tritonbn, group_size=8"),
              ("allgather", "world"): ("tab:red", "-", "torch all-gather, world group")}  # fmt: skip
    for (impl, size), (color, style, label) in styles.items():
        rows = [r for r in result["model"] if r["impl"] == impl and r["group_size"] == (r["world"] if size == "world"
                else size)]  # fmt: skip
        rows = list({r["world"]: r for r in rows}.values())
        right.plot([r["world"] for r in rows], [r["us_per_step"] / 1e3 for r in rows], style, color=color,
                   marker=".", label=label)  # fmt: skip
    right.set(xscale="log", yscale="log", xlabel="GPUs (8 per node)", ylabel="ms per step",
              title="modeled: NCCL's latency-bandwidth model")  # fmt: skip
    right.set_xticks(list(MODEL_WORLDS[::2]) + [MODEL_WORLDS[-1]])
    right.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    right.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.legend(fontsize=7)
    fig.suptitle("BatchNorm sync cost per ResNet-50 step (53 layers, 106 collectives)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "## Synchronization cost per training step: measured (gloo) and modeled (NCCL, 8 to 4096 GPUs)",
        "",
        f"Measured on {result['date']} on **{m['cpus']} CPU cores** ({m['cpu']}), torch {m['torch']}, "
        f"load average at start {', '.join(f'{v:.1f}' for v in m['load_average_at_start'] or [])}. "
        f"Command: `{result['command']}`. Each row: the collectives of one ResNet-50 step (53 BatchNorm layers), "
        f"{result['steps']} timed steps after {result['warmup']} warm-up, the slowest rank's time, median "
        "(quartiles in the JSON). All W processes share the 2 cores, so times grow with W for want of cores as "
        "well as for the algorithm: these figures measure gloo on one small machine, not a cluster.",
        "",
        "| world | impl | group_size | collectives/step | bytes/step | ms/step | model ms (one fit) | "
        "model/measured | model ms (step cost per world and p) | model/measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    check = {(c["world"], c["impl"], c["group_size"]): c for c in result["model_check"]}
    for r in result["measured"]:
        c = check[(r["world"], r["impl"], r["group_size"])]
        lines.append(f"| {r['world']} | {r['impl']} | {r['group_size']} | {r['collectives_per_step']} | "
                     f"{r['bytes_per_step']:,} | {r['us_per_step'] / 1e3:.2f} | {c['model_us'] / 1e3:.2f} | "
                     f"{c['model_us'] / r['us_per_step']:.2f} | {c['model_per_case_us'] / 1e3:.2f} | "
                     f"{c['model_per_case_us'] / r['us_per_step']:.2f} |")  # fmt: skip
    fit = result["fit"]
    per_step = fit["per_ring_step_us_by_world_and_ranks"]
    steps_text = ", ".join(
        f"{v / 1e3:.2f} ms (W = {k.split('/')[0]}, p = {k.split('/')[1]})" for k, v in per_step.items()
    )
    measured = {(r["world"], r["impl"], r["group_size"]): r["us_per_step"] for r in result["measured"]}
    ratios = ", ".join(f"{measured[(w, 'tritonbn', p)] / measured[(w, 'allgather', p)]:.2f} (W = {w}, p = {p})"
                       for w, p in (tuple(map(int, k.split("/"))) for k in per_step))  # fmt: skip
    lines += [
        "",
        f"**The model checked on gloo.** The same ring formula as the NCCL model below ({fit['formula']}), "
        f"fitted to all the rows above at once (non-negative least squares on relative error): fixed cost "
        f"{fit['fixed_us']:.0f} µs per collective, {fit['per_ring_step_us']:.0f} µs per ring step, bus bandwidth "
        f"{fit['bus_bw_GBps']:.2g} GB/s; RMS relative error {100 * fit['rms_relative_error']:.0f}%. It does not "
        "fit: the messages are too small for bandwidth to show, and the cost of a ring step is not a constant "
        "here. Fitted for each world and ring length alone (the last two columns) it is "
        f"{steps_text}: more processes than cores take turns on each step. What the formula still predicts is "
        "the ratio of the two implementations at the same world and group, from their ring steps alone (2(p-1) "
        "per all-reduce, p-1 per all-gather): tritonbn / all-gather = 4/3 = 1.33 at any p. Measured: "
        f"{ratios}. Where the measured ratio is near 4/3, the step counts explain the difference; where it is "
        "not (rings of 2 above all), other per-call costs weigh more than the formula's ring steps. The "
        "constants are this machine's and say nothing about a GPU cluster, which is what the parameters below "
        "are for. The all-gather has half the ring steps of an all-reduce, which "
        "is why it is the faster one within one machine, here and in the model at 8 GPUs.",
        "",
        "**Modeled** with NCCL's own cost model (ring and tree, LL, LL128 and Simple, the fastest taken, as NCCL "
        "does), 8 GPUs per node. The model leaves out the host and kernel-launch cost of each call, so it is a "
        "lower bound for eager training without CUDA graphs. Columns: ms per step; the ring-only and tree-only "
        "columns use that algorithm for every all-reduce.",
        "",
        "| GPUs | tritonbn, world group | tritonbn, group_size=8 | torch all-gather, world group | "
        "all-gather / tritonbn world | tritonbn world: ring-only, tree-only |",
        "|---|---|---|---|---|---|",
    ]
    model = {(r["world"], r["impl"], r["group_size"]): r for r in result["model"]}
    for w in MODEL_WORLDS:
        t, g, a = model[(w, "tritonbn", w)], model[(w, "tritonbn", 8)], model[(w, "allgather", w)]
        lines.append(f"| {w} | {t['us_per_step'] / 1e3:.2f} | {g['us_per_step'] / 1e3:.2f} | "
                     f"{a['us_per_step'] / 1e3:.1f} | {a['us_per_step'] / t['us_per_step']:.1f}x | "
                     f"{t['us_ring'] / 1e3:.2f}, {t['us_tree'] / 1e3:.2f} |")  # fmt: skip
    lines += ["", "Assumptions (every parameter of the model, with its source):", "",
              "| parameter | value | source |", "|---|---|---|"]  # fmt: skip
    for name, (value, unit, source) in ASSUMPTIONS.items():
        if isinstance(value, dict):  # {algorithm: {protocol: µs}}
            names = {"ll": "LL", "ll128": "LL128", "simple": "Simple"}
            value = "; ".join(f"{algo}: " + ", ".join(f"{names[proto]} {v}" for proto, v in row.items())
                              for algo, row in value.items())  # fmt: skip
        lines.append(f"| `{name}` | {value} {unit} | {source} |".replace("  |", " |"))
    lines += ["", "Not modeled: NCCL's NVLS and CollNet algorithms (reductions offloaded to the switches), the PAT "
              "all-gather of newer releases (for one GPU per node), and host and launch costs (above)."]  # fmt: skip
    lines += ["", "![scaling.png](scaling.png)", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="write the measured rows, the fit and the model here")
    parser.add_argument("--plot", help="write the log-log plot here (PNG; needs matplotlib)")
    parser.add_argument("--results", help="also write the tables into this RESULTS.md, between the scaling markers")
    parser.add_argument("--smoke", action="store_true", help="worlds 2 and 4, 1 warm-up and 2 timed steps (CI)")
    parser.add_argument("--steps", type=int, help="timed steps per case (default 15; smoke 2)")
    parser.add_argument("--measured", help="measure nothing: take the measured rows of this earlier JSON, and redo "
                        "the fit, the model, the plot and the tables")  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 2:
        parser.error(f"--steps must be at least 2 (a median and quartiles), got {args.steps}")
    worlds = SMOKE_WORLDS if args.smoke else FULL_WORLDS
    warmup, steps = (1, args.steps or 2) if args.smoke else (3, args.steps or 15)
    channels = resnet50_channels()
    if args.measured:  # the measurement of an earlier run, with its date, machine and command
        with open(args.measured) as f:
            earlier = json.load(f)
        result = {k: earlier[k] for k in ("date", "command", "machine", "smoke", "warmup", "steps", "measured")}
        result["channels"] = channels
    else:
        result = {
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/scaling.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "smoke": args.smoke,
            "warmup": warmup,
            "steps": steps,
            "channels": channels,
            "measured": measure(worlds, channels, warmup, steps),
        }
    result["fit"] = fit = fit_gloo(result["measured"], channels)
    result["model_check"] = [
        {"world": r["world"], "impl": r["impl"], "group_size": r["group_size"], "measured_us": r["us_per_step"],
         "model_us": round(gloo_model_us(fit, r["impl"], channels, r["group_size"]), 1),
         "model_per_case_us": round(_gloo_features(r["impl"], channels, r["group_size"])[1]
                                    * fit["per_ring_step_us_by_world_and_ranks"][f"{r['world']}/{r['group_size']}"], 1)}
        for r in result["measured"]
    ]  # fmt: skip
    result["assumptions"] = {k: {"value": v, "unit": u, "source": s} for k, (v, u, s) in ASSUMPTIONS.items()}
    result["model"] = model_rows(channels)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    section = markdown(result)
    if args.results:
        write_section(args.results, "scaling", section)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
