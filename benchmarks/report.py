"""Turn pytest-benchmark JSON into DIR/RESULTS.md, DIR/results.csv and plots drawn from that CSV.

    python benchmarks/report.py results.json [more.json ...] --out DIR [--results benchmarks/RESULTS.md]

``--results`` also writes a summary (each table's range per mode, the collective bytes, the plots) into
that file, between the ``benchmark-suite`` markers; every row stays in DIR/RESULTS.md.

The plots (time and GB/s against activation size, one line per provider) need matplotlib, the
``plot`` extra; without it the table is still written.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_file import write_section  # noqa: E402

PROVIDERS = ["tritonbn", "tritonbn_local", "torch_sync", "cudnn", "tritonbn_torch"]
LABELS = {
    "tritonbn": "tritonbn (synchronized over a 1-rank group)",
    "tritonbn_local": "tritonbn (world size 1, no collective)",
    "torch_sync": "torch.nn.SyncBatchNorm (sync path)",
    "cudnn": "F.batch_norm (cuDNN on GPU)",
    "tritonbn_torch": "tritonbn, PyTorch backend",
}
COLORS = {"tritonbn": "C0", "tritonbn_local": "C4", "torch_sync": "C1", "cudnn": "C2", "tritonbn_torch": "C3"}
FIELDS = [
    "suite", "provider", "shape", "numel", "layout", "dtype", "mode", "median_ms", "q20_ms", "q80_ms", "bytes",
    "gbps", "copy_gbps", "pct_of_copy", "peak_memory_bytes", "launches", "device", "date", "torch", "triton",
    "tritonbn", "interpreter",
]  # fmt: skip


def load_rows(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    rows = []
    for bench in data["benchmarks"]:
        info = dict(bench.get("extra_info") or {})
        if "provider" not in info:
            continue
        info["numel"] = math.prod(info["shape"])
        info["shape"] = "x".join(map(str, info["shape"]))
        rows.append(info)
    if not rows:
        raise SystemExit(f"report: {path} holds no tritonbn benchmark rows")
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: str) -> list[dict]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for key in ("numel", "median_ms", "gbps", "pct_of_copy"):
            r[key] = float(r[key])
    return rows


def _fmt(value, spec=".3g"):
    return "-" if value is None or value == "" else format(value, spec)


def _ratio(a, b):
    return None if a is None or b is None or a == 0 else b / a


def case_table(rows: list[dict], suite: str) -> list[str]:
    cases = defaultdict(dict)
    for r in rows:
        if r["suite"] == suite:
            cases[(r["numel"], r["shape"], r["layout"], r["dtype"], r["mode"])][r["provider"]] = r
    providers = [p for p in PROVIDERS if any(p in c for c in cases.values())]
    head = ["shape", "layout", "dtype", "mode"] + [f"{p} ms" for p in providers]
    head += ["speedup vs torch_sync", "world-1 speedup vs cudnn", "tritonbn GB/s", "% of copy BW", "launches",
             "peak MiB"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(cases):
        _, shape, layout, dtype, mode = key
        c = cases[key]
        t = {p: c[p]["median_ms"] if p in c else None for p in providers}
        ours = c.get("tritonbn", {})
        launches = "/".join(_fmt(c[p]["launches"], "d") if p in c else "-" for p in providers)
        peak = ours.get("peak_memory_bytes")
        cells = [shape, layout, dtype, mode] + [_fmt(t[p]) for p in providers]
        cells += [
            _fmt(_ratio(t.get("tritonbn"), t.get("torch_sync")), ".2f"),
            _fmt(_ratio(t.get("tritonbn_local"), t.get("cudnn")), ".2f"),
            _fmt(ours.get("gbps")),
            _fmt(ours.get("pct_of_copy"), ".1f"),
            launches,
            _fmt(None if peak is None else peak / 2**20, ".1f"),
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines + ["", f"launches: per pass, for {' / '.join(providers)}."]


def collective_table(rows: list[dict]) -> list[str]:
    channels = sorted({int(r["shape"].split("x")[1]) for r in rows if r["suite"] == "resnet50"})
    lines = [
        "| C | W | tritonbn forward | torch forward | tritonbn backward | torch backward |",
        "|---|---|---|---|---|---|",
    ]
    for C in channels:
        for W in (2, 8, 64):
            b = {"tritonbn_forward": 8 * (2 * C + 1), "torch_forward": 4 * W * (2 * C + 1), "tritonbn_backward": 8 * C,
                 "torch_backward": 8 * C}  # fmt: skip
            lines.append(f"| {C} | {W} | {b['tritonbn_forward']} | {b['torch_forward']} | {b['tritonbn_backward']} | "
                         f"{b['torch_backward']} |")  # fmt: skip
    return lines


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = _fmt(min(values)), _fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


SUITES = {"resnet50": "ResNet-50 shapes", "sweep": "size sweep", "epilogue": "fused relu(bn(x) + residual)"}


def results_section(rows: list[dict], plots: list[str]) -> str:
    """The ``--results`` section: per table and mode, the range of each provider's median over the rows."""
    first = rows[0]
    interpreted = str(first.get("interpreter")) == "1"
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    lines = [
        "## Benchmark suite" + (" (CPU smoke run, Triton interpreter)" if interpreted else ""),
        "",
        f"`pytest benchmarks --benchmark-json F`, then `python benchmarks/report.py F --out DIR --results ...` "
        f"(every row in DIR/RESULTS.md). Measured on **{first['device']}** on {first['date']}, torch "
        f"{first['torch']}, triton {first['triton']}, tritonbn {first['tritonbn']}; copy bandwidth "
        f"{_fmt(first.get('copy_gbps'))} GB/s; load not recorded.",
    ]
    if interpreted:
        lines += [
            "Small shapes, the kernels under the Triton interpreter: the times measure the interpreter and say "
            "nothing about GPUs; `torch.nn.SyncBatchNorm` refuses CPU tensors in training.",
        ]
    lines += [
        "",
        "| table | mode | cases | " + " | ".join(f"{p} ms" for p in providers) + " | launches |",
        "|" + "---|" * (len(providers) + 4),
    ]
    for suite, title in SUITES.items():
        for mode in ("eval", "forward", "forward_backward"):
            sel = [r for r in rows if r["suite"] == suite and r["mode"] == mode]
            if not sel:
                continue
            cases = {(r["shape"], r["layout"], r["dtype"]) for r in sel}
            spans = [_span([float(r["median_ms"]) for r in sel if r["provider"] == p]) for p in providers]
            launches = "/".join(
                _span([float(r["launches"]) for r in sel if r["provider"] == p and r.get("launches") not in (None, "")])
                for p in providers
            )
            lines.append(f"| {title} | {mode} | {len(cases)} | " + " | ".join(spans) + f" | {launches} |")
    channels = sorted({int(r["shape"].split("x")[1]) for r in rows if r["suite"] == "resnet50"})
    lines += [
        "",
        "launches: per pass, for " + " / ".join(providers) + ".",
        "",
        "**Collective bytes per rank and training step** (from the message layouts): tritonbn all-reduces 2C+1 "
        "fp64 forward and 2C fp32 backward at any world size W; torch.nn.SyncBatchNorm all-gathers W x (2C+1) "
        "fp32 forward.",
        "",
        "| C | W | tritonbn forward | torch forward | tritonbn backward | torch backward |",
        "|---|---|---|---|---|---|",
    ]
    for C in channels:
        torch_forward = " / ".join(str(4 * W * (2 * C + 1)) for W in (2, 8, 64))
        lines.append(f"| {C} | 2 / 8 / 64 | {8 * (2 * C + 1)} | {torch_forward} | {8 * C} | {8 * C} |")
    if plots:
        lines += ["", *[f"![{p}]({p})" for p in plots]]
    return "\n".join(lines) + "\n"


