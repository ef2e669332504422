"""The headline figures: ResNet-50's BatchNorms, and a whole ResNet-50 training step.

    python benchmarks/headline.py --out DIR [--budget-s 300]      # on one CUDA GPU, over a 1-rank NCCL group
    python benchmarks/headline.py --out DIR --smoke               # on CPU: tiny sizes, gloo, checks the code runs

1. **Per layer**: every distinct BatchNorm input shape of ResNet-50 at batch 32, channels_last bf16,
   forward+backward (training), for tritonbn (synchronizing over the group), ``torch.nn.SyncBatchNorm``'s
   synchronized autograd Function (its sync path, forced at world size 1) and ``F.batch_norm``
   (cuDNN, no sync); then the sum over the model's 53 layers, each shape weighted by its count.
   Median of ``triton.testing.do_bench`` (CUDA events).
2. **Training step**: ResNet-50, batch 32, channels_last, bf16 autocast, SGD, eager and under
   ``torch.compile``, with tritonbn layers, ``torch.nn.SyncBatchNorm`` (sync path forced) and plain
   ``BatchNorm2d`` (cuDNN, no sync). Median of CUDA-event timed steps.
3. **Host time per BatchNorm layer**: the CPU time of the Python thread to issue one eager step
   (the GPU idle before each, backward on the same thread), for each of those and for the same model
   with ``nn.Identity`` in place of every BatchNorm; per layer: the difference over the 53 layers.

Each result is appended to ``DIR/headline.jsonl`` as soon as it is measured, and ``DIR/headline.md``
is rewritten from it, so a run stopped by its time budget keeps what it measured. A case that fails
is recorded with its error, never with a figure. ``--smoke`` times on CPU with a wall clock; those
times measure nothing and are labelled so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tritonbn  # noqa: E402
from tritonbn.cli.bench import time_ms  # noqa: E402
from tritonbn.cli.resnet50 import distinct_bn_shapes, resnet50  # noqa: E402
from tritonbn.functional import batch_norm  # noqa: E402

PROVIDERS = ("tritonbn", "torch_sync", "cudnn")


class TorchSyncPath(nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` that takes its synchronized path at world size 1 too (torch skips it there)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        from torch.nn.modules._functions import SyncBatchNorm as SyncFunction

        self.num_batches_tracked.add_(1)
        group = self.process_group or dist.group.WORLD
        return SyncFunction.apply(input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                  self.momentum, group, dist.get_world_size(group))  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Timer:
    """Median milliseconds of ``fn``: do_bench on CUDA, a wall clock on CPU (smoke only)."""

    def __init__(self, device: torch.device, smoke: bool) -> None:
        self.device, self.smoke = device, smoke

    def __call__(self, fn, reps: int = 30) -> float:
        if self.device.type == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=10, rep=max(reps, 25), quantiles=[0.5])[0])
        times = []
        for _ in range(1 if self.smoke else reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def steps(self, fn, iters: int) -> float:
        """Median of ``iters`` individually timed calls (CUDA events), after the caller's warm-up."""
        if self.device.type != "cuda":
            return self(fn)
        return statistics.median(time_ms(fn, self.device) for _ in range(iters))


class Recorder:
    def __init__(self, out: str, meta: dict) -> None:
        self.out, self.meta, self.rows = out, meta, []
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, "headline.jsonl")
        open(self.path, "w").close()

    def add(self, **row) -> None:
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        with open(os.path.join(self.out, "headline.md"), "w") as f:
            f.write(render(self.rows, self.meta))
        shown = {k: v for k, v in row.items() if k not in ("error",)}
        print("headline:", json.dumps(shown), ("ERROR " + row["error"].splitlines()[-1]) if "error" in row else "")


def _layer_case(provider, shape, dtype, device, group):
    torch.manual_seed(0)
    C = shape[1]
    x = torch.randn(shape, device=device).to(dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
    dy = torch.randn_like(x)
    w = torch.rand(C, device=device, requires_grad=True)
    b = torch.randn(C, device=device, requires_grad=True)
    rm, rv = torch.zeros(C, device=device), torch.ones(C, device=device)
    nbt = torch.zeros((), dtype=torch.long, device=device)
    if provider == "tritonbn":
        fwd = lambda: batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5, group, nbt)  # noqa: E731
    elif provider == "torch_sync":
        from torch.nn.modules._functions import SyncBatchNorm as SyncFunction

        fwd = lambda: SyncFunction.apply(x, w, b, rm, rv, 1e-5, 0.1, group, 1)  # noqa: E731
    else:
        fwd = lambda: F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)  # noqa: E731

    def run():
        for t in (x, w, b):
            t.grad = None
        fwd().backward(dy)

    return run


