"""Whole training steps on CPU: plain ``nn.BatchNorm2d`` against tritonbn's PyTorch backend.

For each network of ``benchmarks/cpu_nets.py`` (ResNet-, MobileNet- and EfficientNet-style, with separate
activation modules; timm-style norm-act layers; the fx fuser's output), each dtype (fp32, bf16) and each memory
format (contiguous, channels_last), it builds one seeded model, and a copy converted by
``tritonbn.convert_sync_batchnorm`` (fused first by ``tritonbn.fuse_batchnorm_activations`` for the ``_fx``
networks: ``cpu_nets.converted``), and times training steps
(forward, cross-entropy, backward, SGD step) of the two, alternated step by step in one run, with
one thread (``torch.set_num_threads(1)``) and ``TRITONBN_BACKEND=torch``. Each side's time is the
median of ``--reps`` (7) timed steps after ``--warmup`` untimed ones; ``ratio`` is
``tritonbn_ms / plain_ms``.

The second column (``ddp_ratio``) runs the same steps on 2 gloo ranks under
``torch.nn.parallel.DistributedDataParallel`` (buffers not broadcast at each forward, for both:
``tritonbn.cli.demo.ddp_without_buffer_sync``; the same per-rank batch), one thread each: tritonbn
synchronized over the two ranks against plain BatchNorm unsynchronized. It is the price of
synchronization on CPU, the collectives included. Rank 0's times are reported; the ranks step in
lockstep. ``--no-ddp`` skips it.

``--bn-layers`` adds a third column: the network's BatchNorm layers alone, each at its input's shape and
layout in the step, with its epilogue (a residual, an activation), forward and backward one after another,
tritonbn's layer against ``nn.BatchNorm2d`` followed by the same ops (``+ residual``, then ``nn.ReLU()``,
``nn.SiLU()``, ...; alternated, the same medians), and the excess per layer in µs. The layers are timed in
groups of one epilogue each, and a second table gives each group: what each epilogue costs per layer. The
column is the groups' sum. It isolates tritonbn's own cost from the convolutions, whose times swing most when
other jobs share the machine.

``--json FILE`` writes every figure; a markdown table goes to stdout. ``--max-ratio R`` exits with
status 1 when a single-process ``ratio`` exceeds ``R`` (``.ci/run`` uses 2.0 at ``--small`` sizes until
the backend keeps the issue's 1.5 there with a margin; the target on a quiet machine is 1.15).
``--small`` is the CI size: the same batch (8) and widths (ResNet at half width), smaller images
(ResNet and EfficientNet 32, MobileNet 64), so that each layer keeps a realistic size and the run takes
about a minute.

Run it as ``python benchmarks/cpu_train_step.py`` (it sets ``TRITONBN_BACKEND=torch`` and
unsets ``TRITON_INTERPRET`` before importing tritonbn).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ["TRITONBN_BACKEND"] = "torch"
os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("TRITONBN_DEBUG", None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_nets  # noqa: E402
from results_file import write_section  # noqa: E402

import tritonbn  # noqa: E402
from tritonbn.activations import activation_module  # noqa: E402
from tritonbn.cli._spawn import spawn  # noqa: E402
from tritonbn.cli.demo import ddp_without_buffer_sync  # noqa: E402
from tritonbn.modules import SyncBatchNormAct  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def _models(net: str, dtype: torch.dtype, layout: torch.memory_format, small: bool):
    """``(plain, converted)``: the same seeded weights, in ``dtype`` and ``layout``, in training mode."""
    torch.manual_seed(0)
    plain = cpu_nets.build(net, small).to(dtype=dtype, memory_format=layout).train()
    return plain, cpu_nets.converted(net, copy.deepcopy(plain))


def _batch(net: str, dtype: torch.dtype, layout: torch.memory_format, small: bool, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    side = cpu_nets.input_size(net, small)
    x = torch.randn(batch, 3, side, side, generator=g).to(dtype=dtype, memory_format=layout)
    return x, torch.randint(0, 10, (batch,), generator=g)


def _stepper(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    return step


def _time_pair(plain_step, tb_step, warmup: int, reps: int) -> tuple[float, float]:
    """Medians (ms) over ``reps`` alternated steps, which side goes first alternating too."""
    for _ in range(warmup):
        plain_step()
        tb_step()
    plain, tb = [], []
    for i in range(reps):
        if i % 2:
            tb.append(tb_step())
            plain.append(plain_step())
        else:
            plain.append(plain_step())
            tb.append(tb_step())
    return 1e3 * statistics.median(plain), 1e3 * statistics.median(tb)


def _epilogue(m: tritonbn.SyncBatchNorm, residual: bool) -> str:
    """The name of a tritonbn layer's epilogue, as the ``--bn-layers`` groups are named."""
    if isinstance(m, SyncBatchNormAct):
        return f"{type(m.act).__name__} (unfused)"
    act = m.activation if m.activation != "leaky_relu" else f"leaky_relu({m.negative_slope:g})"
    return " + ".join(["residual"] * residual + [act] * (act is not None)) or "none"