def targets(rows: list[dict]) -> list[str]:
    """The GPU targets, checked against this run's figures."""
    by = defaultdict(dict)
    for r in rows:
        by[(r["suite"], r["shape"], r["layout"], r["dtype"], r["mode"])][r["provider"]] = r
    rn50 = [c for k, c in by.items() if k[0] == "resnet50" and k[2] == "channels_last" and k[3] == "bf16"
            and k[4] == "forward_backward" and "tritonbn" in c and "torch_sync" in c]  # fmt: skip
    lines = []
    if rn50:
        speedups = [c["torch_sync"]["median_ms"] / c["tritonbn"]["median_ms"] for c in rn50]
        geo = math.exp(sum(map(math.log, speedups)) / len(speedups))
        lines.append(f"- forward+backward vs torch.nn.SyncBatchNorm's sync path, ResNet-50 channels_last bf16: "
                     f"geometric-mean speedup {geo:.2f}x (min {min(speedups):.2f}x) — target 1.5x")  # fmt: skip
    large = [r for r in rows if r["provider"] == "tritonbn" and r["suite"] == "sweep"]
    if large:
        biggest = max(r["numel"] for r in large)
        pct = [r["pct_of_copy"] for r in large if r["numel"] == biggest]
        lines.append(f"- largest sweep activation: tritonbn at {min(pct):.0f}% to {max(pct):.0f}% of the measured copy "
                     "bandwidth — target 85%")  # fmt: skip
    vs_cudnn = [c["tritonbn_local"]["median_ms"] / c["cudnn"]["median_ms"] for c in by.values()
                if "tritonbn_local" in c and "cudnn" in c]  # fmt: skip
    if vs_cudnn:
        geo = math.exp(sum(map(math.log, vs_cudnn)) / len(vs_cudnn))
        lines.append(f"- world size 1, tritonbn time / cuDNN time over all cases: geometric mean {geo:.2f} "
                     f"(worst {max(vs_cudnn):.2f}) — target at most 1.1")  # fmt: skip
    return lines


