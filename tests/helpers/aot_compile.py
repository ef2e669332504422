"""Compile tritonbn's kernels for a GPU target without a GPU: no launch, just Triton's full pipeline to cubin.

This catches what the interpreter cannot: type and constexpr errors of compiled Triton, for every
specialization the launchers use. ``python tests/helpers/aot_compile.py`` compiles the whole matrix (dtypes,
int32/int64 offsets, training/eval, every activation and residual variant; a few minutes);
``--quick`` a representative subset (tests/kernels/test_aot_compile.py runs that). Run it with
TRITON_INTERPRET unset: under the interpreter the kernels are not compilable objects.

``--arch`` takes targets separated by commas: a CUDA compute capability (80 A100, 89 L40S, 90 H100/H200,
100 B200) or an AMD architecture (gfx90a MI250X, gfx942 MI300X); ``all`` is those six. ``--smoke`` compiles
each kernel once per plan (12 specializations), the form the tests use for the targets after the first.
A specialization that the matrix lists twice is compiled once (the count printed is of distinct ones).
Every compile passes the launches' own compile options (``tritonbn._compat.COMPILE_OPTIONS``: FMA fusion
on); ``--fma-check`` also compiles the forward kernel without fusion and fails unless the launch options
give it more fused multiply-adds (run it with TRITON_DEFAULT_FP_FUSION=0: the options must win);
``--fma-only`` runs that check alone. ``--dtypes`` compiles only those input dtypes of the matrix (CI's compile
sweep runs ``--quick`` in parts).
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

from tritonbn._compat import COMPILE_OPTIONS  # noqa: E402
from tritonbn.backends.triton import lockstep  # noqa: E402
from tritonbn.kernels import backward_elemt, backward_reduce, elemt, stats  # noqa: E402
from tritonbn.kernels._plan import _gathers  # noqa: E402

SCALARS = ("momentum", "momentum_lo", "eps", "eps_lo", "slope")
ALL = ("80", "89", "90", "100", "gfx90a", "gfx942")


def target_of(name: str) -> GPUTarget:
    """``"90"`` -> CUDA sm_90 (warps of 32), ``"gfx942"`` -> AMD gfx942 (wavefronts of 64)."""
    if name.startswith("gfx"):
        return GPUTarget("hip", name, 64)
    return GPUTarget("cuda", int(name.removeprefix("sm_")), 32)


def target_name(target: GPUTarget) -> str:
    return target.arch if target.backend == "hip" else f"sm_{target.arch}"


def fma_count(compiled) -> int:
    """Fused multiply-adds in the kernel's assembly (PTX ``fma.rn``; AMDGCN ``v_fma``/``v_fmac``/``v_pk_fma``)."""
    if "ptx" in compiled.asm:
        return compiled.asm["ptx"].count("fma.rn")
    return sum(compiled.asm["amdgcn"].count(op) for op in ("v_fma_", "v_fmac_", "v_pk_fma_"))


_DONE: set = set()  # the specializations this run compiled: a matrix's repeats are compiled once


def _compile(fn, pointers: dict, constexprs: dict, target, int64: bool, options=COMPILE_OPTIONS, again=False):
    """Compile one specialization: the compiled kernel, or None where this run already compiled it (unless
    ``again``)."""
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
    key = repr((fn.fn.__name__, sorted(signature.items()), sorted(constexprs.items(), key=str), target,
                sorted(options.items())))  # fmt: skip
    if key in _DONE and not again:
        return None
    _DONE.add(key)
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target, options=options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a representative subset")
    parser.add_argument("--smoke", action="store_true", help="each kernel once per plan")
    parser.add_argument("--arch", default="90", help="targets, e.g. 90 or 80,gfx942 or all (default 90: H100/H200)")
    parser.add_argument("--fma-check", action="store_true", help="check that the launch options fuse multiply-adds")
    parser.add_argument("--fma-only", action="store_true", help="the FMA check alone, no specializations")
    parser.add_argument("--dtypes", help="only these input dtypes of the matrix, e.g. bf16 or fp32,fp64")
    args = parser.parse_args(argv)
    names = ALL if args.arch == "all" else tuple(args.arch.split(","))
    for name in names:
        target = target_of(name)
        if args.fma_check or args.fma_only:
            fused, plain = fma_check(target)
            print(f"{target_name(target)}: forward kernel with the launch options {fused} FMAs, without fusion {plain}")
            if fused <= plain:
                print("aot_compile: the launch options did not turn FMA fusion on", file=sys.stderr)
                return 1
        if args.fma_only:
            continue
        count = compile_all(target, quick=args.quick, smoke=args.smoke, only=args.dtypes)
        print(f"compiled {count} kernel specializations for {target_name(target)} with triton {triton.__version__}")
    return 0


def _pointers(dt: str) -> dict:
    acc_ptr = "*fp64" if dt == "*fp64" else "*fp32"
    return {"x_ptr": dt, "y_ptr": dt, "r_ptr": dt, "stats_ptr": "*fp64", "nbt_ptr": "*i64",
            "mean_ptr": "*fp64", "aux_ptr": dt, "dy_ptr": dt, "dx_ptr": dt, "dr_ptr": dt,
            "count_ptr": "*fp64", "ticket_ptr": "*i32", "m_ptr": "*u8", "part_ptr": "*fp64", "sums_ptr": acc_ptr,
            "invstd_ptr": acc_ptr,
            # a module in the input's dtype (.to(dtype)); the kernel audit compiles fp32 ones
            "w_ptr": dt, "b_ptr": dt, "rmean_ptr": dt, "rvar_ptr": dt, "gw_ptr": dt, "gb_ptr": dt}  # fmt: skip


