"""One row of the compatibility table: what a new user on this torch/Triton pair tries, column by column.

    python scripts/compat_smoke.py [--columns import,torch,interpreter,...] [--markdown]

Each column runs in its own subprocess (the interpreter must be chosen before triton is imported) and
prints ``ok`` or ``FAIL: <the last line of its error>``. The oracle is torch's own ``batch_norm`` in float64:
a model converted with ``tritonbn.convert_sync_batchnorm`` is trained one step and evaluated beside a
float64 copy that keeps ``nn.BatchNorm2d``; outputs, gradients, the updated parameters and the running
statistics must agree. Columns:

* ``import``: ``import tritonbn`` and the versions;
* ``torch``: the PyTorch backend (``TRITONBN_BACKEND=torch``), and a layer converted to bfloat16 trained one step
  (16-bit parameters and buffers: torch's mixed-type kernel over float32 copies, ``torch._foreach_copy_`` back);
* ``interpreter``: the Triton kernels under the interpreter (``TRITON_INTERPRET=1``, ``TRITONBN_BACKEND=triton``);
* ``aot``: every kernel compiled for sm_90 without a GPU (``tests/helpers/aot_compile.py --quick``, or with
  ``--aot smoke`` each kernel once per plan: the oldest pair's smoke in CI, whose sweep compiles the rest);
* ``direct``: the direct launch against Triton's own ``JITFunction.run`` over a fake driver
  (``tests/helpers/launch_check.py``: no mismatch, and launches taking the direct path);
* ``sync2``: two gloo ranks under the interpreter, each with half of the batch, against the oracle on the
  whole batch (outputs, input gradients, all-reduced weight and bias gradients);
* ``compile``: ``torch.compile(fullgraph=True)`` of the converted model, trained one step at world size 1 (no
  process group) and evaluated, on the PyTorch backend and on the kernels under the interpreter: a backend
  that records the FX graphs, then runs ``aot_eager``, must find tritonbn's custom op
  (``tritonbn::batch_norm_forward``) in the training graph and no other ``batch_norm``, and a tritonbn warning
  (such as the one an export in training gives) is an error. A compile taken for an export fails it (issue 40).

Exits 1 when a column fails.
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLUMNS = ("import", "torch", "interpreter", "aot", "direct", "sync2", "compile")
TITLES = {"import": "import", "torch": "PyTorch backend", "interpreter": "kernels, interpreter",
          "aot": "compiled for sm_90", "direct": "direct launch (fake driver)", "sync2": "2-rank sync, interpreter",
          "compile": "`torch.compile` (fullgraph, training)"}  # fmt: skip
ENVS = {"torch": {"TRITONBN_BACKEND": "torch", "TRITON_INTERPRET": "0"},
        "interpreter": {"TRITONBN_BACKEND": "triton", "TRITON_INTERPRET": "1"},
        "sync2": {"TRITONBN_BACKEND": "triton", "TRITON_INTERPRET": "1"},
        "compile": {"TRITONBN_BACKEND": "triton", "TRITON_INTERPRET": "1"}}  # fmt: skip


def _close(name: str, a, b, tol: float = 1e-9) -> None:
    import torch

    a, b = a.double(), b.double()
    if not torch.allclose(a, b, rtol=tol, atol=tol):
        raise AssertionError(f"{name}: off by {(a - b).abs().max().item():.3g}")


def _models():
    import torch
    from torch import nn

    import tritonbn

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    reference = reference.double()
    with torch.no_grad():  # weights and bias away from 1 and 0
        reference[1].weight.uniform_(0.5, 1.5)
        reference[1].bias.uniform_(-0.5, 0.5)
    model = tritonbn.convert_sync_batchnorm(copy.deepcopy(reference))
    # converted: tritonbn's layer, and still an instance of the class it replaced
    assert isinstance(model[1], tritonbn.SyncBatchNorm) and isinstance(model[1], torch.nn.BatchNorm2d), type(model[1])
    return reference, model


def train_and_eval(compile_backend=None) -> None:
    """One SGD step and an eval forward of the converted model beside the reference (float64).

    ``compile_backend``: run the converted model through ``torch.compile(fullgraph=True)`` with that backend.
    """
    import torch

    reference, model = _models()
    run = torch.compile(model, backend=compile_backend, fullgraph=True) if compile_backend is not None else model
    x = torch.randn(4, 3, 6, 5, dtype=torch.float64)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = []
    for net, inp in zip((reference, run), xs, strict=True):
        net.train()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        out = net(inp)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        opt.step()
        outs.append(out)
    _close("training output", outs[1], outs[0])
    _close("input gradient", xs[1].grad, xs[0].grad)
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        _close(f"{name} after the step", q, p)
    _close("running mean", model[1].running_mean, reference[1].running_mean)
    _close("running var", model[1].running_var, reference[1].running_var)
    reference.eval()
    run.eval()
    with torch.no_grad():
        _close("eval output", run(x), reference(x))


def bf16_layer_step() -> None:
    """A layer converted with ``.to(torch.bfloat16)``: one training step against ``nn.BatchNorm2d`` in float64 over the
    same bf16 values, to bf16's rounding (the output, the input and parameter gradients, the running statistics)."""
    import torch

    import tritonbn

    torch.manual_seed(1)
    layer, reference = tritonbn.SyncBatchNorm(4).to(torch.bfloat16), torch.nn.BatchNorm2d(4).double()
    x = (torch.randn(5, 4, 3, 7) * 3 + 2).to(torch.bfloat16)
    dy = torch.randn(5, 4, 3, 7).to(torch.bfloat16)
    xs = [x.clone().requires_grad_(), x.double().requires_grad_()]
    outs = [net(inp) for net, inp in zip((layer, reference), xs, strict=True)]
    for out in outs:
        out.backward(dy.to(out.dtype))
    _close("bf16 output", outs[0], outs[1], tol=2e-2)
    _close("bf16 input gradient", xs[0].grad, xs[1].grad, tol=5e-2)
    _close("bf16 weight gradient", layer.weight.grad, reference.weight.grad, tol=5e-2)
    _close("bf16 running mean", layer.running_mean, reference.running_mean, tol=8e-3)
    _close("bf16 running var", layer.running_var, reference.running_var, tol=8e-3)
    assert layer.running_mean.dtype == layer.weight.grad.dtype == torch.bfloat16