def _bn_layers(model, x) -> list[dict]:
    """Every tritonbn layer of ``model`` as one forward of (a copy of) it on ``x`` calls it: its input's shape and
    stride, its epilogue's name, activation and slope, whether a residual comes in, and an unfused act module."""
    probe, seen = copy.deepcopy(model), []

    def hook(m, args, kwargs):
        residual = len(args) > 1 and args[1] is not None or kwargs.get("residual") is not None
        act = copy.deepcopy(m.act) if isinstance(m, SyncBatchNormAct) else None
        seen.append({"shape": args[0].shape, "stride": args[0].stride(), "epilogue": _epilogue(m, residual),
                     "activation": m.activation, "slope": m.negative_slope, "residual": residual,
                     "act": act})  # fmt: skip

    for m in probe.modules():
        if isinstance(m, tritonbn.SyncBatchNorm):
            m.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        probe(x)
    return seen


def _plain_ops(layer: dict) -> torch.nn.Module:
    """The torch module a plain network runs after ``nn.BatchNorm2d`` for ``layer``'s activation (not in place)."""
    if layer["act"] is not None:
        return layer["act"]
    return activation_module(layer["activation"], layer["slope"])


def _bn_layer_steps(layers: list[dict], dtype: torch.dtype):
    """``(plain_step, tritonbn_step)``: forward and backward of each layer alone, at its input's shape and layout
    in the network, one after another: ``nn.BatchNorm2d`` followed by the layer's ops against the tritonbn layer
    with its epilogue (``--bn-layers``)."""
    g = torch.Generator().manual_seed(2)
    cases = []
    for layer in layers:
        shape, stride = layer["shape"], layer["stride"]
        x, dy, r = (torch.empty_strided(shape, stride, dtype=dtype).copy_(torch.randn(shape, generator=g))
                    for _ in "xyr")  # fmt: skip
        r = r.requires_grad_() if layer["residual"] else None
        plain = torch.nn.BatchNorm2d(shape[1]).to(dtype).train()
        if layer["act"] is not None:
            tb = SyncBatchNormAct(shape[1], act=copy.deepcopy(layer["act"]))
        else:
            tb = tritonbn.SyncBatchNorm(shape[1], activation=layer["activation"], negative_slope=layer["slope"])
        cases.append((x.requires_grad_(), r, dy, (plain, _plain_ops(layer)), tb.to(dtype).train()))

    def plain_layer(x, r, ops):
        bn, act = ops
        y = bn(x)
        return act(y if r is None else y + r)

    def tritonbn_layer(x, r, tb):
        return tb(x) if r is None else tb(x, r)

    def stepper(side: int):
        run = (plain_layer, tritonbn_layer)[side]

        def step() -> float:
            t0 = time.perf_counter()
            for x, r, dy, *layers in cases:
                run(x, r, layers[side]).backward(dy)
                x.grad = None
                if r is not None:
                    r.grad = None
            return time.perf_counter() - t0

        return step

    return stepper(0), stepper(1)


