"""The kernel audit's time model next to measured per-layer times (run by scripts/gpu_check.sh).

    python benchmarks/model_check.py --model benchmarks/model.json --headline OUTDIR/headline.jsonl

``benchmarks/model.json`` is written by ``python benchmarks/kernel_audit.py --model --out benchmarks``
(a MODEL, from the compiled code and named assumptions, no GPU). ``headline.jsonl`` holds what
``benchmarks/headline.py`` measured: tritonbn's forward+backward per ResNet-50 BatchNorm shape,
channels_last bf16, over a 1-rank group (so its times also hold the two all-reduces and the host's
launches, which the model leaves out). Prints both, per shape and summed over the model's layers.
"""

from __future__ import annotations

import argparse
import json
import sys


def compare(model: dict, measured_rows: list[dict], dtype: str = "bf16", layout: str = "channels_last") -> list[str]:
    modeled = {p["shape"]: p["fwd_bwd_us"] for p in model["per_layer"] if p["dtype"] == dtype and p["layout"] == layout}
    measured, counts = {}, {}
    for r in measured_rows:
        if r.get("table") == "layer" and r.get("provider") == "tritonbn" and "ms" in r:
            shape = "x".join(map(str, r["shape"]))
            measured[shape], counts[shape] = r["ms"] * 1e3, r.get("count", 1)
    lines = [
        f"model vs measured, {dtype} {layout}, forward+backward per layer (the model is a model; see its assumptions)",
        f"{'shape':>16} {'layers':>6} {'modeled us':>11} {'measured us':>12} {'measured/model':>15}",
    ]
    tot_model = tot_meas = 0.0
    for shape in sorted(modeled, key=lambda s: [int(v) for v in s.split("x")]):
        got = measured.get(shape)
        ratio = f"{got / modeled[shape]:.2f}" if got else "-"
        lines.append(f"{shape:>16} {counts.get(shape, '-'):>6} {modeled[shape]:>11.1f} "
                     f"{(f'{got:.1f}' if got else '-'):>12} {ratio:>15}")  # fmt: skip
        if got:
            tot_model += counts[shape] * modeled[shape]
            tot_meas += counts[shape] * got
    if tot_model:
        lines.append(f"{'sum (measured shapes)':>23} {tot_model / 1e3:>11.3f} ms {tot_meas / 1e3:>9.3f} ms "
                     f"{tot_meas / tot_model:>12.2f}")  # fmt: skip
    else:
        lines.append("no measured per-layer times to compare")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/model.json")
    parser.add_argument("--headline", required=True, help="headline.jsonl of benchmarks/headline.py")
    args = parser.parse_args(argv)
    with open(args.model) as f:
        model = json.load(f)
    with open(args.headline) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    print("\n".join(compare(model, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