def _target_name(target) -> str:
    """An FX node's target by name: ``tritonbn.batch_norm_forward`` (an op), ``torch.nn.functional.batch_norm``."""
    if type(target).__module__ == "torch._ops" or not hasattr(target, "__name__"):  # ops and higher-order ops
        return str(target)
    return f"{getattr(target, '__module__', None) or ''}.{getattr(target, '__qualname__', target.__name__)}"


def compiled_train_and_eval() -> None:
    """The ``compile`` column: a fullgraph compile in training at world size 1 keeps tritonbn's path, on both backends.

    Run with ``TRITON_INTERPRET=1``: ``TRITONBN_BACKEND`` is read on every call, so one process runs both.
    """
    import warnings

    import torch
    import torch.distributed as dist
    from torch._dynamo.backends.registry import lookup_backend

    assert not (dist.is_available() and dist.is_initialized()), "the column runs at world size 1, with no group"
    warnings.filterwarnings("error", message="tritonbn")  # e.g. "... becomes torch's batch_norm when exported"
    for backend in ("torch", "triton"):
        os.environ["TRITONBN_BACKEND"] = backend
        torch._dynamo.reset()
        graphs = []

        def record(gm, example_inputs, graphs=graphs):
            modules = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]  # nested: autograd.Function
            graphs.append([_target_name(n.target) for m in modules for n in m.graph.nodes if n.op == "call_function"])
            return lookup_backend("aot_eager")(gm, example_inputs)

        train_and_eval(compile_backend=record)
        assert graphs, f"{backend}: torch.compile traced no graph"
        training = graphs[0]  # the first call is in training; the eval call recompiles
        assert "tritonbn.batch_norm_forward" in training, f"{backend}: tritonbn's op is not in the graph: {training}"
        other = sorted({t for g in graphs for t in g if "batch_norm" in t and not t.startswith("tritonbn.")})
        assert not other, f"{backend}: the compiled graph holds {other}: the call was lowered as for an export"


