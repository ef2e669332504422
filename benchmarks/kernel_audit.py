"""Kernel audit: the sm_90 code of every kernel launch tritonbn makes for ResNet-50, read without a GPU.

``--arch`` audits another target instead: 80 (A100), 89 (L40S), 100 (B200), read as below, or gfx90a (MI250X),
gfx942 (MI300X), whose AMDGCN assembly is read by ``benchmarks/_amdgcn.py`` (VGPRs, spills, occupancy, the
main loop's widest loads and stores; no round trips). Launches are planned as on that GPU: its SM or CU
count (:data:`SMS`, or ``--sm-count``) and its warp size (wavefronts of 64 on AMD).

    python benchmarks/kernel_audit.py --out DIR [--quick] [--results benchmarks/RESULTS.md]
    python benchmarks/kernel_audit.py --out DIR --model          # also the time model: DIR/model.json
    python benchmarks/kernel_audit.py --self-check     # the round-trip counter on two toy kernels

**Launches.** ``tritonbn.SyncBatchNorm`` runs its real module path on CPU tensors of each shape
(training forward, its backward, eval forward) inside ``planned_as("cuda", 132)``, so every launch
is planned as on an H100/H200. ``JITFunction.run`` is replaced by a recorder: it binds the arguments
with Triton's own generated binder for a CUDA sm_90 backend (``create_function_from_signature``, the
code a real launch runs), so pointer and integer alignment (divisibility by 16) and integers equal to
1 are specialized exactly as a launch would, and records kernel, grid, signature, constexprs,
attributes and options. Nothing is launched. Kernels are found from the launches, not listed here.
A launch's first call compiles its kernel unlaunched (``JITFunction.warmup``) to fit its grid to the
kernel's occupancy (see ``tritonbn.kernels._launch``): the recorder answers it with the registers and
shared memory of the sm_90 compilation, so the grids recorded are the fitted ones a GPU would run.

**Compile.** ``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
options=...)`` with the launch's own options (num_warps and the rest), once per distinct
specialization, in a fresh Triton cache so that Triton's own ptxas run and its log (registers,
stack, spills) are what is read. ``--cache-dir DIR`` shares a Triton cache instead (the tests' one, so
that each specialization is compiled once per test run): ptxas's log is kept beside each cubin
(``tritonbn_ptxas.log`` in the kernel's cache entry), written on a miss and read on a hit; an entry
without it (compiled by something else) is compiled again in a fresh cache. The cubin is disassembled with
the bundled ``nvdisasm``.

**Per row** (one per launch of each pass): registers, spill bytes (ptxas's spill stores + loads),
stack, shared memory, ``max_warps_per_sm`` (the target's per-SM limits, ``tritonbn.kernels._launch.SM_LIMITS``:
sm_90: 64K registers, 2048 threads, 228 KB shared memory with 1 KB reserved per block, 32 blocks per SM,
registers allocated per warp in units of 256; sm_80: 164 KB; sm_89: 1536 threads, 100 KB, 24 blocks),
``maxnreg`` (the register ceiling a spilling kernel was compiled again with, see ``Launch._compile``),
and for the **main loop**:

* the main loop: among the innermost SASS loops (a backward branch to its target), the one whose
  instructions come from a ``for`` loop at the top level of the kernel's body (line info), with the
  most global loads; without line info, the innermost loop with the most global loads;
* ``load_vector_bits`` / ``store_vector_bits``: the widest global load / store in it (``LDG.E.128``
  is 128, ``LDG.E.64`` 64, ``LDG.E`` 32, ``LDG.E.U16`` 16);
* ``round_trips_per_iteration``: dependent global-load chains, read from the scoreboards. Each
  Volta+ instruction carries control bits in the top of its 128-bit encoding (bits 105-108 stall,
  109 yield, 110-112 write scoreboard, 113-115 read scoreboard, 116-121 wait mask, 122-125 reuse).
  A global load sets a write scoreboard; an instruction that waits on a scoreboard set by a global
  load issued earlier in the same iteration, followed later in the iteration by another global
  load, ends a round trip (consecutive waits before that next load end one). Round trips = 1 + the
  number of such ends (0 without loads);
* ``sass_per_element``: instructions in the loop body / elements per thread per iteration, the
  tile (``BLOCK_C * BLOCK_I``; ``BLOCK_I`` for a packed plan, ``PLANE > 0``, whose tile is one row;
  else the product of the ``BLOCK_*`` constexprs), times ``UNROLL`` (tiles a step) where the kernel
  takes it, over num_warps * 32.

and, for the kernels that merge per-program partials after their main loop (statistics, backward
reduction), **the merge tail**: ``tail_bytes``, ``tail_rows``, ``tail_iterations`` and ``tail_levels``
of the longest serial chain of merges after the main loops end (from the launch's ``R``, ``G`` and
``BLOCK_R``, see :func:`tail_metrics`), and ``tail_round_trips``: the round trips per iteration, counted
as above, of the SASS loops whose line info falls on the ``merge_tree`` call (``merge_loops`` of them).

**Model** (``--model``): a time model of each launch and of a ResNet-50 training step's BatchNorms,
written to ``DIR/model.json`` and printed with its assumptions (:data:`ASSUMPTIONS`, each with its
source); see :func:`model_launch`. ``--case``, ``--sm-count`` and ``--flat-merge`` audit one case, plan
for another SM count, and make the merge one-level (to show that the tail rule catches it);
``--dtype`` and ``--layout`` keep some of the dtypes and layouts (a part of the audit).

``--serve`` runs jobs in one process (one interpreter start for many audits): each line read from stdin is
one job's arguments, as on the command line; after each, the line ``kernel_audit-done RC`` (its exit
status) is printed. An empty line or the end of input ends it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import datetime
import inspect
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import types
import warnings

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("kernel_audit: unset TRITON_INTERPRET: the audit compiles the kernels")
# A fresh Triton cache: every specialization is compiled here, so ptxas's own log is read.
_CACHE = tempfile.TemporaryDirectory(prefix="tritonbn-audit-")
os.environ["TRITON_CACHE_DIR"] = _CACHE.name

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_file import write_section  # noqa: E402

from tritonbn.cli.resnet50 import distinct_bn_shapes  # noqa: E402
from tritonbn.kernels._launch import resident_limits, sm_limits  # noqa: E402

MODES = ("train_forward", "backward", "eval_forward")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ("contiguous", "channels_last")
QUICK_SHAPES = [(32, 256, 14, 14), (32, 2048, 7, 7)]  # 14^2 and 7^2: the NCHW alignment cases
MASKED_SHAPES = [(32, 256, 499)]  # --masked adds a padded batch of sequences (Conformer's convolution module)
MAX_REGISTERS = 128
SM_COUNT = 132  # launches are planned as on a GPU with this many SMs (--sm-count)
WARP_SIZE = 32  # and this warp size (64: AMD)
MASKED = False  # audit masked BatchNorm's launches (--masked)
# SMs (CUs) of the GPU each target is planned as (vendors' specifications): A100 SXM, L40S, H100/H200 SXM,
# B200, MI250X (one of its two dies), MI300X.
SMS = {"80": 108, "89": 142, "90": 132, "100": 148, "gfx90a": 110, "gfx942": 304}
MERGE_FN = "merge_tree"  # tritonbn.kernels._common: the merge of the per-program partials after the main loop
GLOBAL_LOADS = ("LDG", "LD", "LDGSTS", "UTMALDG")
GLOBAL_STORES = ("STG", "ST")


def _tool(name: str) -> str:
    """Path of a CUDA binary bundled with triton (``nvdisasm``)."""
    return getattr(knobs.nvidia, name).path


def tools_missing() -> str | None:
    """Why the audit cannot run here, or None."""
    try:
        path = _tool("nvdisasm")
    except Exception as e:  # noqa: BLE001 - any failure to locate it
        return f"nvdisasm not found ({e})"
    if not path or not os.path.exists(path):
        return f"nvdisasm not found at {path!r}"
    return None


# ----------------------------------------------------------------------------------------------
# Launch capture
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    fn: JITFunction
    grid: tuple[int, ...]
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    scalars: dict = dataclasses.field(default_factory=dict)  # the integer arguments, by name (R, G, C, ...)

    @property
    def name(self) -> str:
        return self.fn.fn.__name__

    def named_constexprs(self) -> dict:
        names = self.fn.arg_names
        return {names[path[0]]: value for path, value in self.constexprs.items() if len(path) == 1}

    def key(self) -> str:
        attrs = sorted((k, repr(v)) for k, v in self.attrs.items())
        options = sorted((k, repr(v)) for k, v in self.options.items())
        return repr((self.fn.fn.__module__, self.name, sorted(self.signature.items()), sorted(self.constexprs.items()),
                     attrs, options))  # fmt: skip


@contextlib.contextmanager
def captured_launches(target: GPUTarget, compiled: dict):
    """Record every Triton launch instead of running it, specialized for ``target`` as a launch would be.

    A warmup (an unlaunched compile) is compiled for ``target`` (kept in ``compiled``, by launch key) and
    answered with its registers and shared memory, which is what tritonbn reads of a compiled kernel."""
    backend = make_backend(target)
    binders: dict[int, object] = {}
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        for option in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # what run() adds in Triton 3.9
            if hasattr(knobs.compilation, option):
                kwargs[option] = getattr(knobs.compilation, option)
        binder = binders.get(id(self))
        if binder is None:
            binder = binders[id(self)] = create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        if callable(grid):
            grid = grid(bound_args)
        scalars = {k: v for k, v in bound_args.items() if isinstance(v, int) and not isinstance(v, bool)}
        launch = Launch(
            self, tuple(int(g) for g in grid), signature, constexprs, attrs, dict(options.__dict__), scalars
        )
        if warmup:
            row = read_compiled(launch, target, compiled)
            return types.SimpleNamespace(  # n_spills: the local memory a thread takes, as the driver reports it
                n_regs=row["registers"],
                n_spills=row["stack_bytes"],
                metadata=types.SimpleNamespace(shared=row["shared_bytes"]),
            )
        launches.append(launch)
        return None

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


@contextlib.contextmanager
def triton_backend_on_cpu():
    """Make tritonbn choose its Triton kernels for CPU tensors (they are recorded, never run)."""
    from tritonbn import backend

    original = backend._triton_unusable
    backend._triton_unusable = lambda x: None if backend._load_kernels() is not None else backend._kernels_error
    try:
        yield
    finally:
        backend._triton_unusable = original


def module_passes(shape, dtype: torch.dtype, layout: str, target: GPUTarget, compiled: dict):
    """``{mode: [Launch]}`` of one ``tritonbn.SyncBatchNorm`` layer: training forward, backward, eval forward.

    With ``MASKED`` (``--masked``) the layer is called with a padding mask (masked BatchNorm)."""
    import tritonbn
    from tritonbn.kernels._plan import planned_as

    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    out = {}
    with (
        triton_backend_on_cpu(),
        planned_as("cuda", SM_COUNT, WARP_SIZE, target.arch if target.backend == "cuda" else 0),
        captured_launches(target, compiled) as launches,
    ):
        bn = tritonbn.SyncBatchNorm(shape[1])  # fp32 parameters, as under autocast
        if len(shape) == 3 and layout == "channels_last":  # (N, L, C) in memory, as sequence models hold it
            x = torch.empty((shape[0], shape[2], shape[1]), dtype=dtype).transpose(1, 2).requires_grad_()
        else:
            x = torch.empty(shape, dtype=dtype, memory_format=memory_format).requires_grad_()
        mask = torch.ones((shape[0], *shape[2:]), dtype=torch.bool) if MASKED else None
        y = bn(x, mask=mask)
        out["train_forward"], launches[:] = list(launches), []
        y.backward(torch.empty_like(y))
        out["backward"], launches[:] = list(launches), []
        bn.eval()
        with torch.no_grad():
            bn(x, mask=mask)
        out["eval_forward"], launches[:] = list(launches), []
    return out


# ----------------------------------------------------------------------------------------------
# Compile and read the SASS
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Insn:
    addr: int
    text: str  # without the predicate
    opcode: str  # e.g. LDG.E.128
    lo: int
    hi: int
    line: int | None  # line in the kernel's own source file (outermost inlined-at location)
    target: str | None = None  # branch target label

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def write_sb(self) -> int:
        return (self.hi >> 46) & 7  # 7: none

    @property
    def wait_mask(self) -> int:
        return (self.hi >> 52) & 0x3F

    def waits(self) -> set[int]:
        out = {b for b in range(6) if self.wait_mask >> b & 1}
        m = re.match(r"DEPBAR(?:\.LE)?\s+SB(\d)", self.text)
        if m:
            out.add(int(m.group(1)))
        return out

    def is_load(self) -> bool:
        return self.base in GLOBAL_LOADS

    def is_store(self) -> bool:
        return self.base in GLOBAL_STORES

    def width_bits(self) -> int:
        mods = self.opcode.split(".")[1:]
        for bits in ("128", "64"):
            if bits in mods:
                return int(bits)
        if "U16" in mods or "S16" in mods:
            return 16
        if "U8" in mods or "S8" in mods:
            return 8
        return 32


_LINE = re.compile(r'"([^"]+)", line (\d+)')
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*0x([0-9a-f]{16})\s*\*/")
_HI = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def disassemble(cubin: bytes, source_file: str | None = None) -> tuple[list[Insn], dict[str, int]]:
    """Instructions with encodings and kernel-source lines, and the address of each label."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.run(
            [_tool("nvdisasm"), "-c", "-gi", "-hex", "-ndf", path], check=True, capture_output=True, text=True
        ).stdout
    finally:
        os.unlink(path)
    insns: list[Insn] = []
    labels: dict[str, int] = {}
    pending_labels: list[str] = []
    line = None
    source = None if source_file is None else os.path.realpath(source_file)
    in_source: dict[str, bool] = {}  # each file named by the line table, resolved once (not once a line)
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        raw = lines[i]
        i += 1
        if raw.lstrip().startswith("//##"):
            locs = _LINE.findall(raw)
            line = None
            if locs and source is not None:
                f, n = locs[-1]  # the outermost inlined-at location is in the kernel's own body
                if f not in in_source:
                    in_source[f] = os.path.realpath(f) == source
                line = int(n) if in_source[f] else None
            continue
        m = _LABEL.match(raw.strip())
        if m:
            pending_labels.append(m.group(1))
            continue
        m = _INSN.search(raw)
        if not m:
            continue
        hi_m = _HI.match(lines[i]) if i < len(lines) else None
        if not hi_m:
            raise ValueError(f"kernel_audit: no second encoding word after {raw!r}")
        i += 1
        addr = int(m.group(1), 16)
        body = re.sub(r"^@!?U?P[T\d]+\s+", "", m.group(2).strip())
        opcode = body.split()[0] if body else ""
        target = None
        t = re.search(r"`\((\.L_x_\d+)\)", body)
        if t:
            target = t.group(1)
        for lab in pending_labels:
            labels[lab] = addr
        pending_labels = []
        insns.append(Insn(addr, body, opcode, int(m.group(3), 16), int(hi_m.group(1), 16), line, target))
    return insns, labels


