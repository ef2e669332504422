"""What ``tritonbn bench`` shows: the table, ``bench_model.csv`` and ``bench_model.png``."""

from __future__ import annotations

import csv
import os

CPU_NOTE = (
    "CPU run: these times say nothing about a GPU. The Triton kernels are written for GPUs; on CPU they run "
    "under an interpreter, and the sizes are small. Run on a CUDA GPU for figures that mean something."
)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def table(result: dict) -> str:
    """The printed table: one line per (input, mode), the providers' ms, speedup, then the totals per step."""
    meta, rows = result["meta"], result["rows"]
    names, ref = meta["providers"], meta["reference"]
    ours = next(n for n in names if n.startswith("tritonbn"))
    by: dict[tuple, dict] = {}
    for r in rows:
        entry = by.setdefault((r["shape"], r["dtype"], r["layout"], r["mode"]), {"row": r, "spread": 0.0})
        entry[r["provider"]] = r.get("ms")
        entry["spread"] = max(entry["spread"], r.get("spread", 0.0))
    spreads = any("spread" in r for r in rows)
    head = ["input", "dtype", "layout", "layers", "calls", "mode", *[f"{n} ms" for n in names], f"vs {ref}"]
    head += ["spread"] if spreads else []
    lines = [head]
    totals = {(mode, n): 0.0 for mode in ("train", "eval") for n in names}
    complete = {key: True for key in totals}
    for (label, dt, layout, mode), entry in by.items():
        r = entry["row"]
        for n in names:
            if entry.get(n) is None:
                complete[(mode, n)] = False
            else:
                totals[(mode, n)] += r["calls"] * entry[n]
        speed = "-" if entry.get(ours) is None or entry.get(ref) is None else f"{entry[ref] / entry[ours]:.2f}x"
        lines.append(
            [label, dt, layout, str(r["layers"]), str(r["calls"]), mode, *[_ms(entry.get(n)) for n in names], speed]
            + ([f"{100 * entry['spread']:.0f}%"] if spreads else [])
        )
    for mode in ("train", "eval"):
        tot = {n: totals[(mode, n)] if complete[(mode, n)] else None for n in names}
        speed = "-" if tot[ours] is None or tot[ref] is None else f"{tot[ref] / tot[ours]:.2f}x"
        lines.append(["total per step", "", "", "", "", mode, *[_ms(tot[n]) for n in names], speed])
        lines[-1] += [""] if spreads else []
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    text.insert(len(text) - 2, "  ".join("-" * w for w in widths))
    mode_text = "train: forward+backward in training mode; eval: forward with the running statistics."
    return (
        "\n".join(text)
        + f"\n{mode_text} Medians in ms; total per step = sum of calls x ms; "
        + (f"speedup = {ref} / {ours}.")
        + (
            " spread: the widest interquartile range of the row's providers over its median (the providers timed"
            " in turn, call by call)."
            if spreads
            else ""
        )
    )


def write_csv(result: dict, path: str) -> None:
    fields = ["shape", "dtype", "layout", "stride", "layers", "calls", "mode", "provider", "ms", "spread", "error"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in result["rows"]:
            writer.writerow({k: r.get(k, "") for k in fields})


def plot(result: dict, path: str) -> str | None:
    """Bars of ms per training step (calls x ms) per input and provider, train and eval; ``None`` or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'tritonbn[plot]'): no bench_model.png"
    meta, rows = result["meta"], result["rows"]
    names = meta["providers"]
    labels = list(dict.fromkeys(f"{r['shape']}\n{r['layout']}" for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.9 * len(labels) + 2), 7), sharex=True)
    width = 0.8 / len(names)
    for ax, mode in zip(axes, ("train", "eval"), strict=True):
        for i, n in enumerate(names):
            ms = {
                f"{r['shape']}\n{r['layout']}": r["calls"] * r["ms"]
                for r in rows
                if r["mode"] == mode and r["provider"] == n and "ms" in r
            }
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, [ms.get(label, 0.0) for label in labels], width, label=n)
        ax.set_ylabel(f"{mode}: ms per step")
        ax.set_title("training forward+backward" if mode == "train" else "eval forward", fontsize=9)
        ax.legend(fontsize=8)
    axes[1].set_xticks(range(len(labels)), labels, fontsize=7, rotation=45, ha="right")
    title = (
        f"{meta['model']}, input {meta['input']} {meta['dtype']}, {meta['world']} rank(s), {meta['device']}: "
        "BatchNorm time per step (calls x median)"
    )
    if meta["device"] == "cpu":
        title += "\nCPU run: these times say nothing about a GPU"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def report(result: dict, out: str) -> None:
    """Print the table and write ``out/bench_model.csv`` and ``out/bench_model.png``."""
    print(table(result), flush=True)
    os.makedirs(out, exist_ok=True)
    write_csv(result, os.path.join(out, "bench_model.csv"))
    why_not = plot(result, os.path.join(out, "bench_model.png"))
    print(f"wrote {os.path.join(out, 'bench_model.csv')}" + (f"; {why_not}" if why_not else " and bench_model.png"))
    if result["meta"]["device"] == "cpu":
        print(CPU_NOTE)
    skipped = sum(r.get("error", "").startswith("skipped") for r in result["rows"])
    if skipped:
        print(f"  {skipped} case(s) not measured: the --budget-s time budget was spent (a '-' in the table)")
    failed = [r for r in result["rows"] if "error" in r and not r["error"].startswith("skipped")]
    for r in failed:
        print(f"  failed: {r['shape']} {r['mode']} {r['provider']}: {r['error']}")