def _time_bn_layers(model, x, dtype, warmup: int, reps: int) -> dict:
    """The ``--bn-layers`` figures of one configuration: each epilogue's group of layers timed alone, and the sum."""
    layers = _bn_layers(model, x)
    groups: dict[str, list[dict]] = {}
    for layer in layers:
        groups.setdefault(layer["epilogue"], []).append(layer)
    epilogues = {}
    for name, group in groups.items():
        plain_ms, tb_ms = _time_pair(*_bn_layer_steps(group, dtype), warmup, reps)
        extra = 1e3 * (tb_ms - plain_ms) / len(group)
        epilogues[name] = {"layers": len(group), "plain_ms": plain_ms, "tritonbn_ms": tb_ms,
                           "ratio": tb_ms / plain_ms, "extra_us_per_layer": extra}  # fmt: skip
    plain = sum(e["plain_ms"] for e in epilogues.values())
    tb = sum(e["tritonbn_ms"] for e in epilogues.values())
    return {"bn_layers": len(layers), "bn_plain_ms": plain, "bn_tritonbn_ms": tb,
            "bn_extra_us_per_layer": 1e3 * (tb - plain) / len(layers), "bn_epilogues": epilogues}  # fmt: skip


def _configs(args) -> list[tuple[str, str, str]]:
    return [(n, d, lay) for n in args.nets for d in args.dtypes for lay in args.layouts]


def single_process(args) -> list[dict]:
    rows = []
    for net, dname, lname in _configs(args):
        dtype, layout = DTYPES[dname], LAYOUTS[lname]
        plain, converted = _models(net, dtype, layout, args.small)
        x, y = _batch(net, dtype, layout, args.small, args.batch)
        plain_ms, tb_ms = _time_pair(_stepper(plain, x, y), _stepper(converted, x, y), args.warmup, args.reps)
        rows.append({"net": net, "dtype": dname, "layout": lname, "plain_ms": plain_ms, "tritonbn_ms": tb_ms,
                     "ratio": tb_ms / plain_ms})  # fmt: skip
        print(f"  {net} {dname} {lname}: plain {plain_ms:.2f} ms, tritonbn {tb_ms:.2f} ms, "
              f"ratio {tb_ms / plain_ms:.3f}", file=sys.stderr, flush=True)  # fmt: skip
        if args.bn_layers:
            rows[-1].update(_time_bn_layers(converted, x, dtype, args.warmup, args.reps))
    return rows


def _ddp_worker(rank: int, world: int, args, out: str) -> None:
    rows = []
    for net, dname, lname in _configs(args):
        dtype, layout = DTYPES[dname], LAYOUTS[lname]
        plain, converted = _models(net, dtype, layout, args.small)
        x, y = _batch(net, dtype, layout, args.small, args.batch, seed=1 + rank)
        ddp = [ddp_without_buffer_sync(m, x.device) for m in (plain, converted)]
        plain_ms, tb_ms = _time_pair(_stepper(ddp[0], x, y), _stepper(ddp[1], x, y), args.warmup, args.reps)
        rows.append({"ddp_plain_ms": plain_ms, "ddp_tritonbn_ms": tb_ms, "ddp_ratio": tb_ms / plain_ms})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def two_ranks(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        spawn(2, _ddp_worker, args, out)  # one thread each
        with open(out) as f:
            return json.load(f)


def table(rows: list[dict]) -> str:
    ddp, bn = "ddp_ratio" in rows[0], "bn_plain_ms" in rows[0]
    head = "| network | dtype | layout | plain BN (ms) | tritonbn (ms) | ratio |"
    rule = "| --- | --- | --- | --- | --- | --- |"
    if ddp:
        head += " 2 ranks: plain BN (ms) | 2 ranks: tritonbn synced (ms) | 2-rank ratio |"
        rule += " --- | --- | --- |"
    if bn:
        head += " BN layers alone: plain (ms) | BN layers alone: tritonbn (ms) | extra per layer (µs) |"
        rule += " --- | --- | --- |"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r['net']} | {r['dtype']} | {r['layout']} | {r['plain_ms']:.2f} | {r['tritonbn_ms']:.2f} "
                f"| {r['ratio']:.3f} |")  # fmt: skip
        if ddp:
            line += f" {r['ddp_plain_ms']:.2f} | {r['ddp_tritonbn_ms']:.2f} | {r['ddp_ratio']:.3f} |"
        if bn:
            line += f" {r['bn_plain_ms']:.2f} | {r['bn_tritonbn_ms']:.2f} | {r['bn_extra_us_per_layer']:.0f} |"
        lines.append(line)
    return "\n".join(lines) + (f"\n\n{epilogue_table(rows)}" if bn else "")