def sass_loops(insns: list[Insn], labels: dict[str, int]) -> list[tuple[int, int]]:
    """``(first, last)`` instruction indices of each loop: a branch back to an earlier address."""
    index = {ins.addr: k for k, ins in enumerate(insns)}
    loops = []
    for k, ins in enumerate(insns):
        if ins.base in ("BRA", "JMP") and ins.target in labels:
            dest = labels[ins.target]
            if dest < ins.addr and dest in index:  # a branch to itself is the trap after EXIT
                loops.append((index[dest], k))
    return loops


def kernel_body(fn: JITFunction):
    """The kernel's ``ast.FunctionDef`` and the file line its source starts on, or None without source."""
    try:
        src_lines, start = inspect.getsourcelines(fn.fn)
    except (OSError, TypeError):
        return None
    tree = ast.parse(textwrap.dedent("".join(src_lines)))
    func = next((n for n in tree.body if isinstance(n, ast.FunctionDef)), None)
    return None if func is None else (func, start)


def top_level_for_lines(fn: JITFunction) -> list[range]:
    """Source line ranges of the ``for`` loops directly in the kernel's body (not nested in an ``if``)."""
    body = kernel_body(fn)
    if body is None:
        return []
    func, start = body
    return [
        range(start + node.lineno - 1, start + node.end_lineno)
        for node in func.body
        if isinstance(node, (ast.For, ast.While))
    ]


