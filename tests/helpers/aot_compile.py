"""Compile tritonbn's kernels for a GPU target without a GPU: no launch, just Triton's full pipeline to cubin.

This catches what the interpreter cannot: type and constexpr errors of compiled Triton, for every
specialization the launchers use. ``python tests/helpers/aot_compile.py`` compiles the whole matrix (dtypes,
int32/int64 offsets, training/eval, every activation and residual variant; a few minutes);
``--quick`` a representative subset (tests/kernels/test_aot_compile.py runs that). Run it with
TRITON_INTERPRET unset: under the interpreter the kernels are not compilable objects.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("aot_compile: unset TRITON_INTERPRET")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tritonbn.kernels import backward_elemt, backward_reduce, elemt, stats  # noqa: E402

SCALARS = ("momentum", "momentum_lo", "eps", "eps_lo", "slope")


def _compile(fn, pointers: dict, constexprs: dict, target, int64: bool) -> None:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*fp32")
        elif name in SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if int64 else "i32"
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a representative subset")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (default 90: H100/H200)")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    # --quick: bf16 with int32 and int64 offsets, fp64 with int32 (the kernel audit compiles the fp32 and
    # bf16 launches of the real module path; int64 offsets change the index arithmetic, not the dtypes)
    dtypes = ("*bf16", "*fp64") if args.quick else ("*fp32", "*bf16", "*fp16", "*fp64")
    activations = (0, 3) if args.quick else (0, 1, 2, 3)
    residuals = (True,) if args.quick else (False, True)
    auxes = (1,) if args.quick else (0, 1, 2)
    count = 0
    for dt, int64 in itertools.product(dtypes, (False, True)):
        if args.quick and int64 and dt != "*bf16":
            continue
        acc = tl.float64 if dt == "*fp64" else tl.float32
        acc_ptr = "*fp64" if dt == "*fp64" else "*fp32"
        pointers = {"x_ptr": dt, "y_ptr": dt, "r_ptr": dt, "stats_ptr": "*fp64", "nbt_ptr": "*i64",
                    "mean_ptr": "*fp64", "aux_ptr": dt, "dy_ptr": dt, "dx_ptr": dt, "dr_ptr": dt,
                    "count_ptr": "*fp64", "ticket_ptr": "*i32", "part_ptr": "*fp64", "sums_ptr": acc_ptr,
                    "invstd_ptr": acc_ptr,
                    # a module in the input's dtype (.to(dtype)); the kernel audit compiles fp32 ones
                    "w_ptr": dt, "b_ptr": dt, "rmean_ptr": dt, "rvar_ptr": dt, "gw_ptr": dt, "gb_ptr": dt}  # fmt: skip
        # A plane-by-plane plan, and a packed one (7x7 planes, 40 channels per program; see _plan).
        plans = [{"BLOCK_C": 32, "BLOCK_I": 64, "VEC": 4, "PLANE": 0, "PACK": 32},
                 {"BLOCK_C": 64, "BLOCK_I": 2048, "VEC": 8, "PLANE": 49, "PACK": 40}]  # fmt: skip
        for layout in plans:
            base = dict(layout, USE_INT64=int64, ACC=acc)
            count += _compile_plan(base, pointers, target, int64, activations, residuals, auxes)
    print(f"compiled {count} kernel specializations for sm_{args.arch} with triton {triton.__version__}")
    return 0


def _compile_plan(base, pointers, target, int64, activations, residuals, auxes) -> int:
    """Every kernel for one plan's constexprs; returns how many specializations were compiled."""
    count = 0
    _compile(stats._batch_norm_stats_kernel, pointers, dict(base, BLOCK_R=32, UNROLL=2), target, int64)
    count += 1
    if base["PLANE"]:  # a packed plan: one representative variant of each kernel
        activations, residuals, auxes = activations[-1:], residuals[-1:], auxes[-1:]
    for training, act, residual in itertools.product((True, False), activations, residuals):
        forward = dict(base, TRAINING=training, UPDATE_RUNNING=training, CUMULATIVE=training, HAS_NBT=training,
                       HAS_WEIGHT=True, HAS_BIAS=True, HAS_RESIDUAL=residual, ACTIVATION=act,
                       SAVE_STATS=training or residual)  # fmt: skip
        _compile(elemt._batch_norm_elemt_kernel, pointers, forward, target, int64)
        count += 1
        for aux in auxes:
            reduce = dict(base, HAS_WEIGHT=True, HAS_BIAS=True, ACTIVATION=act, AUX=aux)
            final = dict(reduce, HAS_GW=True, HAS_GB=True, BLOCK_R=32, UNROLL=2 if base["PLANE"] else 1)
            _compile(backward_reduce._batch_norm_backward_reduce_kernel, pointers, final, target, int64)
            grad = dict(reduce, TRAINING=training, WRITE_DX=True, WRITE_DR=residual)
            _compile(backward_elemt._batch_norm_backward_elemt_kernel, pointers, grad, target, int64)
            count += 2
    return count


if __name__ == "__main__":
    sys.exit(main())
