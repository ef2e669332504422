"""The ``tritonbn`` command (also ``python -m tritonbn``): ``demo``, ``bench --model M`` and ``doctor CKPT ...``."""

from __future__ import annotations

import argparse
import sys

from tritonbn.diagnose import ATOL, RTOL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonbn", description="Synchronized BatchNorm as Triton kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="show BatchNorm statistics drifting under DDP, and tritonbn preventing it")
    demo.add_argument("--world", type=int, default=2, help="ranks to spawn (default 2; ignored under torchrun)")
    demo.add_argument("--steps", type=int, default=10, help="SGD steps per method (default 10)")
    demo.add_argument("--cpu", action="store_true", help="use CPU ranks over gloo even when GPUs are available")
    demo.add_argument("--plot", metavar="FILE.png", help="also draw the spreads per step (matplotlib)")
    bench = sub.add_parser(
        "bench",
        help="time tritonbn on the BatchNorm layers of your own model",
        description="Record every BatchNorm input of one forward of the model, then time each distinct one "
        "(training forward+backward and eval) for tritonbn and the other providers. CPU times say nothing about a GPU.",
    )
    bench.add_argument("--model", required=True, help="MODULE:CALLABLE returning an nn.Module, or: resnet50, demo")
    bench.add_argument("--input", help="input shape, such as 32,3,224,224 (default: the built-in model's)")
    bench.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="autocast (default bf16)")
    bench.add_argument("--channels-last", action="store_true", help="model and input in channels_last")
    bench.add_argument("--world", type=int, default=1, help="ranks, one per GPU (default 1; a real process group)")
    bench.add_argument("--out", default="bench-model", help="folder for bench_model.csv and .png (default bench-model)")
    bench.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is available")
    bench.add_argument("--warmup", type=int, default=None, help="untimed calls per case (default 5 on GPU, 3 on CPU)")
    bench.add_argument("--reps", type=int, default=None, help="timed calls per case (default 30 on GPU, 25 on CPU)")
    bench.add_argument("--budget-s", type=float, default=None, help="stop starting new cases after this many seconds")
    doctor = sub.add_parser(
        "doctor",
        help="compare BatchNorm statistics across per-rank checkpoints",
        description="Exit 0 when in sync, 1 when some BatchNorm layer diverges, 2 on an unreadable or "
        "incompatible checkpoint. A layer diverges when, for some channel, max - min across checkpoints "
        "of running_mean or running_var exceeds atol + rtol * max(|max|, |min|), or num_batches_tracked differs.",
    )
    doctor.add_argument("checkpoints", nargs="+", metavar="CKPT", help="state_dict or {'model': state_dict} files")
    doctor.add_argument("--atol", type=float, default=ATOL, help=f"absolute tolerance (default {ATOL})")
    doctor.add_argument("--rtol", type=float, default=RTOL, help=f"relative tolerance (default {RTOL})")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.world < 2:
            parser.error("--world must be at least 2")
        if args.plot is not None and not args.plot.lower().endswith(".png"):
            parser.error(f"--plot must name a .png file, got {args.plot!r}")
        from tritonbn.cli.demo import main as demo_main

        return demo_main(args.world, args.steps, args.cpu, plot=args.plot)
    if args.command == "bench":
        if args.world < 1:
            parser.error("--world must be at least 1")
        gpu = not args.cpu and _cuda_available()
        args.warmup = (5 if gpu else 3) if args.warmup is None else args.warmup
        args.reps = (30 if gpu else 25) if args.reps is None else args.reps
        if args.reps < 1 or args.warmup < 0:
            parser.error("--reps must be at least 1 and --warmup at least 0")
        from tritonbn.cli.bench import main as bench_main

        try:
            return bench_main(args)
        except ValueError as e:
            parser.error(str(e))
    from tritonbn.cli.doctor import main as doctor_main

    return doctor_main(args.checkpoints, args.atol, args.rtol)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