def epilogue_table(rows: list[dict]) -> str:
    """The ``--bn-layers`` groups: each epilogue's layers alone, tritonbn against ``nn.BatchNorm2d`` + the ops."""
    lines = ["| network | dtype | layout | epilogue | layers | BN + ops (ms) | tritonbn (ms) | ratio "
             "| extra per layer (µs) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        for name, e in r["bn_epilogues"].items():
            lines.append(f"| {r['net']} | {r['dtype']} | {r['layout']} | {name} | {e['layers']} | {e['plain_ms']:.2f} "
                         f"| {e['tritonbn_ms']:.2f} | {e['ratio']:.3f} | {e['extra_us_per_layer']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def section(meta: dict, rows: list[dict], worst: float) -> str:
    """The RESULTS.md section of a run (``--results``): what was run, where, and the table."""
    load = ", ".join(f"{v:.1f}" for v in meta["load_average"])
    return (
        f"Written by `python benchmarks/cpu_train_step.py{' --small' if meta['small'] else ''} --results ...` on "
        f"{meta['date']}: {meta['machine']}, {meta['cpus']} CPUs, one thread, torch {meta['torch']}, Python "
        f"{meta['python']}, load average {load} at the end; batch {meta['batch']}, median of {meta['reps']} steps "
        f"after {meta['warmup']} warm-up steps, plain and tritonbn alternated; ratio = tritonbn / plain. Worst "
        f"one-process ratio {worst:.3f}; {meta['seconds']:.0f} s.\n\n{table(rows)}\n"
    )


def add_output_arguments(p: argparse.ArgumentParser, marker: str, ratio_help: str) -> None:
    """``--json``, ``--max-ratio`` (``ratio_help``) and ``--results`` (the RESULTS.md section between the ``marker``
    markers), shared with ``cpu_eval_step.py``."""
    p.add_argument("--json", metavar="OUT", help="write the figures to this JSON file")
    p.add_argument("--max-ratio", type=float, metavar="R", help=ratio_help)
    p.add_argument("--results", metavar="PATH", help=f"also write the table into this RESULTS.md, between the "
                   f"{marker} markers")  # fmt: skip


def add_net_arguments(p: argparse.ArgumentParser) -> None:
    """The options this script and ``cpu_eval_step.py`` share: the sizes, the networks, dtypes and layouts."""
    p.add_argument("--small", action="store_true", help="CI sizes: smaller images (and ResNet at half width)")
    p.add_argument("--nets", nargs="+", choices=cpu_nets.NETS, default=list(cpu_nets.NETS))
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_net_arguments(p)
    p.add_argument("--batch", type=int, default=8, help="samples per step (per rank)")
    p.add_argument("--reps", type=int, default=7, help="timed steps per side (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the 2-rank DDP column")
    p.add_argument("--bn-layers", action="store_true", help="also time each network's BatchNorm layers alone")
    add_output_arguments(p, "cpu-train-step", "exit 1 when a single-process ratio exceeds R")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = single_process(args)
    if args.ddp:
        for row, extra in zip(rows, two_ranks(args), strict=True):
            row.update(extra)
    print(table(rows))
    worst = max(r["ratio"] for r in rows)
    meta = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": 1,
        "load_average": os.getloadavg(), "small": args.small, "batch": args.batch, "reps": args.reps,
        "warmup": args.warmup, "seconds": time.perf_counter() - t0, "tritonbn": os.path.dirname(tritonbn.__file__),
    }  # fmt: skip
    print(f"\nworst ratio {worst:.3f}; load average {meta['load_average'][0]:.2f}; {meta['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "worst_ratio": worst, "results": rows}, f, indent=1)
    if args.results:
        write_section(args.results, "cpu-train-step", section(meta, rows, worst))
    if args.max_ratio is not None and worst > args.max_ratio:
        print(f"cpu_train_step: worst ratio {worst:.3f} exceeds --max-ratio {args.max_ratio}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
