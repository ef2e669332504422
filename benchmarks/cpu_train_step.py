"""Whole training steps on CPU: plain ``nn.BatchNorm2d`` against tritonbn's PyTorch backend.

For each network of ``benchmarks/cpu_nets.py`` (ResNet-, MobileNet- and EfficientNet-style), each
dtype (fp32, bf16) and each memory format (contiguous, channels_last), it builds one seeded model,
and a copy converted by ``tritonbn.convert_sync_batchnorm``, and times training steps
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
layout in the step, forward and backward one after another, plain against tritonbn (alternated, the
same medians), and the excess per layer in µs. It isolates tritonbn's own cost from the convolutions,
whose times swing most when other jobs share the machine.

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
from tritonbn.cli._spawn import spawn  # noqa: E402
from tritonbn.cli.demo import ddp_without_buffer_sync  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def _models(net: str, dtype: torch.dtype, layout: torch.memory_format, small: bool):
    """``(plain, converted)``: the same seeded weights, in ``dtype`` and ``layout``, in training mode."""
    torch.manual_seed(0)
    plain = cpu_nets.build(net, small).to(dtype=dtype, memory_format=layout).train()
    converted = tritonbn.convert_sync_batchnorm(copy.deepcopy(plain))
    return plain, converted


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


def _bn_inputs(model, x) -> list[tuple[torch.Size, tuple[int, ...]]]:
    """``(shape, stride)`` of every BatchNorm layer's input in one forward of (a copy of) ``model`` on ``x``."""
    probe, seen = copy.deepcopy(model), []
    for m in probe.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.register_forward_hook(lambda m, i, o: seen.append((i[0].shape, i[0].stride())))
    with torch.no_grad():
        probe(x)
    return seen


def _bn_layer_steps(inputs, dtype: torch.dtype):
    """``(plain_step, tritonbn_step)``: forward and backward of each BatchNorm layer alone, at its input's
    shape and layout in the network, one after another (``--bn-layers``)."""
    g = torch.Generator().manual_seed(2)
    cases = []
    for shape, stride in inputs:
        x, dy = (torch.empty_strided(shape, stride, dtype=dtype).copy_(torch.randn(shape, generator=g)) for _ in "xy")
        plain = torch.nn.BatchNorm2d(shape[1]).to(dtype).train()
        cases.append((x.requires_grad_(), dy, plain, tritonbn.convert_sync_batchnorm(copy.deepcopy(plain))))

    def stepper(side: int):
        def step() -> float:
            t0 = time.perf_counter()
            for x, dy, *layers in cases:
                layers[side](x).backward(dy)
                x.grad = None
            return time.perf_counter() - t0

        return step

    return stepper(0), stepper(1)


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
            inputs = _bn_inputs(plain, x)
            bn_plain, bn_tb = _time_pair(*_bn_layer_steps(inputs, dtype), args.warmup, args.reps)
            rows[-1].update({"bn_layers": len(inputs), "bn_plain_ms": bn_plain, "bn_tritonbn_ms": bn_tb,
                             "bn_extra_us_per_layer": 1e3 * (bn_tb - bn_plain) / len(inputs)})  # fmt: skip
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="CI sizes: smaller images (and ResNet at half width)")
    p.add_argument("--nets", nargs="+", choices=cpu_nets.NETS, default=list(cpu_nets.NETS))
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--batch", type=int, default=8, help="samples per step (per rank)")
    p.add_argument("--reps", type=int, default=7, help="timed steps per side (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the 2-rank DDP column")
    p.add_argument("--bn-layers", action="store_true", help="also time each network's BatchNorm layers alone")
    p.add_argument("--json", metavar="OUT", help="write the figures to this JSON file")
    p.add_argument("--max-ratio", type=float, metavar="R", help="exit 1 when a single-process ratio exceeds R")
    p.add_argument("--results", metavar="PATH", help="also write the table into this RESULTS.md, between the "
                   "cpu-train-step markers")  # fmt: skip
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