def main_loop(insns: list[Insn], loops: list[tuple[int, int]], fn: JITFunction | None) -> tuple[int, int] | None:
    innermost = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    if not innermost:
        return None

    def loads(lp):
        return sum(insns[k].is_load() for k in range(lp[0], lp[1] + 1))

    candidates = innermost
    spans = top_level_for_lines(fn) if fn is not None else []
    if spans:

        def in_top_level_for(lp):
            lines = [insns[k].line for k in range(lp[0], lp[1] + 1) if insns[k].line is not None]
            inside = sum(any(n in s for s in spans) for n in lines)
            return lines and inside * 2 > len(lines)

        candidates = [lp for lp in innermost if in_top_level_for(lp)] or innermost
    return max(candidates, key=lambda lp: (loads(lp), lp[1] - lp[0]))


def merge_call_lines(fn: JITFunction) -> list[range]:
    """Source line ranges of the kernel-body statements that call ``merge_tree`` (the merge after the main loop)."""
    body = kernel_body(fn)
    if body is None:
        return []
    func, start = body
    out = []
    for node in func.body:
        calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
        if any(c.func.id == MERGE_FN for c in calls):
            out.append(range(start + node.lineno - 1, start + node.end_lineno))
    return out


def merge_loops(insns: list[Insn], loops: list[tuple[int, int]], fn: JITFunction | None) -> list[tuple[int, int]]:
    """The SASS loops of the merge after the main loops: loops with global loads whose line info (the
    outermost inlined-at line in the kernel's body) falls mostly on the ``merge_tree`` call."""
    spans = merge_call_lines(fn) if fn is not None else []
    if not spans:
        return []
    out = []
    for lp in loops:
        body = insns[lp[0] : lp[1] + 1]
        lines = [ins.line for ins in body if ins.line is not None]
        inside = sum(any(n in sp for sp in spans) for n in lines)
        if lines and inside * 2 > len(lines) and any(ins.is_load() for ins in body):
            out.append(lp)
    return out


def round_trips(body: list[Insn]) -> int:
    """Dependent global-load chains in one pass over a loop body (see the module docstring)."""
    pending: set[int] = set()
    trips = 0
    waited = False
    for ins in body:
        hit = ins.waits() & pending
        if hit:
            waited = True
            pending -= hit
        if ins.is_load():
            if trips == 0:
                trips = 1
            elif waited:
                trips += 1
            waited = False
            if ins.write_sb != 7:
                pending.add(ins.write_sb)
    return trips


def loop_metrics(insns: list[Insn], loop: tuple[int, int] | None, elements_per_thread: float) -> dict:
    if loop is None:
        return {"main_loop": None, "loop_instructions": None, "loop_global_loads": None, "loop_global_stores": None,
                "load_vector_bits": None, "store_vector_bits": None, "round_trips_per_iteration": None,
                "sass_per_element": None}  # fmt: skip
    body = [ins for ins in insns[loop[0] : loop[1] + 1] if ins.base != "NOP"]
    loads = [ins for ins in body if ins.is_load()]
    stores = [ins for ins in body if ins.is_store()]
    return {
        "main_loop": f"{insns[loop[0]].addr:#06x}-{insns[loop[1]].addr:#06x}",
        "loop_instructions": len(body),
        "loop_global_loads": len(loads),
        "loop_global_stores": len(stores),
        "load_vector_bits": max((ins.width_bits() for ins in loads), default=None),
        "store_vector_bits": max((ins.width_bits() for ins in stores), default=None),
        "round_trips_per_iteration": round_trips(body),
        "sass_per_element": round(len(body) / elements_per_thread, 2) if elements_per_thread else None,
    }