def _rank(rank: int, world: int, x, dy) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import tritonbn

    torch.manual_seed(0)
    bn = tritonbn.SyncBatchNorm(x.shape[1]).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    weight, bias = bn.weight.detach().clone().requires_grad_(), bn.bias.detach().clone().requires_grad_()
    whole = x.clone().requires_grad_()
    expected = F.batch_norm(whole, None, None, weight, bias, training=True)  # the oracle on the whole batch
    expected.backward(dy)
    part = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
    mine = x[part].clone().requires_grad_()
    y = bn(mine)
    y.backward(dy[part])
    _close("output", y, expected[part])
    _close("input gradient", mine.grad, whole.grad[part])
    grads = (("weight gradient", bn.weight.grad, weight.grad), ("bias gradient", bn.bias.grad, bias.grad))
    for name, got, want in grads:
        dist.all_reduce(got)
        _close(name, got, want)


def sync2() -> None:
    import torch

    from tritonbn.cli._spawn import spawn

    torch.manual_seed(1)
    x = torch.randn(6, 3, 4, 5, dtype=torch.float64)
    dy = torch.randn_like(x)
    spawn(2, _rank, x, dy)


def run_column(name: str) -> None:
    """Run one column in this process (its environment already set)."""
    if name == "import":
        import torch
        import triton

        import tritonbn

        print(f"torch {torch.__version__}, triton {triton.__version__}, tritonbn {tritonbn.__version__}")
    elif name in ("torch", "interpreter"):
        train_and_eval()
        if name == "torch":
            bf16_layer_step()
        import tritonbn

        x = __import__("torch").zeros(2, 3, 1, 1)
        want = "torch" if name == "torch" else "triton"
        assert tritonbn.backend.name_for(x) == want, tritonbn.backend.name_for(x)
    elif name == "compile":
        compiled_train_and_eval()
    elif name == "sync2":
        sync2()
    else:
        raise ValueError(name)


def _subprocess(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def column(name: str, timeout: int = 900, aot: str = "quick") -> str:
    """``ok`` or ``FAIL: why`` for one column, run in a subprocess of this interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONBN_BACKEND")}
    env.update(ENVS.get(name, {}))
    env.setdefault("PYTHONWARNINGS", "ignore")
    if name == "aot":
        cmd = [sys.executable, str(ROOT / "tests/helpers/aot_compile.py"), f"--{aot}"]
    elif name == "direct":
        cmd = [sys.executable, str(ROOT / "tests/helpers/launch_check.py")]
    else:
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--in-process", name]
    try:
        result = _subprocess(cmd, env, timeout)
    except subprocess.TimeoutExpired:
        return f"FAIL: timed out after {timeout} s"
    if result.returncode != 0:
        lines = [line for line in (result.stderr + result.stdout).strip().splitlines() if line.strip()]
        return "FAIL: " + (lines[-1][:200] if lines else f"exit {result.returncode}")
    if name == "direct":
        import json

        report = json.loads(result.stdout)
        if report["mismatch_count"] or not report["direct"] or not report["hooks_take_tritons_path"]:
            return f"FAIL: {report['mismatch_count']} mismatches, {report['direct']} direct launches"
        return f"ok ({report['direct']}/{report['launches']} direct)"
    return "ok"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--columns", default=",".join(COLUMNS), help=f"comma-separated, of {', '.join(COLUMNS)}")
    parser.add_argument("--markdown", action="store_true", help="print one Markdown table row")
    parser.add_argument("--aot", choices=("quick", "smoke"), default="quick", help="the aot column's compiles")
    parser.add_argument("--in-process", metavar="COLUMN", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_process:
        try:
            run_column(args.in_process)
        except Exception as error:  # the traceback, then one line for the table: the error's first line
            import traceback

            traceback.print_exc()
            first = (str(error).strip().splitlines() or [""])[0]
            print(f"{type(error).__name__}: {first}", file=sys.stderr)
            return 1
        return 0
    import importlib.metadata as md

    columns = [c for c in args.columns.split(",") if c]
    unknown = set(columns) - set(COLUMNS)
    if unknown:
        parser.error(f"unknown columns {sorted(unknown)}")
    versions = {p: md.version(p) for p in ("torch", "triton", "numpy")}
    results = {}
    for name in columns:
        results[name] = column(name, aot=args.aot)
        if not args.markdown:
            print(f"{TITLES[name]}: {results[name]}", flush=True)
    if args.markdown:
        cells = [versions["torch"], versions["triton"], versions["numpy"]] + [results[c] for c in columns]
        print("| " + " | ".join(cells) + " |")
    return 1 if any(r.startswith("FAIL") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
