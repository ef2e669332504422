"""The ``tritonbn`` command: ``tritonbn demo`` and ``tritonbn doctor CKPT [CKPT ...]``."""

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
        from tritonbn.demo import main as demo_main

        return demo_main(args.world, args.steps, args.cpu)
    from tritonbn.doctor import main as doctor_main

    return doctor_main(args.checkpoints, args.atol, args.rtol)


if __name__ == "__main__":
    sys.exit(main())