def plot(csv_path: str, out_dir: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("report: matplotlib is not installed (pip install tritonbn[plot]); no plots", file=sys.stderr)
        return []
    rows = [r for r in read_csv(csv_path) if r["suite"] == "sweep"]
    written = []
    for metric, label, name in (("median_ms", "median time (ms)", "time_vs_size.png"),
                                ("gbps", "GB/s", "gbps_vs_size.png")):  # fmt: skip
        modes = sorted({r["mode"] for r in rows})
        layouts = sorted({r["layout"] for r in rows})
        fig, axes = plt.subplots(len(layouts), len(modes), figsize=(5 * len(modes), 3.6 * len(layouts)), squeeze=False)
        for i, layout in enumerate(layouts):
            for j, mode in enumerate(modes):
                ax = axes[i][j]
                for provider in PROVIDERS:
                    mine = [r for r in rows if (r["provider"], r["mode"], r["layout"]) == (provider, mode, layout)]
                    pts = sorted((r["numel"], r[metric]) for r in mine)
                    if pts:
                        ax.plot(*zip(*pts, strict=True), marker="o", label=LABELS[provider], color=COLORS[provider])
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.set_title(f"{mode}, {layout}")
                ax.set_xlabel("activation elements")
                ax.set_ylabel(label)
                ax.grid(True, which="major", alpha=0.3)
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=9)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        fig.savefig(os.path.join(out_dir, name), dpi=90)
        plt.close(fig)
        written.append(name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="pytest-benchmark JSON files (pytest benchmarks --benchmark-json FILE)")
    parser.add_argument("--out", required=True, help="directory for RESULTS.md, results.csv and the plots")
    parser.add_argument("--results", help="also write a summary into this RESULTS.md, between the benchmark-suite "
                        "markers")  # fmt: skip
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = [row for path in args.json for row in load_rows(path)]
    csv_path = os.path.join(args.out, "results.csv")
    write_csv(rows, csv_path)
    plots = plot(csv_path, args.out)

    first = rows[0]
    interpreted = str(first.get("interpreter")) == "1"
    copy = first.get("copy_gbps")
    lines = [
        "# tritonbn benchmark results",
        "",
        f"Measured on **{first['device']}** on {first['date']}, with torch {first['torch']}, triton "
        f"{first['triton']}, tritonbn {first['tritonbn']}. Copy bandwidth measured in the same run: "
        f"{_fmt(copy)} GB/s. Regenerate with `pytest benchmarks --benchmark-json F` and "
        "`python benchmarks/report.py F --out DIR`.",
        "",
    ]
    if interpreted:
        lines += [
            "> **No GPU was available for this run.** This is the CPU smoke run: small shapes, with the Triton",
            "> kernels under the Triton interpreter (which runs numpy, about a million elements a second).",
            "> Its times measure the interpreter, not the kernels, and say nothing about GPU performance;",
            "> `torch.nn.SyncBatchNorm`'s synchronized path refuses CPU tensors, so its training rows are absent.",
            "> GPU figures, and the check of the GPU targets, wait for a run of `scripts/gpu_check.sh` on a GPU.",
            "",
        ]
    else:
        lines += ["## Targets", "", *targets(rows), ""]
    title = "## ResNet-50 BatchNorm shapes" + (" (scaled down for the CPU smoke run)" if interpreted else ", batch 32")
    lines += [title, "", *case_table(rows, "resnet50"), "", "## Size sweep", "", *case_table(rows, "sweep"), ""]
    lines += [
        "## Fused epilogue: relu(bn(x) + residual)",
        "",
        "tritonbn fuses the add and the ReLU into its kernels; the other providers run batch norm, then a separate "
        "add and ReLU.",
        "",
        *case_table(rows, "epilogue"),
        "",
    ]
    lines += [
        "## Collective bytes per rank and training step",
        "",
        "tritonbn all-reduces 2C+1 fp64 forward and 2C fp32 backward at any world size W; "
        "torch.nn.SyncBatchNorm all-gathers W x (2C+1) fp32 forward. (Computed from the message layouts, "
        "which a test checks for tritonbn.)",
        "",
        *collective_table(rows),
        "",
    ]
    if plots:
        lines += ["## Plots", "", *[f"![{p}]({p})" for p in plots], ""]
    with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
        f.write("\n".join(lines))
    if args.results:
        write_section(args.results, "benchmark-suite", results_section(rows, plots))
    print(f"report: wrote {os.path.join(args.out, 'RESULTS.md')}, results.csv and {len(plots)} plot(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