def per_layer(rec: Recorder, timer: Timer, shapes, dtype, device, group, deadline: float) -> None:
    for shape, count in shapes:
        for provider in PROVIDERS:
            if time.time() > deadline:
                rec.add(table="layer", shape=list(shape), provider=provider, error="skipped: time budget spent")
                continue
            if provider == "torch_sync" and device.type != "cuda":
                rec.add(table="layer", shape=list(shape), provider=provider, count=count,
                        error="skipped: torch.nn.SyncBatchNorm's sync path refuses CPU tensors")  # fmt: skip
                continue
            try:
                run = _layer_case(provider, shape, dtype, device, group)
                run()  # compiles, checks it runs
                rec.add(table="layer", shape=list(shape), provider=provider, count=count, ms=timer(run))
            except Exception:  # noqa: BLE001 - recorded, the run goes on
                rec.add(table="layer", shape=list(shape), provider=provider, count=count, error=traceback.format_exc())


def make_model(variant: str, width: int, device, group) -> nn.Module:
    if variant == "none":  # no BatchNorm at all: the baseline of the host time per layer
        norm = lambda c: nn.Identity()  # noqa: E731
    elif variant == "tritonbn":
        norm = lambda c: tritonbn.SyncBatchNorm(c, process_group=group)  # noqa: E731
    elif variant == "torch_sync":
        norm = lambda c: TorchSyncPath(c, process_group=group)  # noqa: E731
    else:
        norm = nn.BatchNorm2d
    torch.manual_seed(0)
    return resnet50(width=width, norm_layer=norm).to(device).to(memory_format=torch.channels_last)