# A plane-by-plane plan, a packed one (7x7 planes, 40 channels per program; see _plan), and a masked one.
PLANS = [{"BLOCK_C": 32, "BLOCK_I": 64, "VEC": 4, "PLANE": 0, "PACK": 32, "HAS_MASK": False},
         {"BLOCK_C": 64, "BLOCK_I": 2048, "VEC": 8, "PLANE": 49, "PACK": 40, "HAS_MASK": False},
         {"BLOCK_C": 8, "BLOCK_I": 512, "VEC": 1, "PLANE": 0, "PACK": 8, "HAS_MASK": True}]  # fmt: skip


def fma_check(target) -> tuple[int, int]:
    """FMAs of the fp32 forward kernel compiled with the launch options, and with fusion off."""
    flags = ("TRAINING", "UPDATE_RUNNING", "CUMULATIVE", "HAS_NBT", "HAS_WEIGHT", "HAS_BIAS", "SAVE_STATS")
    forward = dict(
        PLANS[0], USE_INT64=False, ACC=tl.float32, HAS_RESIDUAL=False, ACTIVATION=0, **dict.fromkeys(flags, True)
    )
    counts = []
    for options in (COMPILE_OPTIONS, dict(COMPILE_OPTIONS, enable_fp_fusion=False)):
        compiled = _compile(elemt._batch_norm_elemt_kernel, _pointers("*fp32"), forward, target, False, options, True)
        counts.append(fma_count(compiled))
    return counts[0], counts[1]


def compile_all(target, quick: bool, smoke: bool, only: str | None = None) -> int:
    # --quick: bf16 with int32 and int64 offsets, fp64 with int32 (the kernel audit compiles the fp32 and
    # bf16 launches of the real module path; int64 offsets change the index arithmetic, not the dtypes)
    dtypes = ("*bf16", "*fp64") if quick else ("*fp32", "*bf16", "*fp16", "*fp64")
    activations = (0, 3) if quick else (0, 1, 2, 3)
    residuals = (True,) if quick else (False, True)
    auxes = (1,) if quick else (0, 1, 2)
    if smoke:
        dtypes, activations, residuals, auxes = ("*bf16",), (3,), (True,), (1,)
    if only is not None:  # a part of the matrix (CI's sweep runs the parts side by side)
        wanted = {"*" + name for name in only.split(",")}
        if not wanted <= set(dtypes):
            sys.exit(f"aot_compile: --dtypes {only} is not a part of this matrix's {', '.join(dtypes)}")
        dtypes = tuple(dt for dt in dtypes if dt in wanted)
    count = 0
    for dt, int64 in itertools.product(dtypes, (False, True)):
        if (quick or smoke) and int64 and (dt != "*bf16" or smoke):
            continue
        acc = tl.float64 if dt == "*fp64" else tl.float32
        for layout in PLANS:
            base = dict(layout, USE_INT64=int64, ACC=acc)
            trainings = (True,) if smoke else (True, False)
            count += _compile_plan(base, _pointers(dt), target, int64, activations, residuals, auxes, trainings)
    # the device side of the out-of-step check (tritonbn/lockstep.py): one specialization, whatever the dtypes
    message = {"message_ptr": "*fp64", "flag_ptr": "*i64"}
    count += _new(_compile(lockstep._check_message_kernel, message, {"BLOCK": 1024}, target, False))
    return count


def _new(compiled) -> int:
    return compiled is not None


def _compile_plan(base, pointers, target, int64, activations, residuals, auxes, trainings=(True, False)) -> int:
    """Every kernel for one plan's constexprs; returns how many specializations were compiled."""
    count = 0
    arch = target.arch if target.backend == "cuda" else 0  # a packed plan gathers its lanes' sums as the target's does
    gather = bool(base["PLANE"]) and _gathers(("cuda", 0, target.warp_size, arch))
    unroll = 1 if base["HAS_MASK"] else 2  # as the launcher: one tile a step for a masked layer
    count += _new(_compile(stats._batch_norm_stats_kernel, pointers,
                           dict(base, BLOCK_R=32, UNROLL=unroll, GATHER=gather), target, int64))  # fmt: skip
    if base["PLANE"] or base["HAS_MASK"]:  # a packed or masked plan: one representative variant of each kernel
        activations, residuals, auxes = activations[-1:], residuals[-1:], auxes[-1:]
    for training, act, residual in itertools.product(trainings, activations, residuals):
        forward = dict(base, TRAINING=training, UPDATE_RUNNING=training, CUMULATIVE=training, HAS_NBT=training,
                       HAS_WEIGHT=True, HAS_BIAS=True, HAS_RESIDUAL=residual, ACTIVATION=act,
                       SAVE_STATS=training or residual)  # fmt: skip
        count += _new(_compile(elemt._batch_norm_elemt_kernel, pointers, forward, target, int64))
        for aux in auxes:
            reduce = dict(base, HAS_WEIGHT=True, HAS_BIAS=True, ACTIVATION=act, AUX=aux)
            final = dict(reduce, HAS_GW=True, HAS_GB=True, BLOCK_R=32, UNROLL=2 if base["PLANE"] else 1)
            count += _new(_compile(backward_reduce._batch_norm_backward_reduce_kernel, pointers, final, target, int64))
            grad = dict(reduce, TRAINING=training, WRITE_DX=True, WRITE_DR=residual)
            count += _new(_compile(backward_elemt._batch_norm_backward_elemt_kernel, pointers, grad, target, int64))
    return count


if __name__ == "__main__":
    sys.exit(main())
