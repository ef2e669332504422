"""Whole networks in eval on CPU: plain ``nn.BatchNorm2d`` against tritonbn's PyTorch backend (inference).

The sibling of ``benchmarks/cpu_train_step.py``, over the same networks (``benchmarks/cpu_nets.py``: ResNet-,
MobileNet- and EfficientNet-style, timm-style norm-act layers, the fx fuser's output) and the same seeded models
(the plain one, and the copy ``cpu_nets.converted`` makes), in eval mode: each forward runs under
``torch.inference_mode()`` (CPU inference of a converted model), or with ``--grad-mode no_grad`` under
``torch.no_grad()`` (a validation loop), at batch 1 and batch 8 (``--batches``), in fp32 and bf16, contiguous and
channels_last, with one thread (``torch.set_num_threads(1)``) and ``TRITONBN_BACKEND=torch``. The two models'
forwards are alternated call by call (which goes first alternating too); each side's time is the median of
``--reps`` (15) timed forwards after ``--warmup`` (3), in CPU time of the calling thread (with one thread it does
all of torch's work, and time other jobs take from it on a shared machine does not count); ``ratio`` is
``tritonbn_ms / plain_ms``.

``--layers`` adds one layer at the issue's four shapes (:data:`LAYERS`), ``nn.BatchNorm2d`` against
``tritonbn.SyncBatchNorm`` (no process group), fp32 and bf16: eval under ``torch.no_grad()`` and a training
forward+backward (``--layer-modes``; ``eval_grad``: an eval forward+backward under autograd), blocks of calls
alternated, median of ``--layer-reps`` (21) blocks per side. ``--nets-off``
leaves the whole networks out.

``--json FILE`` writes every figure; a markdown table goes to stdout. ``--max-ratio R`` (whole networks),
``--max-layer-ratio R`` (one layer in eval) and ``--max-train-layer-ratio R`` (one layer in training) exit with
status 1 when a ratio exceeds ``R`` (``.ci/run`` runs them with a noise margin over the targets: 1.03 for whole
networks, 1.1 for one layer in eval, 1.2 in training).
``--results PATH`` writes the table into that RESULTS.md, between the ``cpu-eval-step`` markers.

Run it as ``python benchmarks/cpu_eval_step.py`` (it sets ``TRITONBN_BACKEND=torch`` and unsets
``TRITON_INTERPRET`` before importing tritonbn).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

os.environ["TRITONBN_BACKEND"] = "torch"
os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("TRITONBN_DEBUG", None)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_train_step import DTYPES, LAYOUTS, _batch, _models, add_net_arguments, add_output_arguments  # noqa: E402
from cpu_train_step import _time_pair as time_pair  # noqa: E402 - one alternation for both scripts
from results_file import write_section  # noqa: E402

import tritonbn  # noqa: E402

GRAD_MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _forward(model, x, grad_mode):
    def forward() -> float:
        t0 = time.thread_time()
        with GRAD_MODES[grad_mode]():
            model(x)
        return time.thread_time() - t0

    return forward


def run(args) -> list[dict]:
    rows = []
    for net in args.nets:
        for dname in args.dtypes:
            for lname in args.layouts:
                dtype, layout = DTYPES[dname], LAYOUTS[lname]
                plain, converted = _models(net, dtype, layout, args.small)
                plain.eval()
                converted.eval()
                for batch in args.batches:
                    x, _ = _batch(net, dtype, layout, args.small, batch)
                    plain_ms, tb_ms = time_pair(
                        _forward(plain, x, args.grad_mode), _forward(converted, x, args.grad_mode), args.warmup,
                        args.reps,
                    )  # fmt: skip
                    rows.append({"net": net, "dtype": dname, "layout": lname, "batch": batch, "plain_ms": plain_ms,
                                 "tritonbn_ms": tb_ms, "ratio": tb_ms / plain_ms})  # fmt: skip
                    print(f"  {net} {dname} {lname} batch {batch}: plain {plain_ms:.3f} ms, tritonbn {tb_ms:.3f} ms, "
                          f"ratio {tb_ms / plain_ms:.3f}", file=sys.stderr, flush=True)  # fmt: skip
    return rows


LAYERS = ((8, 128, 8, 8), (8, 512, 4, 4), (8, 64, 16, 16), (16, 256, 14, 14))  # the one-layer rows


def _layer_calls(shape, dtype, mode):
    """``(plain, tritonbn)``: one call each of ``nn.BatchNorm2d`` and ``tritonbn.SyncBatchNorm`` (no process group)
    at ``shape``: eval under ``torch.no_grad()``, a training forward and backward, or (``eval_grad``) an eval
    forward and backward under autograd (a model in ``.eval()`` called without ``no_grad``)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    layers = [torch.nn.BatchNorm2d(shape[1]).to(dtype), tritonbn.SyncBatchNorm(shape[1]).to(dtype)]
    inner = max(1, 400000 // x.numel())  # calls per timed block: about 4e5 elements at least

    def block(bn):
        if mode == "eval":
            bn.eval()

            def call() -> float:
                t0 = time.thread_time()
                with torch.no_grad():
                    for _ in range(inner):
                        bn(x)
                return (time.thread_time() - t0) / inner

            return call
        if mode == "eval_grad":
            bn.eval()
        xg = x.clone().requires_grad_()

        def call() -> float:
            t0 = time.thread_time()
            for _ in range(inner):
                bn(xg).backward(dy)
            return (time.thread_time() - t0) / inner

        return call

    return block(layers[0]), block(layers[1])


def run_layers(args) -> list[dict]:
    rows = []
    for shape in LAYERS:
        for dname in args.dtypes:
            for mode in args.layer_modes:
                plain_ms, tb_ms = time_pair(*_layer_calls(shape, DTYPES[dname], mode), args.warmup, args.layer_reps)
                label = "x".join(map(str, shape))
                rows.append({"layer": label, "dtype": dname, "mode": mode, "plain_us": 1e3 * plain_ms,
                             "tritonbn_us": 1e3 * tb_ms, "ratio": tb_ms / plain_ms})  # fmt: skip
                print(f"  layer {label} {dname} {mode}: plain {1e3 * plain_ms:.1f} us, tritonbn {1e3 * tb_ms:.1f} us, "
                      f"ratio {tb_ms / plain_ms:.3f}", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def layer_table(rows: list[dict]) -> str:
    """One row per layer and dtype, a column pair per mode: ``nn.BatchNorm2d`` / tritonbn in µs, then the ratio."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    head = "| layer | dtype | " + " | ".join(f"{m} µs (BN / tritonbn) | {m} ratio" for m in modes) + " |"
    lines = [head, "| --- | --- |" + " --- | --- |" * len(modes)]
    by = {}
    for r in rows:
        by.setdefault((r["layer"], r["dtype"]), {})[r["mode"]] = r
    for (layer, dtype), cells in by.items():
        row = [f"{cells[m]['plain_us']:.1f} / {cells[m]['tritonbn_us']:.1f} | {cells[m]['ratio']:.3f}"
               if m in cells else "- | -" for m in modes]  # fmt: skip
        lines.append(f"| {layer} | {dtype} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """One row per network, dtype and layout, a column pair per batch: plain / tritonbn in ms, then the ratio."""
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    head = "| network | dtype | layout | " + " | ".join(f"batch {b} ms (plain / tritonbn) | ratio" for b in batches)
    lines = [head + " |", "| --- | --- | --- |" + " --- | --- |" * len(batches)]
    by = {}
    for r in rows:
        by.setdefault((r["net"], r["dtype"], r["layout"]), {})[r["batch"]] = r
    for (net, dtype, layout), cells in by.items():
        row = [f"{cells[b]['plain_ms']:.3f} / {cells[b]['tritonbn_ms']:.3f} | {cells[b]['ratio']:.3f}"
               if b in cells else "- | -" for b in batches]  # fmt: skip
        lines.append(f"| {net} | {dtype} | {layout} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def section(meta: dict, rows: list[dict], worst: float, layer_rows: list[dict] | None = None) -> str:
    """The RESULTS.md section of a run (``--results``): what was run, where, and the table."""
    load = ", ".join(f"{v:.1f}" for v in meta["load_average"])
    return (
        f"Written by `python benchmarks/cpu_eval_step.py{' --small' if meta['small'] else ''} --results ...` on "
        f"{meta['date']}: {meta['machine']}, {meta['cpus']} CPUs, one thread, torch {meta['torch']}, Python "
        f"{meta['python']}, load average {load} at the end; eval forwards under {meta['grad_mode']}, median of "
        f"{meta['reps']} after {meta['warmup']} warm-up calls, plain and tritonbn alternated; ratio = tritonbn / "
        f"plain. Worst ratio {worst:.3f}; {meta['seconds']:.0f} s.\n\n{table(rows)}\n"
        + (
            f"\nOne layer (`--layers`), `nn.BatchNorm2d` against `tritonbn.SyncBatchNorm`: eval under no_grad, "
            f"eval_grad an eval forward+backward under autograd, train forward+backward; median of "
            f"{meta['layer_reps']} alternated blocks.\n\n{layer_table(layer_rows)}\n"
            if layer_rows
            else ""
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_net_arguments(p)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="samples per forward (default 1 and 8)")
    p.add_argument("--grad-mode", choices=list(GRAD_MODES), default="inference_mode")
    p.add_argument("--reps", type=int, default=15, help="timed forwards per side (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards per side first")
    p.add_argument("--nets-off", dest="whole", action="store_false", help="skip the whole networks")
    p.add_argument("--layers", action="store_true", help="also time one layer at the issue's four shapes")
    p.add_argument("--layer-reps", type=int, default=21, help="timed blocks per side and layer (default 21)")
    p.add_argument("--layer-modes", nargs="+", choices=("eval", "eval_grad", "train"), default=["eval", "train"],
                   help="one layer's calls: eval (no_grad), eval_grad (fwd+bwd, autograd), train")  # fmt: skip
    p.add_argument("--max-layer-ratio", type=float, metavar="R", help="exit 1 when a one-layer eval ratio exceeds R")
    p.add_argument("--max-train-layer-ratio", type=float, metavar="R",
                   help="exit 1 when a one-layer training ratio exceeds R")  # fmt: skip
    add_output_arguments(p, "cpu-eval-step", "exit 1 when a ratio exceeds R")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = run(args) if args.whole else []
    layer_rows = run_layers(args) if args.layers else []
    if rows:
        print(table(rows))
    if layer_rows:
        print(f"\n{layer_table(layer_rows)}")
    worst = max((r["ratio"] for r in rows), default=0.0)
    worst_layer = max((r["ratio"] for r in layer_rows if r["mode"] != "train"), default=0.0)
    worst_train = max((r["ratio"] for r in layer_rows if r["mode"] == "train"), default=0.0)
    meta = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": 1,
        "load_average": os.getloadavg(), "small": args.small, "reps": args.reps, "warmup": args.warmup,
        "grad_mode": args.grad_mode, "layer_reps": args.layer_reps, "seconds": time.perf_counter() - t0,
        "tritonbn": os.path.dirname(tritonbn.__file__),
    }  # fmt: skip
    parts = [f"worst ratio {worst:.3f}"] if rows else []
    if any(r["mode"] != "train" for r in layer_rows):
        parts.append(f"one layer {worst_layer:.3f} in eval")
    if any(r["mode"] == "train" for r in layer_rows):
        parts.append(f"one layer {worst_train:.3f} in training")
    print(f"\n{', '.join(parts)}; load average {meta['load_average'][0]:.2f}; {meta['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "worst_ratio": worst, "results": rows, "worst_layer_ratio": worst_layer,
                       "worst_train_layer_ratio": worst_train, "layers": layer_rows}, f, indent=1)  # fmt: skip
    if args.results:
        write_section(args.results, "cpu-eval-step", section(meta, rows, worst, layer_rows))
    failed = 0
    if args.max_ratio is not None and worst > args.max_ratio:
        print(f"cpu_eval_step: worst ratio {worst:.3f} exceeds --max-ratio {args.max_ratio}", file=sys.stderr)
        failed = 1
    if args.max_layer_ratio is not None and worst_layer > args.max_layer_ratio:
        print(f"cpu_eval_step: worst one-layer ratio {worst_layer:.3f} exceeds --max-layer-ratio "
              f"{args.max_layer_ratio}", file=sys.stderr)  # fmt: skip
        failed = 1
    if args.max_train_layer_ratio is not None and worst_train > args.max_train_layer_ratio:
        print(f"cpu_eval_step: worst one-layer training ratio {worst_train:.3f} exceeds --max-train-layer-ratio "
              f"{args.max_train_layer_ratio}", file=sys.stderr)  # fmt: skip
        failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