def training_step(model: nn.Module, opt: torch.optim.Optimizer, x, target, device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def host_us(model: nn.Module, opt, x, target, device, iters: int) -> float:
    """Median CPU time of this thread (µs) to issue one eager training step, the GPU idle at its start.

    Backward runs on this thread too (torch otherwise runs a CUDA backward on a device thread).
    """
    times = []
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.thread_time_ns()
            training_step(model, opt, x, target, device)
            times.append((time.thread_time_ns() - t0) / 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def step_times(rec: Recorder, timer: Timer, args, device, group, deadline: float) -> None:
    batch, image, width = (2, 32, 4) if args.smoke else (32, 224, 64)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, 3, image, image, device=device, generator=g).contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 1000, (batch,), device=device, generator=g)
    if time.time() < deadline:
        try:  # the host-time baseline: the same model without BatchNorm
            model = make_model("none", width, device, group)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            for _ in range(1 if args.smoke else 3):
                training_step(model, opt, x, target, device)
            us = host_us(model, opt, x, target, device, 3 if args.smoke else args.step_iters)
            rec.add(table="step", variant="none", mode="eager", host_us=us, bn_layers=53)
        except Exception:  # noqa: BLE001 - recorded, the run goes on
            rec.add(table="step", variant="none", mode="eager", error=traceback.format_exc())
        finally:
            model = opt = None
    for compiled in (False, True) if args.compile else (False,):
        for variant in PROVIDERS:
            mode = "torch.compile" if compiled else "eager"
            if variant == "torch_sync" and device.type != "cuda":
                rec.add(table="step", variant=variant, mode=mode,
                        error="skipped: torch.nn.SyncBatchNorm's sync path refuses CPU tensors")  # fmt: skip
                continue
            if time.time() > deadline:
                rec.add(table="step", variant=variant, mode=mode, error="skipped: time budget spent")
                continue
            try:
                model = make_model(variant, width, device, group)
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
                fn = model
                if compiled:
                    torch._dynamo.reset()
                    fn = torch.compile(model, backend=args.compile_backend)
                t0 = time.time()
                for _ in range(1 if args.smoke else 3):  # warm-up: compiles, allocates optimizer state
                    training_step(fn, opt, x, target, device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                warmup_s = time.time() - t0
                ms = timer.steps(lambda fn=fn, opt=opt: training_step(fn, opt, x, target, device), args.step_iters)
                row = {"ms": ms, "warmup_s": round(warmup_s, 1)}
                if not compiled:
                    row["host_us"] = host_us(model, opt, x, target, device, 3 if args.smoke else args.step_iters)
                rec.add(table="step", variant=variant, mode=mode, **row)
            except Exception:  # noqa: BLE001 - recorded, the run goes on
                rec.add(table="step", variant=variant, mode=mode, error=traceback.format_exc())
            finally:
                model = opt = fn = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def _ms(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def render(rows: list[dict], meta: dict) -> str:
    smoke = meta["smoke"]
    lines = [
        "## Headline: ResNet-50 BatchNorm, channels_last bf16"
        + (" (CPU SMOKE RUN: times measure nothing)" if smoke else ""),
        "",
        f"Measured on **{meta['device']}** on {meta['date']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"tritonbn {meta['tritonbn']}, over a 1-rank {meta['backend']} group. Medians in ms "
        f"({'wall clock' if smoke else 'triton.testing.do_bench / CUDA events'}). "
        "`torch_sync`: `torch.nn.SyncBatchNorm`'s synchronized path (forced at world size 1); `cudnn`: `F.batch_norm` "
        "/ `BatchNorm2d`, no sync. A missing figure was not measured; its error is in headline.jsonl.",
        "",
        "### Forward+backward per layer",
        "",
        "| shape | layers | tritonbn ms | torch_sync ms | cudnn ms | vs torch_sync | vs cudnn |",
        "|---|---|---|---|---|---|---|",
    ]
    layer = {}
    for r in rows:
        if r["table"] == "layer":
            layer.setdefault(tuple(r["shape"]), {})[r["provider"]] = r
    totals = {p: 0.0 for p in PROVIDERS}
    layers = 0
    complete = {p: True for p in PROVIDERS}
    for shape, by in layer.items():
        ms = {p: by.get(p, {}).get("ms") for p in PROVIDERS}
        count = next((r.get("count") for r in by.values() if r.get("count")), 1)
        layers += count
        for p in PROVIDERS:
            if ms[p] is None:
                complete[p] = False
            else:
                totals[p] += count * ms[p]
        ratio = lambda a, b: "-" if a is None or b is None else f"{b / a:.2f}x"  # noqa: E731
        lines.append(f"| {'x'.join(map(str, shape))} | {count} | {_ms(ms['tritonbn'])} | {_ms(ms['torch_sync'])} "
                     f"| {_ms(ms['cudnn'])} | {ratio(ms['tritonbn'], ms['torch_sync'])} "
                     f"| {ratio(ms['tritonbn'], ms['cudnn'])} |")  # fmt: skip
    if layer:
        tot = {p: totals[p] if complete[p] else None for p in PROVIDERS}
        ratio = lambda a, b: "-" if a is None or b is None else f"{b / a:.2f}x"  # noqa: E731
        lines.append(f"| **sum over the {layers} layers** | {layers} | {_ms(tot['tritonbn'])} "
                     f"| {_ms(tot['torch_sync'])} | {_ms(tot['cudnn'])} | {ratio(tot['tritonbn'], tot['torch_sync'])} "
                     f"| {ratio(tot['tritonbn'], tot['cudnn'])} |")  # fmt: skip
    steps = [r for r in rows if r["table"] == "step"]
    if steps:
        size = "tiny ResNet-50 (width 4), batch 2, 32x32" if smoke else "batch 32"
        lines += ["", f"### ResNet-50 training step ({size}, channels_last, bf16 autocast, SGD)", "",
                  "| BatchNorm layers | eager ms | torch.compile ms |", "|---|---|---|"]  # fmt: skip
        by = {(r["variant"], r["mode"]): r.get("ms") for r in steps}
        for v in PROVIDERS:
            lines.append(f"| {v} | {_ms(by.get((v, 'eager')))} | {_ms(by.get((v, 'torch.compile')))} |")
        host = {r["variant"]: r["host_us"] for r in steps if r["mode"] == "eager" and "host_us" in r}
        if host:
            base = host.get("none")
            lines += ["", "### Host time of an eager step (CPU time of the Python thread, backward on it too)", "",
                      "| BatchNorm layers | host µs per step | host µs per BatchNorm layer (vs none, 53 layers) |",
                      "|---|---|---|"]  # fmt: skip
            for v in ("none", *PROVIDERS):
                per = "-" if v == "none" or v not in host or base is None else f"{(host[v] - base) / 53:.1f}"
                lines.append(f"| {v} | {_ms(host.get(v))} | {per} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, gloo: check that the code runs")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new cases after this")
    parser.add_argument("--skip-steps", action="store_true", help="only the per-layer table")
    parser.add_argument("--step-iters", type=int, default=20)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager training steps only")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (default: inductor)")
    args = parser.parse_args(argv)
    if args.compile_backend is None:
        args.compile_backend = "aot_eager" if args.smoke else "inductor"
    deadline = time.time() + args.budget_s
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        sys.exit("headline: no CUDA device (use --smoke on CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120))  # fmt: skip
    group = dist.group.WORLD
    import triton

    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tritonbn": tritonbn.__version__,
        "backend": backend,
        "smoke": args.smoke,
    }
    rec = Recorder(args.out, meta)
    timer = Timer(device, args.smoke)
    shapes = distinct_bn_shapes(2, 32) if args.smoke else distinct_bn_shapes(32, 224)
    if args.smoke:
        shapes = shapes[:2]
    try:
        per_layer(rec, timer, shapes, torch.bfloat16, device, group, deadline)
        if not args.skip_steps:
            step_times(rec, timer, args, device, group, deadline)
    finally:
        dist.destroy_process_group()
    failed = [r for r in rec.rows if "error" in r and not r["error"].startswith("skipped")]
    print(f"headline: {len(rec.rows)} rows, {len(failed)} failed -> {args.out}/headline.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