def max_warps_per_sm(registers: int, num_warps: int, shared: int, arch: int = 90) -> tuple[int, str]:
    """Resident warps per SM on compute capability ``arch`` and what limits them (the per-SM limits tritonbn fits
    its grids to, ``tritonbn.kernels._launch.SM_LIMITS``)."""
    limits = resident_limits(registers, num_warps, shared, sm_limits(arch))
    limiter = min(limits, key=limits.get)
    return limits[limiter] * num_warps, limiter


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def tile_elements(constexprs: dict) -> int:
    """Elements one step of the main loop covers: its tile, times ``UNROLL`` tiles a step where given."""
    unroll = int(constexprs.get("UNROLL", 1) or 1)
    if int(constexprs.get("PLANE", 0) or 0) > 0:  # a packed plan: one row of BLOCK_I lanes
        return int(constexprs["BLOCK_I"]) * unroll
    if "BLOCK_C" in constexprs and "BLOCK_I" in constexprs:
        return int(constexprs["BLOCK_C"]) * int(constexprs["BLOCK_I"]) * unroll
    blocks = [int(v) for k, v in constexprs.items() if k.startswith("BLOCK")]
    return math.prod(blocks) if blocks else 1


def read_compiled(launch: Launch, target: GPUTarget, cache: dict) -> dict:
    """:func:`compile_and_read` of ``launch``'s specialization, once per distinct one (``cache``, by key)."""
    key = launch.key()
    if key not in cache:
        cache[key] = compile_and_read(launch.fn, launch.signature, launch.constexprs, launch.attrs, launch.options,
                                      target)  # fmt: skip
    return cache[key]


PTXAS_LOG = "tritonbn_ptxas.log"  # ptxas's log of a kernel, kept in its Triton cache entry (--cache-dir)


def _compile_logged(src, target, options):
    """``triton.compile`` with ptxas's log captured: the kernel and the log ("" when it came from the cache)."""
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kernel = triton.compile(src, target=target, options=options)
    finally:
        knobs.nvidia.dump_ptxas_log = False
    return kernel, log.getvalue()


def _compile_with_ptxas_log(src, target, options):
    """The compiled kernel and ptxas's log of it. A cache miss writes the log beside the cubin; a hit reads
    it from there, or, where the entry has none (something else compiled it), compiles again in a fresh cache."""
    from triton.runtime.cache import get_cache_manager

    kernel, text = _compile_logged(src, target, options)
    entry = get_cache_manager(kernel.hash)
    if _PTXAS["registers"].search(text):
        entry.put(text, PTXAS_LOG, binary=False)
        return kernel, text
    path = entry.get_file(PTXAS_LOG)
    if path is not None:
        with open(path) as f:
            return kernel, f.read()
    shared = knobs.cache.dir
    with tempfile.TemporaryDirectory(prefix="tritonbn-audit-") as fresh:
        knobs.cache.dir = fresh
        try:
            kernel, text = _compile_logged(src, target, options)
        finally:
            knobs.cache.dir = shared
    if _PTXAS["registers"].search(text):
        entry.put(text, PTXAS_LOG, binary=False)
    return kernel, text


def compile_and_read(fn: JITFunction, signature, constexprs, attrs, options, target) -> dict:
    """Compile one specialization for ``target`` and read registers, spills, shared memory and the main loop."""
    if target.backend == "hip":
        import _amdgcn

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)
        named = {fn.arg_names[p[0]]: v for p, v in constexprs.items() if len(p) == 1}
        num_warps = int(options["num_warps"])
        return _amdgcn.read(kernel, num_warps, tile_elements(named) / (num_warps * target.warp_size))
    kernel, text = _compile_with_ptxas_log(ASTSource(fn, signature, constexprs, attrs), target, options)
    ptxas = {k: int(m.group(1)) if (m := r.search(text)) else None for k, r in _PTXAS.items()}
    if ptxas["registers"] is None:
        raise RuntimeError(f"kernel_audit: no ptxas log for {fn.fn.__name__} (was it compiled from a cache?)")
    source_file = inspect.getsourcefile(fn.fn)
    insns, labels = disassemble(kernel.asm["cubin"], source_file)
    names = fn.arg_names
    named = {names[p[0]]: v for p, v in constexprs.items() if len(p) == 1}
    num_warps = int(options["num_warps"])
    per_thread = tile_elements(named) / (num_warps * 32)
    shared = int(kernel.metadata.shared)
    warps, limiter = max_warps_per_sm(ptxas["registers"], num_warps, shared, target.arch)
    spill_stores, spill_loads = ptxas["spill_stores"] or 0, ptxas["spill_loads"] or 0
    loops = sass_loops(insns, labels)
    merges = merge_loops(insns, loops, fn)
    return {
        "merge_loops": len(merges),
        "tail_round_trips": max(
            (round_trips([i for i in insns[a : b + 1] if i.base != "NOP"]) for a, b in merges), default=None
        ),  # fmt: skip
        "registers": ptxas["registers"],
        "spill_bytes": spill_stores + spill_loads,
        "spill_store_bytes": spill_stores,
        "spill_load_bytes": spill_loads,
        "stack_bytes": ptxas["stack"] or 0,
        "shared_bytes": shared,
        "max_warps_per_sm": warps,
        "occupancy_limit": limiter,
        "elements_per_thread": per_thread,
        **loop_metrics(insns, main_loop(insns, loops, fn), per_thread),
    }


# ----------------------------------------------------------------------------------------------
# The audit
# ----------------------------------------------------------------------------------------------


def audit(shapes, dtypes, layouts, target, log=print) -> tuple[list[dict], int]:
    """Rows for every launch of every pass, and the number of distinct compilations."""
    cache: dict[str, dict] = {}
    rows = []
    for shape in shapes:
        for dtype_name in dtypes:
            for layout in layouts:
                passes = module_passes(shape, DTYPES[dtype_name], layout, target, cache)
                for mode in MODES:
                    launches = passes[mode]
                    for k, launch in enumerate(launches):
                        compiled = read_compiled(launch, target, cache)
                        named = launch.named_constexprs()
                        rows.append({
                            "kernel": launch.name,
                            "shape": "x".join(map(str, shape)),
                            "dtype": dtype_name,
                            "layout": layout,
                            "mode": mode,
                            "launch": f"{k + 1}/{len(launches)}",
                            "grid": list(launch.grid),
                            "num_warps": int(launch.options["num_warps"]),
                            "blocks": {n: int(v) for n, v in named.items() if n.startswith("BLOCK")},
                            "maxnreg": launch.options.get("maxnreg"),  # the ceiling a spilling kernel got
                            "constexprs": {n: _plain(v) for n, v in named.items() if not n.startswith("BLOCK")},
                            **compiled,
                            **tail_metrics(launch),
                        })  # fmt: skip
                n = sum(len(v) for v in passes.values())
                log(f"  {'x'.join(map(str, shape))} {dtype_name} {layout}: {n} launches, {len(cache)} compilations")
    return rows, len(cache)


