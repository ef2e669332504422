"""Host (CPU) cost of tritonbn's eager path, with the Triton launches replaced by no-ops.

A GPU runs one BatchNorm layer of a ResNet-50 in a few to a few tens of microseconds; eager training
is CPU-bound unless the host issues each layer faster than that. This script measures the host side
alone, on CPU tensors, without a GPU:

* The Triton kernels are forced on (``tritonbn.backend`` is told they can run on CPU) with
  ``TRITON_INTERPRET`` unset, and ``JITFunction.run`` (what ``kernel[grid](...)`` calls) is replaced by
  a no-op that counts launches. Everything else is the real path: ``tritonbn.SyncBatchNorm(512)``
  on a ``(2, 512, 1, 1)`` tensor, forward then backward.
* The reference is ``nn.BatchNorm2d(512)`` forward+backward on a ``(2, 512, 1, 1)`` CPU tensor
  (it computes for real; at that size its cost is its own host path). Both are timed in the same
  run, interleaved block by block, and the medians over the blocks are compared: ``ratio`` is
  ``tritonbn_us / reference_us``.
* Stages, each timed in isolation in the same interleaved rounds and reported as differences:
  checks (what a call like the layer's last one pays: the comparison with its record,
  ``checks.repeats``; a call of a new shape runs ``check_inputs`` and ``check_activation`` instead, reported
  alone as ``first_call_checks_us``), dispatch (module call, settings, the repeated call's lane to the eager path:
  module total minus the autograd Function and the checks), autograd (``Function.apply`` and the
  engine's backward call: the Function total minus the passes), pass logic (``forward_pass`` /
  ``backward_pass`` minus the launchers), launch preparation (the launchers' Python: plan,
  allocations, argument lists, and the no-op launch call).
* Triton's argument binding, measured separately: the real ``JITFunction.run`` runs with a fake
  driver (device 0, stream 0, an sm_90 target) and a fake compiled kernel whose ``launch_metadata``
  and ``run`` do nothing, so everything Triton does in Python before the C launcher is timed (device
  and stream look-up, the generated binder, the cache key, the globals check, the grid). The C
  launcher itself (argument packing and ``cuLaunchKernel``) needs a GPU and is not measured.
* Eval: one forward under ``torch.no_grad()`` against ``nn.BatchNorm2d`` in eval.
* A ResNet-50-topology model (``tritonbn/cli/resnet50.py``, 53 BN layers; input ``(2, 3, 16, 16)``)
  forward+backward with tritonbn layers (converted) against ``nn.BatchNorm2d`` layers, launches
  stubbed: the host cost per training step. There the stub zeroes the activation-sized outputs, so
  that the convolutions read ordinary numbers (uninitialized memory slowed them down), and denormals
  are flushed.

``--results benchmarks/RESULTS.md`` writes the case table and the stages there, between the ``host-overhead``
markers. ``--json FILE`` writes ``tritonbn_us``, ``reference_us``, ``ratio`` and
``launches_per_training_pass`` (plus the rest). ``--max-ratio R`` exits with status 1 when ``ratio``
exceeds ``R``; ``.ci/run`` uses it (see docs/performance.md, "Host overhead", for how the bound was chosen).

Run it as ``python benchmarks/host_overhead.py`` (not under pytest, which sets TRITON_INTERPRET).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("host_overhead: triton was imported under TRITON_INTERPRET=1; run this script on its own")
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITONBN_BACKEND"] = "triton"
os.environ.pop("TRITONBN_DEBUG", None)
warnings.filterwarnings("ignore", module="triton")

import torch  # noqa: E402
import triton  # noqa: E402
from torch import nn  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver as triton_driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from results_file import write_section  # noqa: E402

import tritonbn  # noqa: E402
from tritonbn import backend  # noqa: E402
from tritonbn._core import call, checks, dispatch, eager, route  # noqa: E402
from tritonbn._core import passes as data_path  # noqa: E402
from tritonbn._core.checks import check_inputs  # noqa: E402
from tritonbn.activations import check_activation  # noqa: E402
from tritonbn.backends.launchers import Operands, Saved  # noqa: E402
from tritonbn.cli.resnet50 import resnet50  # noqa: E402
from tritonbn.kernels import _launch, plan  # noqa: E402
from tritonbn.kernels._launch import Launch  # noqa: E402

C = 512
SHAPE = (2, C, 1, 1)
RESNET_INPUT = (2, 3, 16, 16)

# --- launches: stubbed, direct over a fake driver, or Triton's run over the fake driver ----------------

_REAL_CALL = Launch.__call__
_REAL_RUN = JITFunction.run
LAUNCHES = 0
FILL_NS = 0  # time spent zeroing outputs in the model's stubs, taken out of its figures


def _stub_call(self, *pointers):
    global LAUNCHES
    LAUNCHES += 1


_OUTPUTS = ("y_ptr", "dx_ptr", "dr_ptr")
_outputs: dict = {}


def _fill(fn, args) -> None:
    """Zero the activation-sized outputs (y, dx, the residual's grad) a launch would write, off the clock.

    For the ResNet-50 model: uninitialized outputs made the CPU convolutions that read them about 8%
    slower, which is not host overhead. On a GPU the kernel writes them; here the time is measured
    and subtracted (``FILL_NS``).
    """
    global FILL_NS
    t0 = CLOCK()
    index = _outputs.get(fn)
    if index is None:
        index = _outputs[fn] = [i for i, name in enumerate(fn.arg_names) if name in _OUTPUTS]
    for i in index:
        args[i].zero_()
    FILL_NS += CLOCK() - t0


def _filling_stub_call(self, *pointers):
    global LAUNCHES
    LAUNCHES += 1
    _fill(self.fn, pointers)


class _FakeDriver:
    """Enough of a Triton driver for ``JITFunction.run``: device 0, stream 0, an sm_90 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class _FakeKernel:
    """Stands in for a compiled kernel: no launch metadata, a C launcher that only counts (and fills)."""

    function = None
    packed_metadata = None
    fill = False

    def __init__(self, fn):
        self.fn = fn

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        global LAUNCHES
        LAUNCHES += 1
        if _FakeKernel.fill:
            _fill(self.fn, args[9:])  # grid (3), stream, function, metadata (2), hooks (2), then the arguments


def _fake_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    kernel = _FakeKernel(self)
    self.device_caches[device][0][key] = kernel
    return kernel


_EAGER = route.is_eager


def stub_launches() -> None:
    """Launches replaced by no-ops: the host path up to the launch."""
    Launch.__call__ = _stub_call
    _launch.DIRECT = True
    _FakeKernel.fill = False
    route.is_eager = dispatch.is_eager = _EAGER


def stub_and_fill() -> None:
    stub_launches()
    Launch.__call__ = _filling_stub_call


def direct_launches() -> None:
    """The launch path tritonbn takes: cached CompiledKernel, its C launcher called directly (a fake one here)."""
    stub_launches()
    Launch.__call__ = _REAL_CALL


def direct_and_fill() -> None:
    direct_launches()
    _FakeKernel.fill = True


def custom_op_path() -> None:
    """Launches stubbed, and every call through the custom ops (the compiled path; eager before issue 12)."""
    stub_launches()
    route.is_eager = dispatch.is_eager = lambda x: False  # no route kept for eager calls is taken either


def bind_launches() -> None:
    """Triton's own ``JITFunction.run`` for every launch (binder, cache key, checks) over the fake driver and kernel."""
    direct_launches()
    _launch.DIRECT = False


def setup() -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    triton_driver.set_active(_FakeDriver())
    JITFunction._do_compile = _fake_compile
    backend._load_kernels()
    backend._triton_unusable = lambda x: None  # the kernels "can run" on CPU tensors
    stub_launches()


def count_launches(fn) -> int:
    global LAUNCHES
    LAUNCHES = 0
    fn()
    return LAUNCHES


# CPU time of this thread: the host cost itself, which preemption by other processes on a shared
# machine does not inflate (the wall clock does, by far more than the differences measured here).
# With one intra-op thread, the CPU autograd engine runs backward on the calling thread too.
CLOCK = time.thread_time_ns

# --- timing -------------------------------------------------------------------------------------------


def interleaved(cases: dict, rounds: int, inner: int) -> dict[str, list[float]]:
    """Microseconds per call of each case, one sample per round; the cases alternate within each round.

    ``cases`` maps a name to ``(fn, mode)``, ``mode`` a function run before the block (stub or bind).
    """
    names = list(cases)
    samples = {name: [] for name in names}
    for fn, mode in cases.values():  # warm-up: caches, first-call paths
        mode()
        for _ in range(max(5, inner // 4)):
            fn()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                fn, mode = cases[name]
                mode()
                f0 = FILL_NS
                t0 = CLOCK()
                for _ in range(inner):
                    fn()
                samples[name].append((CLOCK() - t0 - (FILL_NS - f0)) / inner / 1e3)
    finally:
        gc.enable()
        stub_launches()
    return samples


def med(samples: list[float]) -> float:
    return statistics.median(samples)


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


# --- the cases ----------------------------------------------------------------------------------------


def layer_cases():
    torch.manual_seed(0)
    bn = tritonbn.SyncBatchNorm(C)
    ref = nn.BatchNorm2d(C)
    x = torch.randn(SHAPE, requires_grad=True)
    x_ref = torch.randn(SHAPE, requires_grad=True)
    g = torch.randn(SHAPE)
    rm, rv, w, b, nbt = bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.num_batches_tracked
    ops = backend.ops_for(x)
    layer = call.settings_for(True, 0.1, 1e-5, None, 0.01, None, debug_group=None)
    operands = Operands(x, w, b, rm, rv, nbt)
    fwd = data_path.forward_pass
    bwd = data_path.backward_pass
    apply = eager.apply_eager

    def module():
        bn(x).backward(g)

    mask = torch.ones((SHAPE[0], *SHAPE[2:]), dtype=torch.bool)

    def masked_module():
        bn(x, mask=mask).backward(g)

    def reference():
        ref(x_ref).backward(g)

    def function():
        apply(x, w, b, None, ops, layer, operands).backward(g)

    def passes():
        y, mean, invstd, stats = fwd(ops, layer, operands)
        bwd(ops, layer, g, Saved(x, w, b, mean, invstd, stats), (True, True, True, False))

    with torch.no_grad():
        y0, mean0, invstd0, stats0 = fwd(ops, layer, operands)
    count0 = stats0[-1:]
    saved0 = Saved(x, w, b, mean0, invstd0, stats0)
    sums0 = ops.backward_reduce(layer, g, saved0, True, True)[0]

    # The launchers as the passes call them (tritonbn.backends.launchers), not their public keyword forms.
    def launch_stats():
        ops.stats(x, None)

    def launch_elemt():
        ops.elemt(layer, operands, stats0, True)

    def launch_reduce():
        ops.backward_reduce(layer, g, saved0, True, True)

    def launch_backward_elemt():
        ops.backward_elemt(layer, g, saved0, sums0, count0, True, None)

    def launchers():
        launch_stats()
        launch_elemt()
        launch_reduce()
        launch_backward_elemt()

    def first_call_checks():
        check_inputs(Operands(x, w, b, rm, rv, nbt), 0.1, 1e-5, True, C)
        check_activation(None, 0.01)

    def repeats():  # the layer's record, made by its first call (the warm-up's)
        checks.repeats(bn._tritonbn_settings.record, operands, C)

    def plan_call():
        plan(x.shape, x)

    def empty_vector():
        torch.empty(C, dtype=torch.float32, device=x.device)

    class EmptyFunction(torch.autograd.Function):
        """The floor of any Python autograd Function here: same inputs, saved tensors and gradients, no work."""

        @staticmethod
        def forward(ctx, x, weight, bias, residual, backend, settings, operands):
            ctx.save_for_backward(x, weight, bias, None, None, None)
            ctx.backend, ctx.settings, ctx.mask = backend, settings, operands.mask
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, grad_out):
            x, weight, bias, *_ = ctx.saved_tensors
            return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias), None, None, None, None

    apply_empty = super(torch.autograd.Function, EmptyFunction).apply

    def empty_function():
        apply_empty(x, w, b, None, ops, layer, operands).backward(g)

    bn_eval = tritonbn.SyncBatchNorm(C).eval()
    ref_eval = nn.BatchNorm2d(C).eval()

    def eval_module():
        with torch.no_grad():
            bn_eval(x)

    def eval_reference():
        with torch.no_grad():
            ref_eval(x_ref)

    stub, direct, bind = stub_launches, direct_launches, bind_launches
    main = {
        "tritonbn": (module, stub),
        "reference": (reference, stub),
        "tritonbn_with_launch": (module, direct),
        "masked": (masked_module, stub),
        "masked_with_launch": (masked_module, direct),
        "function": (function, stub),
        "passes": (passes, stub),
        "launchers": (launchers, stub),
        "checks": (repeats, stub),
        "first_call_checks": (first_call_checks, stub),
        "empty_function": (empty_function, stub),
        "tritonbn_bound": (module, bind),
        "custom_ops": (module, custom_op_path),
        "eval_tritonbn": (eval_module, stub),
        "eval_tritonbn_with_launch": (eval_module, direct),
        "eval_reference": (eval_reference, stub),
    }
    detail = {
        "batch_norm_stats": (launch_stats, stub),
        "batch_norm_elemt": (launch_elemt, stub),
        "batch_norm_backward_reduce": (launch_reduce, stub),
        "batch_norm_backward_elemt": (launch_backward_elemt, stub),
        "plan()": (plan_call, stub),
        "torch.empty(C)": (empty_vector, stub),
    }
    return main, detail, module, eval_module


def binder_cost(module_step) -> tuple[float, int]:
    """Microseconds per training pass in Triton's generated binders alone (the launches' real arguments)."""
    calls = []

    def record(self, *args, grid, warmup, **kwargs):
        calls.append((self, args, kwargs))

    bind_launches()
    JITFunction.run = record
    try:
        module_step()
    finally:
        JITFunction.run = _REAL_RUN
        stub_launches()
    binders = []
    for kernel, args, kwargs in calls:
        binder = kernel.device_caches[0][4]
        binders.append((binder, args, kwargs))

    def bind_all():
        for binder, args, kwargs in binders:
            binder(*args, **kwargs)

    samples = interleaved({"binders": (bind_all, stub_launches)}, rounds=20, inner=200)
    return med(samples["binders"]), len(binders)


def resnet_cases():
    torch.manual_seed(0)
    ref = resnet50(num_classes=10)
    tbn = tritonbn.convert_sync_batchnorm(resnet50(num_classes=10))
    tbn.load_state_dict(ref.state_dict())
    x = torch.randn(RESNET_INPUT)

    def step_tbn():
        tbn.zero_grad(set_to_none=True)
        tbn(x).sum().backward()

    def step_ref():
        ref.zero_grad(set_to_none=True)
        ref(x).sum().backward()

    layers = sum(isinstance(m, tritonbn.SyncBatchNorm) for m in tbn.modules())
    cases = {
        "resnet50_tritonbn": (step_tbn, stub_and_fill),
        "resnet50_tritonbn_with_launch": (step_tbn, direct_and_fill),
        "resnet50_reference": (step_ref, stub_launches),
    }
    return cases, layers, (tbn, step_tbn), (ref, step_ref)


def layer_forwards_in_and_out_of_the_model(tritonbn_model, reference_model, rounds: int) -> dict[str, float]:
    """Microseconds per BN layer forward (the module call, hooks around it), in the model and alone.

    In the model, forward hooks time each BN call of the training step, with the convolutions running
    between them. Alone, the same layers are called back to back on the inputs they saw in the model,
    with nothing between them. tritonbn with its launch (``direct_and_fill``), the reference as it is.
    """
    (tbn, step_tbn), (ref, step_ref) = tritonbn_model, reference_model
    found = {"tritonbn": [], "reference": []}
    times: list[int] = []
    hooks = []

    def keep(seen):
        return lambda m, a: seen.append((m, a[0].detach()))

    for name, model, kind in (("tritonbn", tbn, tritonbn.SyncBatchNorm), ("reference", ref, nn.BatchNorm2d)):
        hooks += [m.register_forward_pre_hook(keep(found[name])) for m in model.modules() if isinstance(m, kind)]
    direct_and_fill()
    step_tbn()
    stub_launches()
    step_ref()
    for h in hooks:
        h.remove()

    def pre(m, a):
        m._tritonbn_t0 = CLOCK()

    def post(m, a, out):
        times.append(CLOCK() - m._tritonbn_t0)

    for m, _ in found["tritonbn"] + found["reference"]:
        hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    samples: dict[str, list[float]] = {k: [] for k in ("tritonbn_model", "reference_model", "tritonbn_alone",
                                                       "reference_alone")}  # fmt: skip
    mode = {"tritonbn": direct_and_fill, "reference": stub_launches}
    step = {"tritonbn": step_tbn, "reference": step_ref}
    for _ in range(rounds):
        for name in ("tritonbn", "reference"):
            mode[name]()
            times.clear()
            step[name]()
            samples[f"{name}_model"].append(sum(times) / len(times) / 1e3)
            times.clear()
            for m, x in found[name]:
                m(x.requires_grad_())
            samples[f"{name}_alone"].append(sum(times) / len(times) / 1e3)
    for h in hooks:
        h.remove()
    stub_launches()
    return {k: med(v) for k, v in samples.items()}


# --- report -------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    parser.add_argument("--max-ratio", type=float, default=None, help="exit 1 when the ratio exceeds this bound")
    parser.add_argument(
        "--max-ratio-with-launch", type=float, default=None, help="exit 1 when ratio_with_launch exceeds this bound"
    )
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per case (default 40)")
    parser.add_argument("--inner", type=int, default=50, help="calls per timed block (default 50)")
    parser.add_argument("--no-resnet", action="store_true", help="skip the ResNet-50 model")
    parser.add_argument("--results", help="also write the case table into this RESULTS.md, between the "
                        "host-overhead markers")  # fmt: skip
    args = parser.parse_args(argv)
    setup()

    main_cases, detail_cases, module_step, eval_step = layer_cases()
    launches = count_launches(module_step)
    eval_launches = count_launches(eval_step)
    s = interleaved(main_cases, args.rounds, args.inner)
    d = interleaved(detail_cases, max(10, args.rounds // 2), args.inner)
    binders_us, binder_launches = binder_cost(module_step)

    m = {name: med(v) for name, v in s.items()}
    per_round = [a / b for a, b in zip(s["tritonbn"], s["reference"], strict=True)]
    ratio = m["tritonbn"] / m["reference"]
    bound_us = m["tritonbn_bound"] - m["tritonbn"]
    ratio_with_launch = m["tritonbn_with_launch"] / m["reference"]
    stages = {
        "checks": m["checks"],
        "dispatch": m["tritonbn"] - m["function"] - m["checks"],
        "autograd": m["function"] - m["passes"],
        "pass logic": m["passes"] - m["launchers"],
        "launch preparation": m["launchers"],
    }
    autograd_floor = m["empty_function"]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}",
        "layer": f"tritonbn.SyncBatchNorm({C}) on {SHAPE}, training forward+backward, launches stubbed",
        "reference_layer": f"nn.BatchNorm2d({C}) on {SHAPE}, forward+backward",
        "tritonbn_us": m["tritonbn"],
        "reference_us": m["reference"],
        "ratio": ratio,
        "ratio_per_round_quartiles": quartiles(per_round),
        "launches_per_training_pass": launches,
        "stages_us": stages,
        "autograd_floor_us": autograd_floor,
        "first_call_checks_us": m["first_call_checks"],
        "launch_us": (m["tritonbn_with_launch"] - m["tritonbn"]) / launches,
        "tritonbn_with_launch_us": m["tritonbn_with_launch"],
        "ratio_with_launch": ratio_with_launch,
        "masked_us": m["masked"],
        "masked_with_launch_us": m["masked_with_launch"],
        "binding_us_per_launch": bound_us / launches,
        "binder_only_us_per_launch": binders_us / binder_launches,
        "tritonbn_with_binding_us": m["tritonbn_bound"],
        "custom_ops_us": m["custom_ops"],
        "custom_ops_ratio": m["custom_ops"] / m["reference"],
        "eval_tritonbn_us": m["eval_tritonbn"],
        "eval_reference_us": m["eval_reference"],
        "eval_ratio": m["eval_tritonbn"] / m["eval_reference"],
        "eval_tritonbn_with_launch_us": m["eval_tritonbn_with_launch"],
        "eval_ratio_with_launch": m["eval_tritonbn_with_launch"] / m["eval_reference"],
        "launches_per_eval_pass": eval_launches,
        "launcher_detail_us": {name: med(v) for name, v in d.items()},
        "rounds": args.rounds,
        "inner": args.inner,
    }
    if not args.no_resnet:
        cases, layers, tbn_model, ref_model = resnet_cases()
        result["resnet50_launches_per_step"] = count_launches(cases["resnet50_tritonbn"][0])
        r = interleaved(cases, max(8, args.rounds // 4), 3)
        result["resnet50_bn_layers"] = layers
        result["resnet50_tritonbn_ms"] = med(r["resnet50_tritonbn"]) / 1e3
        result["resnet50_reference_ms"] = med(r["resnet50_reference"]) / 1e3
        result["resnet50_tritonbn_with_launch_ms"] = med(r["resnet50_tritonbn_with_launch"]) / 1e3
        result["resnet50_extra_us_per_layer"] = (
            (result["resnet50_tritonbn_ms"] - result["resnet50_reference_ms"]) * 1e3 / layers
        )
        result["resnet50_extra_us_per_layer_with_launch"] = (
            (result["resnet50_tritonbn_with_launch_ms"] - result["resnet50_reference_ms"]) * 1e3 / layers
        )
        result["resnet50_layer_forward_us"] = layer_forwards_in_and_out_of_the_model(
            tbn_model, ref_model, max(10, args.rounds // 2)
        )
    result["load_average"] = os.getloadavg()
    print(markdown(result))
    if args.results:
        write_section(args.results, "host-overhead", results_section(result, args.no_resnet))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    failed = False
    if args.max_ratio is not None and ratio > args.max_ratio:
        print(f"FAIL: host overhead ratio {ratio:.2f} exceeds the bound {args.max_ratio}", file=sys.stderr)
        failed = True
    if args.max_ratio_with_launch is not None and ratio_with_launch > args.max_ratio_with_launch:
        print(
            f"FAIL: host overhead ratio with the launch {ratio_with_launch:.2f} exceeds the bound "
            f"{args.max_ratio_with_launch}",
            file=sys.stderr,
        )
        failed = True
    return 1 if failed else 0


def results_section(r: dict, no_resnet: bool) -> str:
    """The RESULTS.md section (``--results``): the run, its load, the case table and the stages in one line."""
    load = ", ".join(f"{v:.1f}" for v in r["load_average"])
    cases = markdown(r).split("\n\n| stage")[0]
    stages = "; ".join(f"{name} {us:.1f}" for name, us in r["stages_us"].items())
    return (
        f"Written by `python benchmarks/host_overhead.py{' --no-resnet' if no_resnet else ''} --results ...`; "
        f"load average {load} at the end.\n\n{cases}\n\nStages of the stubbed training forward+backward, µs: "
        f"{stages} (an empty Python autograd Function: {r['autograd_floor_us']:.1f}; a new shape's checks instead "
        f"of the record's: {r['first_call_checks_us']:.1f}). Per launch: "
        f"{r['launch_us']:.1f} µs on tritonbn's direct path, {r['binding_us_per_launch']:.1f} through Triton's "
        "`JITFunction.run`.\n"
    )


def markdown(r: dict) -> str:
    total = r["tritonbn_us"]
    q1, q3 = r["ratio_per_round_quartiles"]
    n = r["launches_per_training_pass"]
    ref, eref = r["reference_us"], r["eval_reference_us"]
    lines = [
        f"Host overhead, {r['date']}; {r['machine']}. CPU time of the calling thread, median of "
        f"{r['rounds']} interleaved blocks of {r['inner']} calls. *With the launch*: tritonbn's direct launch up to "
        "the C launcher (a fake driver and kernel; the C launcher itself needs a GPU); *stubbed*: launches replaced "
        "by no-ops.",
        "",
        "| case | tritonbn µs | reference µs | ratio | launches |",
        "|---|---|---|---|---|",
        f"| training forward+backward, C={C}, with the launch | {r['tritonbn_with_launch_us']:.1f} | {ref:.1f} | "
        f"**{r['ratio_with_launch']:.2f}** | {n} |",
        f"| training forward+backward, C={C}, stubbed | {total:.1f} | {ref:.1f} | **{r['ratio']:.2f}** "
        f"(per-round quartiles {q1:.2f}–{q3:.2f}) | {n} |",
        f"| masked (a `mask=` of the batch's shape), with the launch | {r['masked_with_launch_us']:.1f} | {ref:.1f} | "
        f"{r['masked_with_launch_us'] / ref:.2f} | {n} |",
        f"| masked, stubbed | {r['masked_us']:.1f} | {ref:.1f} | {r['masked_us'] / ref:.2f} | {n} |",
        f"| the same through Triton's `JITFunction.run` (`kernel[grid](...)`, before the direct launch) | "
        f"{r['tritonbn_with_binding_us']:.1f} | {ref:.1f} | {r['tritonbn_with_binding_us'] / ref:.2f} | {n} |",
        f"| the same through the custom ops (the torch.compile path), stubbed | {r['custom_ops_us']:.1f} | "
        f"{ref:.1f} | {r['custom_ops_ratio']:.2f} | {n} |",
        f"| eval forward (no_grad), C={C}, with the launch | {r['eval_tritonbn_with_launch_us']:.1f} | {eref:.1f} | "
        f"**{r['eval_ratio_with_launch']:.2f}** | {r['launches_per_eval_pass']} |",
        f"| eval forward (no_grad), C={C}, stubbed | {r['eval_tritonbn_us']:.1f} | {eref:.1f} | "
        f"{r['eval_ratio']:.2f} | {r['launches_per_eval_pass']} |",
    ]
    if "resnet50_tritonbn_ms" in r:
        layers, rref = r["resnet50_bn_layers"], r["resnet50_reference_ms"]
        for key, how in (("resnet50_tritonbn_with_launch_ms", "with the launch"), ("resnet50_tritonbn_ms", "stubbed")):
            lines.append(
                f"| ResNet-50 topology ({layers} BN), input {RESNET_INPUT}, forward+backward, ms, {how} | "
                f"{r[key]:.2f} | {rref:.2f} | {r[key] / rref:.2f} | {r['resnet50_launches_per_step']} |"
            )
    lines += ["", "| stage (training forward+backward) | µs | share |", "|---|---|---|"]
    for name, us in r["stages_us"].items():
        lines.append(f"| {name} | {us:.1f} | {100 * us / total:.0f}% |")
        if name == "autograd":
            lines.append(
                f"| (an empty Python autograd Function, same inputs and grads) | ({r['autograd_floor_us']:.1f}) | |"
            )
    lines += [
        f"| **total (launches stubbed)** | **{total:.1f}** | 100% |",
        f"| the launch, per launch: tritonbn's direct path up to the C launcher | {r['launch_us']:.1f} | |",
        f"| Triton's `JITFunction.run` per launch, for comparison | {r['binding_us_per_launch']:.1f} | "
        f"binder alone {r['binder_only_us_per_launch']:.1f} |",
        "",
        "| launch preparation, per call, stubbed | µs |",
        "|---|---|",
    ]
    lines += [f"| {name} | {us:.1f} |" for name, us in r["launcher_detail_us"].items()]
    if "resnet50_extra_us_per_layer" in r:
        lines += [
            "",
            f"ResNet-50: tritonbn layers add {r['resnet50_extra_us_per_layer_with_launch']:.0f} µs of host time per "
            f"BN layer to a step over nn.BatchNorm2d's with the launch ({r['resnet50_extra_us_per_layer']:.0f} µs "
            "with launches stubbed).",
        ]
    if "resnet50_layer_forward_us" in r:
        f = r["resnet50_layer_forward_us"]
        lines += [
            "",
            "| one BN layer's forward, µs (mean over the 53 layers) | in the model | alone | model / alone |",
            "|---|---|---|---|",
        ]
        for name, label in (("tritonbn", "tritonbn, with the launch"), ("reference", "nn.BatchNorm2d")):
            model, alone = f[f"{name}_model"], f[f"{name}_alone"]
            lines.append(f"| {label} | {model:.1f} | {alone:.1f} | {model / alone:.2f} |")
        lines.append(
            f"| tritonbn's extra | {f['tritonbn_model'] - f['reference_model']:.1f} | "
            f"{f['tritonbn_alone'] - f['reference_alone']:.1f} | |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