def tail_metrics(launch: Launch) -> dict:
    """The serial merge after the main loops of a reducing launch (one that takes ``R`` and ``G``).

    The longest serial chain is the one of the program that finishes its main loop last: it merges its
    group (at most ``G`` rows of partials), and, when there are several groups, the ``NG = ceil(R / G)``
    level-2 rows (see ``tritonbn.kernels._common.merge_tree``). A row holds two fp64 values for each of
    the block's channels (``min(PACK, C)``). ``tail_iterations`` counts the ``[BLOCK_R, BLOCK_C]`` steps
    of that chain; ``tail_levels`` the ticket-then-merge steps (each an atomic and a dependent load).
    """
    sc, named = launch.scalars, launch.named_constexprs()
    if "R" not in sc or "G" not in sc:
        return {"tail_bytes": None, "tail_rows": None, "tail_iterations": None, "tail_levels": None}
    R, G, C = sc["R"], sc["G"], sc["C"]
    channels = min(int(named.get("PACK", C)), C)
    block_r = int(named["BLOCK_R"])
    groups = -(-R // G)
    chain = [min(G, R)] + ([groups] if groups > 1 else [])
    rows = sum(chain)
    return {
        "tail_bytes": 2 * rows * channels * 8,
        "tail_rows": rows,
        "tail_iterations": sum(-(-n // block_r) for n in chain),
        "tail_levels": len(chain),
    }


def _plain(v):
    """A constexpr as JSON can hold it (a Triton dtype such as ACC becomes its name)."""
    return v if isinstance(v, int | float | bool | str) else str(v)


def _kb(rows: list[dict]) -> str:
    tails = [r["tail_bytes"] for r in rows if r["tail_bytes"] is not None]
    return f"{max(tails) / 1024:.1f}" if tails else "-"


def _fmt(v, spec="") -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict], meta: dict, every_launch: bool = True) -> str:
    """The audit as markdown: the summary, then (``every_launch``) a row per launch. The RESULTS.md section
    leaves the launches out (DIR/kernel_audit.md has them) to keep that file short."""
    head = (
        "| mode | launch | kernel | layout | dtype | shape | grid | warps | tile | regs | spill B | warps/SM "
        "| ld bits | st bits | round trips | SASS/elem | tail KB | tail iters | tail trips |"
    )
    lines = [
        f"## Kernel audit ({meta['target']}, compiled without a GPU"
        f"{', masked BatchNorm' if meta.get('masked') else ''})",
        "",
        f"Generated {meta['date']} by `python benchmarks/kernel_audit.py{' --quick' if meta['quick'] else ''}"
        f"{' --masked' if meta.get('masked') else ''}`, "
        f"triton {meta['triton']}, torch {meta['torch']}, target {meta['target']}; "
        f"{meta['rows']} launches, {meta['compilations']} distinct compilations. Launches come from the module "
        f"path planned as on a {meta.get('sm_count', 132)}-SM GPU; the main-loop columns read the SASS "
        "(AMDGCN on AMD; see the script's docstring). "
        "`-`: the kernel has no loop.",
        "",
        *summary(rows),
        "",
    ]
    if not every_launch:
        return "\n".join([*lines, "Every launch: `DIR/kernel_audit.md` and `DIR/kernel_audit.json` of the run.", ""])
    lines += [
        "<details><summary>Every launch</summary>",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    order = {m: k for k, m in enumerate(MODES)}
    for r in sorted(rows, key=lambda r: (order[r["mode"]], r["launch"], r["layout"], r["dtype"], r["shape"])):
        tile = "x".join(str(v) for v in r["blocks"].values())
        lines.append(
            f"| {r['mode']} | {r['launch']} | {r['kernel']} | {r['layout']} | {r['dtype']} | {r['shape']} "
            f"| {'x'.join(map(str, r['grid']))} | {r['num_warps']} | {tile} | {r['registers']} | {r['spill_bytes']} "
            f"| {r['max_warps_per_sm']} | {_fmt(r['load_vector_bits'])} | {_fmt(r['store_vector_bits'])} "
            f"| {_fmt(r['round_trips_per_iteration'])} | {_fmt(r['sass_per_element'])} "
            f"| {_fmt(None if r['tail_bytes'] is None else r['tail_bytes'] / 1024, '.1f')} "
            f"| {_fmt(r['tail_iterations'])} | {_fmt(r['tail_round_trips'])} |"
        )
    lines += ["", "</details>", ""]
    return "\n".join(lines)


def summary(rows: list[dict]) -> list[str]:
    out = ["### Summary", ""]
    worst = max(rows, key=lambda r: r["registers"])
    over = [r for r in rows if r["registers"] > MAX_REGISTERS]
    where = f", in {', '.join(sorted({r['kernel'] for r in over}))}" if over else ""
    out.append(
        f"- **Worst registers**: {worst['registers']} ({worst['kernel']}, {worst['layout']} {worst['dtype']} "
        f"{worst['shape']}); launches over {MAX_REGISTERS}: {len(over)}{where}."
    )
    spills = [r for r in rows if r["spill_bytes"]]
    if spills:
        kinds = sorted({(r["kernel"], r["spill_bytes"], r["stack_bytes"]) for r in spills})
        text = "; ".join(f"{k}: {s} B spill traffic, {st} B stack" for k, s, st in kinds)
        out.append(f"- **Spills**: {len(spills)} launches spill ({text}).")
    else:
        out.append("- **Spills**: none.")
    amd = [r for r in rows if r.get("llvm_waves_per_simd") is not None]
    if amd:
        off = [r for r in amd if r["model_waves_per_simd"] != r["llvm_waves_per_simd"]]
        out.append(
            f"- **Occupancy**: the CDNA model's waves per SIMD differ from LLVM's in {len(off)} of {len(amd)} launches."
        )
    launches = {}
    for r in rows:
        launches.setdefault(r["mode"], set()).add(int(r["launch"].split("/")[1]))
    out.append("- **Launches per pass**: " + ", ".join(f"{m} {'/'.join(map(str, sorted(launches[m])))}"
                                                          for m in MODES if m in launches) + ".")  # fmt: skip
    tails = [r for r in rows if r["tail_bytes"] is not None]
    if tails:
        worst_tail = max(tails, key=lambda r: r["tail_bytes"])
        tail_trips = [r["tail_round_trips"] for r in tails if r["tail_round_trips"] is not None]  # not read on AMD
        out.append(
            f"- **Longest merge tail**: {worst_tail['tail_bytes'] / 1024:.1f} KB in {worst_tail['tail_iterations']} "
            f"iterations over {worst_tail['tail_levels']} levels ({worst_tail['kernel']}, {worst_tail['layout']} "
            f"{worst_tail['dtype']} {worst_tail['shape']}, grid {'x'.join(map(str, worst_tail['grid']))}); "
            f"merge-loop round trips (max): {_fmt(max(tail_trips, default=None))}."
        )
    out += ["", "| kernel | layout | dtype | regs (max) | spill B (max) | warps/SM (min) | ld bits (min-max) "
                "| st bits (min-max) | round trips (max) | SASS/elem (min-max) | tail KB (max) |",
            "|" + "---|" * 11]  # fmt: skip
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["layout"], r["dtype"]), []).append(r)

    def span(values):
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        lo, hi = min(values), max(values)
        return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"

    for (kernel, layout, dtype), rs in sorted(groups.items()):
        trips = [r["round_trips_per_iteration"] for r in rs if r["round_trips_per_iteration"] is not None]
        out.append(
            f"| {kernel} | {layout} | {dtype} | {max(r['registers'] for r in rs)} "
            f"| {max(r['spill_bytes'] for r in rs)} "
            f"| {min(r['max_warps_per_sm'] for r in rs)} | {span(r['load_vector_bits'] for r in rs)} "
            f"| {span(r['store_vector_bits'] for r in rs)} | {max(trips) if trips else '-'} "
            f"| {span(r['sass_per_element'] for r in rs)} "
            f"| {_kb(rs)} |"
        )
    return out


# ----------------------------------------------------------------------------------------------
# Self-check: the round-trip counter on toy kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _toy_work(v):
    """Enough arithmetic that ptxas keeps one tile per loop iteration (it unrolls small loop bodies)."""
    for _ in tl.static_range(48):
        v = v * 1.0001 + 0.5
    return v


@triton.jit
def _toy_dependent(idx_ptr, x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Loads an index, then loads through it: 2 round trips per iteration."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        j = tl.load(idx_ptr + offs)
        acc += _toy_work(tl.load(x_ptr + j))
    tl.store(out_ptr + tl.arange(0, BLOCK), acc)


@triton.jit
def _toy_independent(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Two independent loads per iteration: 1 round trip."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += _toy_work(tl.load(a_ptr + offs) * tl.load(b_ptr + offs))
    tl.store(out_ptr + tl.arange(0, BLOCK), acc)


def self_check(target) -> dict:
    """Round trips, vector widths and loop size of the two toy kernels, compiled like a launch with n % 16 == 0."""
    results = {}
    for fn, pointers in ((_toy_dependent, ("*i32", "*fp32", "*fp32")), (_toy_independent, ("*fp32", "*fp32", "*fp32"))):
        signature = dict(zip(fn.arg_names, (*pointers, "i32", "constexpr"), strict=True))
        attrs = {(k,): [["tt.divisibility", 16]] for k in range(4)}
        options = {"num_warps": 4}
        row = compile_and_read(fn, signature, {(4,): 512}, attrs, options, target)
        results[fn.fn.__name__] = {k: row[k] for k in ("round_trips_per_iteration", "load_vector_bits",
                                                       "loop_global_loads", "registers", "spill_bytes")}  # fmt: skip
    return results


# ----------------------------------------------------------------------------------------------
# The time model (--model): a model, not a measurement
# ----------------------------------------------------------------------------------------------

# Every constant of the model, with where it comes from. None of them was measured here (no GPU).
ASSUMPTIONS = {
    "hbm_copy_bw": (
        4.3e12,
        "B/s: HBM bandwidth a copy reaches on an H200, assumed ~90% of NVIDIA's published "
        "4.8 TB/s HBM3e peak (H200 SXM product brief); the issue's 1.32 ms floor uses the same figure. "
        "Replace it with the copy bandwidth the GPU check measures",
    ),
    "sms": (132, "SMs of an H200 SXM (NVIDIA specification)"),
    "clock_hz": (1.98e9, "Hz: H200 SXM maximum boost clock (NVIDIA specification)"),
    "issue_per_sm_clock": (
        4,
        "warp instructions issued per SM per clock: 4 schedulers, one each (NVIDIA Hopper architecture whitepaper)",
    ),
    "dram_latency_s": (
        800e-9,
        "s: latency of a global load from HBM under load, for Little's law; an assumed round figure "
        "(several hundred ns is the usual range for HBM GPUs), not measured or verified here",
    ),
    "merge_bw_per_sm": (
        150e9,
        "B/s: what one SM reads from L2 in the merge tail, the issue's middle figure "
        "(it brackets 100-250 GB/s); assumed",
    ),
    "merge_level_s": (
        0.5e-6,
        "s: per merge level, a barrier, an atomic at L2 and the dependent load of "
        "the first rows: about two L2 round trips; assumed",
    ),
    "launch_fixed_s": (
        1.0e-6,
        "s: per launch, the gap between back-to-back kernels on a stream plus the ramp and drain of the grid; assumed",
    ),
}
H200 = ASSUMPTIONS
_SAME = {k: ASSUMPTIONS[k] for k in ("dram_latency_s", "merge_bw_per_sm", "merge_level_s", "launch_fixed_s")}
# The A100 and MI300X rows: the same kinds of figures, from the vendors' specifications, and the same assumed
# latencies and merge costs as the H200's (not measured or verified on either GPU).
A100 = {
    "hbm_copy_bw": (1.8e12, "B/s: ~90% of the A100 SXM 80GB's 2.039 TB/s HBM2e peak (NVIDIA A100 datasheet); assumed"),
    "sms": (108, "SMs of an A100 (NVIDIA A100 Tensor Core GPU architecture whitepaper)"),
    "clock_hz": (1.41e9, "Hz: A100 SXM boost clock (NVIDIA specification)"),
    "issue_per_sm_clock": (4, "warp instructions issued per SM per clock: 4 schedulers (NVIDIA Ampere whitepaper)"),
    **_SAME,
}
MI300X = {
    "hbm_copy_bw": (4.8e12, "B/s: ~90% of the MI300X's 5.3 TB/s HBM3 peak (AMD Instinct MI300X datasheet); assumed"),
    "sms": (304, "compute units of an MI300X (AMD specification)"),
    "clock_hz": (2.1e9, "Hz: MI300X peak engine clock (AMD specification)"),
    "issue_per_sm_clock": (
        1,
        "wavefront instructions per CU per clock: 4 SIMDs, each taking 4 clocks for a vector instruction of a "
        "wavefront of 64 (AMD CDNA3 ISA guide); assumed",
    ),
    **_SAME,
}
# The model's device per audited target (--model): the H200 row for sm_90, A100 for sm_80, MI300X for gfx942.
MODEL_DEVICES = {"90": ("H200", H200), "80": ("A100", A100), "gfx942": ("MI300X", MI300X)}
# Activation-sized tensors each kernel reads and writes (the plain module: no residual, no activation).
KERNEL_TENSORS = {
    "_batch_norm_stats_kernel": (1, 0),
    "_batch_norm_elemt_kernel": (1, 1),
    "_batch_norm_backward_reduce_kernel": (2, 0),
    "_batch_norm_backward_elemt_kernel": (2, 1),
}
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
STEP_MODES = ("train_forward", "backward")  # a training step; eval is not part of it
FLOOR_TENSORS = 8  # forward reads x twice and writes y; backward reads dy and x twice and writes dx


def _a(name: str) -> float:
    return ASSUMPTIONS[name][0]


def model_launch(r: dict) -> dict:
    """Modeled time of one launch, in microseconds, and its parts.

    The grid runs in waves of ``resident = sms * (max_warps_per_sm // num_warps)`` programs (the
    last wave may be partial). Each wave takes the largest of three bounds, then the launch adds the
    merge tail and a fixed cost:

    * HBM: the wave's bytes (read and written) at the copy bandwidth;
    * Little's law: one program keeps ``num_warps * 32`` threads times its main loop's load bytes per
      thread per iteration (its global loads at their vector width) in flight, so it reads its share
      in ``share / in_flight * dram_latency_s`` however few programs run beside it: a partial last
      wave takes as long as a full one unless HBM bounds the full one;
    * issue: ``sass_per_element * elements / 32`` warp instructions of the wave's programs on the SM
      that holds most of them, at ``issue_per_sm_clock * clock``;
    * tail: ``tail_bytes / merge_bw_per_sm + tail_levels * merge_level_s`` (0 for kernels without a merge).

    ``hbm_us``, ``little_us`` and ``issue_us`` are each bound summed over the waves; ``main_us`` the
    waves' maxima, summed.
    """
    numel = math.prod(int(v) for v in r["shape"].split("x"))
    reads, writes = KERNEL_TENSORS[r["kernel"]]
    itemsize = ITEMSIZE[r["dtype"]]
    programs = math.prod(r["grid"])
    sms = int(_a("sms"))
    resident = sms * max(1, r["max_warps_per_sm"] // r["num_warps"])
    waves = [resident] * (programs // resident) + ([programs % resident] if programs % resident else [])
    load_bytes = (r["loop_global_loads"] or 0) * (r["load_vector_bits"] or 32) / 8
    program_in_flight = r["num_warps"] * WARP_SIZE * load_bytes
    issue_rate = _a("issue_per_sm_clock") * _a("clock_hz")  # warp instructions per second on one SM
    per_program = numel / programs  # elements
    hbm = little = issue = main = 0.0
    for n in waves:
        h = n * per_program * (reads + writes) * itemsize / _a("hbm_copy_bw")
        lt = per_program * reads * itemsize / program_in_flight * _a("dram_latency_s") if program_in_flight else 0.0
        iss = (r["sass_per_element"] or 0) * per_program / WARP_SIZE * -(-n // sms) / issue_rate
        hbm, little, issue, main = hbm + h, little + lt, issue + iss, main + max(h, lt, iss)
    tail_bytes_s = (r.get("tail_bytes") or 0) / _a("merge_bw_per_sm")
    tail = tail_bytes_s + (r.get("tail_levels") or 0) * _a("merge_level_s")
    bound = {hbm: "hbm", issue: "issue", little: "little"}[max(hbm, issue, little)]
    us = 1e6
    return {"hbm_us": hbm * us, "issue_us": issue * us, "little_us": little * us, "main_us": main * us,
            "bound": bound, "waves": round(programs / resident, 3), "tail_us": tail * us,
            "tail_bytes_us": tail_bytes_s * us, "fixed_us": _a("launch_fixed_s") * us,
            "modeled_us": (main + tail + _a("launch_fixed_s")) * us}  # fmt: skip


def model(rows: list[dict], layer_counts: dict[str, int]) -> dict:
    """Per launch and per layer estimates, and the training step's BatchNorms (forward+backward of every
    layer, each shape weighted by its count in ``layer_counts``) per dtype and layout, against the HBM floor."""
    launches = [{**{k: r[k] for k in ("kernel", "shape", "dtype", "layout", "mode", "launch")}, **model_launch(r)}
                for r in rows]  # fmt: skip
    whole = []
    for dtype in sorted({r["dtype"] for r in rows}):
        for layout in LAYOUTS:
            step = [m for m in launches if m["dtype"] == dtype and m["layout"] == layout and m["mode"] in STEP_MODES]
            if not step:
                continue
            total = sum(layer_counts[m["shape"]] * m["modeled_us"] for m in step)
            main = sum(layer_counts[m["shape"]] * (m["modeled_us"] - m["tail_us"] - m["fixed_us"]) for m in step)
            all_tails = sum(layer_counts[m["shape"]] * m["tail_us"] for m in step)
            fixed = sum(layer_counts[m["shape"]] * m["fixed_us"] for m in step)
            tails = sum(layer_counts[m["shape"]] * m["tail_bytes_us"] for m in step)
            shapes = {m["shape"] for m in step}
            floor = sum(layer_counts[s] * FLOOR_TENSORS * math.prod(map(int, s.split("x"))) * ITEMSIZE[dtype]
                        for s in shapes) / _a("hbm_copy_bw") * 1e6  # fmt: skip
            whole.append({"dtype": dtype, "layout": layout, "layers": sum(layer_counts[s] for s in shapes),
                          "modeled_ms": round(total / 1e3, 4), "floor_ms": round(floor / 1e3, 4),
                          "ratio": round(total / floor, 3), "tails_ms": round(tails / 1e3, 4),
                          "tails_of_floor": round(tails / floor, 4), "main_ms": round(main / 1e3, 4),
                          "tail_with_levels_ms": round(all_tails / 1e3, 4),
                          "fixed_ms": round(fixed / 1e3, 4)})  # fmt: skip
    layers = {}
    for m in launches:
        if m["mode"] in STEP_MODES:
            key = (m["shape"], m["dtype"], m["layout"])
            layers[key] = layers.get(key, 0.0) + m["modeled_us"]
    per_layer = [{"shape": s, "dtype": d, "layout": lay, "fwd_bwd_us": round(v, 3)}
                 for (s, d, lay), v in sorted(layers.items())]  # fmt: skip
    return {
        "note": "A MODEL, not a measurement: every figure follows from the assumptions below and the compiled code.",
        "assumptions": {k: {"value": v, "source": src} for k, (v, src) in ASSUMPTIONS.items()},
        "whole_model": whole,
        "per_layer": per_layer,
        "launches": launches,
    }


def model_markdown(m: dict, quick: bool) -> str:
    lines = [
        f"### Time model of the BatchNorms of a ResNet-50 training step on an {m.get('device', 'H200')} "
        "(a model, not a measurement)",
        "",
        f"`python benchmarks/kernel_audit.py --model{' --quick' if quick else ''}`: batch 32, forward+backward of "
        "every BatchNorm layer (each shape weighted by its count), against the HBM floor (8 activation-sized "
        "tensors per layer at the assumed copy bandwidth). Per launch, wave by wave (the programs one SM "
        "holds at the kernel's occupancy, on every SM): the larger of HBM bytes at the copy bandwidth, SASS "
        "issue and a Little's-law bound from each program's bytes in flight; then the merge tail and a "
        "fixed cost. Merge tails: their bytes at one SM's bandwidth (the issue's measure); main loops: the "
        "larger of the three bounds, summed; tails with levels: the tails' bytes plus each merge level's "
        "latency; fixed: the per-launch cost.",
        "",
        "| dtype | layout | layers | modeled ms | HBM floor ms | modeled / floor | merge tails ms | tails / floor "
        "| main loops ms | tails with levels ms | fixed ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in m["whole_model"]:
        lines.append(f"| {w['dtype']} | {w['layout']} | {w['layers']} | {w['modeled_ms']:.3f} | {w['floor_ms']:.3f} "
                     f"| {w['ratio']:.2f}x | {w['tails_ms']:.4f} | {100 * w['tails_of_floor']:.1f}% "
                     f"| {w['main_ms']:.3f} | {w['tail_with_levels_ms']:.3f} | {w['fixed_ms']:.3f} |")  # fmt: skip
    lines += ["", "Assumptions (none measured here):", ""]
    for k, a in m["assumptions"].items():
        lines.append(f"- `{k}` = {a['value']:g}: {a['source']}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for kernel_audit.json and kernel_audit.md")
    parser.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, bf16 and fp32 only")
    parser.add_argument("--results", help="also write the table into this RESULTS.md, between the audit markers")
    parser.add_argument("--self-check", action="store_true", help="run the round-trip counter on toy kernels")
    parser.add_argument("--arch", default="90", choices=sorted(SMS), help="the target (default 90: H100/H200)")
    parser.add_argument("--model", action="store_true", help="also model each launch and the training step: model.json")
    parser.add_argument("--sm-count", type=int, help="plan launches as on a GPU with this many SMs (default: SMS)")
    parser.add_argument(
        "--flat-merge",
        action="store_true",
        help="one-level merge (the last program merges every partial): the tail rule then fails",
    )
    parser.add_argument("--case", help="one shape, dtype and layout only, e.g. 32x256x14x14,bf16,channels_last")
    parser.add_argument("--masked", action="store_true", help="the layers of masked BatchNorm (a padding mask)")
    parser.add_argument("--dtype", help="only these dtypes, separated by commas (e.g. bf16)")
    parser.add_argument("--layout", help="only these layouts, separated by commas (e.g. channels_last)")
    parser.add_argument(
        "--cache-dir",
        help="a Triton cache to share (default: a fresh one); ptxas's figures are kept beside each kernel",
    )
    parser.add_argument(
        "--serve", action="store_true", help="run the jobs read from stdin, one a line, in this process"
    )
    args = parser.parse_args(argv)
    if args.cache_dir:
        knobs.cache.dir = os.path.abspath(args.cache_dir)
    if args.serve:
        return serve(sys.stdin, sys.stdout)
    why = tools_missing()
    if why:
        print(f"kernel_audit: cannot run: {why}", file=sys.stderr)
        return 2
    hip = args.arch.startswith("gfx")
    target = GPUTarget("hip", args.arch, 64) if hip else GPUTarget("cuda", int(args.arch), 32)
    name = args.arch if hip else f"sm_{args.arch}"
    if args.self_check:
        checked = json.dumps(self_check(target), indent=1)
        print(checked)
        if args.out:  # also DIR/self_check.json
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "self_check.json"), "w") as f:
                f.write(checked)
        return 0
    if not args.out:
        parser.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    shapes = QUICK_SHAPES if args.quick else [s for s, _ in distinct_bn_shapes(32)]
    if args.masked:
        shapes = shapes + MASKED_SHAPES
    dtypes = ("bf16", "fp32") if args.quick else tuple(DTYPES)
    layouts = LAYOUTS
    if args.case:
        shape, dtype, layout = args.case.split(",")
        shapes, dtypes, layouts = [tuple(map(int, shape.split("x")))], (dtype,), (layout,)
    if args.dtype:
        dtypes = tuple(d for d in dtypes if d in args.dtype.split(","))
    if args.layout:
        layouts = tuple(lay for lay in layouts if lay in args.layout.split(","))
    global SM_COUNT, WARP_SIZE, MASKED, ASSUMPTIONS
    SM_COUNT, WARP_SIZE, MASKED = args.sm_count or SMS[args.arch], target.warp_size, args.masked
    ASSUMPTIONS = H200  # a job of --serve starts from the defaults
    if args.model:
        if args.arch not in MODEL_DEVICES:
            parser.error(f"--model: no device row for {name} (rows: {', '.join(sorted(MODEL_DEVICES))})")
        device, ASSUMPTIONS = MODEL_DEVICES[args.arch]
    from tritonbn.kernels import _plan

    flat_merge = _plan._FLAT_MERGE
    if args.flat_merge:
        _plan._FLAT_MERGE = 1 << 30
    try:
        return _audit_main(args, shapes, dtypes, layouts, target, name, device if args.model else None)
    finally:
        _plan._FLAT_MERGE = flat_merge


def _audit_main(args, shapes, dtypes, layouts, target, name, device) -> int:
    t0 = time.time()
    print(f"kernel_audit: {len(shapes)} shapes x {dtypes} x {layouts} x {MODES} for {name}, planned on {SM_COUNT} SMs")
    rows, compilations = audit(shapes, dtypes, layouts, target)
    meta = {
        "date": datetime.date.today().isoformat(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "target": name,
        "sm_count": SM_COUNT,
        "quick": args.quick,
        "masked": args.masked,
        "rows": len(rows),
        "compilations": compilations,
    }
    with open(os.path.join(args.out, "kernel_audit.json"), "w") as f:
        json.dump(rows, f, indent=1)
    md = markdown(rows, meta)
    section = markdown(rows, meta, every_launch=False)
    if args.model:
        counts = {"x".join(map(str, sh)): n for sh, n in distinct_bn_shapes(32)}
        counts.update({"x".join(map(str, sh)): counts.get("x".join(map(str, sh)), 1) for sh in shapes})
        m = model(rows, counts)
        m["device"] = device
        m["meta"] = meta
        with open(os.path.join(args.out, "model.json"), "w") as f:
            json.dump(m, f, indent=1)
        mmd = model_markdown(m, args.quick)
        md = md.rstrip("\n") + "\n\n" + mmd + "\n"
        section = section.rstrip("\n") + "\n\n" + mmd + "\n"
        print(mmd)
    with open(os.path.join(args.out, "kernel_audit.md"), "w") as f:
        f.write(md)
    if args.results:
        write_section(args.results, "kernel-audit-masked" if args.masked else "kernel-audit", section)
    print("\n".join(summary(rows)))
    print(f"kernel_audit: {len(rows)} rows in {time.time() - t0:.0f} s -> {args.out}/kernel_audit.json and .md")
    return 0


def serve(jobs, out) -> int:
    """``--serve``: run each line of ``jobs`` as one audit's arguments, in this process, and print
    ``kernel_audit-done RC`` after each (RC its exit status; a failure's traceback is printed first)."""
    import shlex
    import traceback

    for line in jobs:
        if not line.strip():
            break
        try:
            rc = main(shlex.split(line))
        except SystemExit as e:  # argparse's errors
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - reported to the caller, which fails on it
            traceback.print_exc(file=out)
            rc = 1
        print(f"kernel_audit-done {rc}", file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
