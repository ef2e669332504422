"""``tritonbn bench --model``: what tritonbn gives *your* model's BatchNorm layers.

    tritonbn bench --model mypkg.models:build_net --input 32,3,224,224 --dtype bf16 --channels-last --out DIR
    tritonbn bench --model resnet50                  # built in: ResNet-50 (torchvision's layout, no torchvision)

1. Builds the model: ``MODULE:CALLABLE`` is imported (the current directory is on the path) and
   called without arguments; it returns an ``nn.Module``. Built-in names: see
   :data:`tritonbn.cli._bench_model.BUILTIN`.
2. Runs one training forward of a random ``--input`` batch (under autocast for bf16/fp16; the model
   in channels_last with ``--channels-last``), with forward hooks that record every BatchNorm's
   input: shape, dtype and strides (the layout).
3. Times each distinct input, training forward+backward and eval, per provider, at the strides the
   model produced. On a GPU: tritonbn, ``torch.nn.SyncBatchNorm``'s synchronized path (``torch_sync``),
   and ``nn.BatchNorm*d`` (``batchnorm``: cuDNN, no synchronization). tritonbn and torch_sync both
   synchronize over a real process group of ``--world`` ranks, also at world size 1. On CPU:
   tritonbn's PyTorch backend (``tritonbn[torch]``), its Triton kernels when they run under the
   interpreter (``TRITON_INTERPRET=1``; ``tritonbn[triton]``), and ``batchnorm``.
4. Prints one table (layers and calls per step for each input, the median time per provider, the
   speedup of tritonbn over the reference provider, and the total per training step), and writes
   ``DIR/bench_model.csv`` and the bar chart ``DIR/bench_model.png`` (with matplotlib).

Times are medians of ``--reps`` timed calls (CUDA events on a GPU, the process's CPU time on CPU) after
``--warmup`` calls, the same number on every rank (the collectives must pair up). On CPU each provider is
the module a user's model runs (``tritonbn.SyncBatchNorm`` with its group resolved as the module resolves it:
no collective at world size 1; ``nn.BatchNorm*d``), eval under ``torch.no_grad()``, and on one rank the
providers are called in turn, call by call, each row with its spread (interquartile range over the median).
CPU times say nothing about a GPU: on CPU the defaults are small, to check the command and your model's shapes.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tritonbn._numerics import compute_dtype
from tritonbn.cli._bench_model import Shape, build_model, parse_input, record_shapes
from tritonbn.cli._bench_report import CPU_NOTE, report
from tritonbn.cli._spawn import process_group, spawn
from tritonbn.distributed import collective_device

TIMEOUT = datetime.timedelta(seconds=300)  # the process group's: one case may take long on CPU
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Timer:
    """Median ms of ``reps`` calls after ``warmup``: CUDA events on a GPU, CPU time on CPU; fixed counts.

    :meth:`interleaved` times several cases call by call in turn (on CPU, where other work on the machine
    moves every case's times alike), and gives each its median and spread."""

    def __init__(self, device: torch.device, warmup: int, reps: int) -> None:
        self.device, self.warmup, self.reps = device, warmup, reps

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        return statistics.median(time_ms(fn, self.device) for _ in range(self.reps))

    def interleaved(self, fns: dict, prepare=lambda name: None) -> dict:
        """``{name: (median ms, spread)}`` of the callables ``fns``, one call of each in turn per rep, each after
        ``prepare(name)`` (untimed); ``spread`` is the interquartile range over the median (0 below 4 reps)."""
        for _ in range(self.warmup):
            for name, fn in fns.items():
                prepare(name)
                fn()
        times: dict = {name: [] for name in fns}
        for _ in range(self.reps):
            for name, fn in fns.items():
                prepare(name)
                times[name].append(time_ms(fn, self.device))
        return {name: (statistics.median(t), spread(t)) for name, t in times.items()}


def spread(times: list[float]) -> float:
    """The interquartile range of ``times`` over their median (0 for fewer than 4 times)."""
    if len(times) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / statistics.median(times)


def time_ms(fn, device: torch.device) -> float:
    """One call of ``fn`` in ms: CUDA events on a GPU (the call's own stream work); on CPU the CPU time of this
    process (all its threads: time that other jobs on the machine take from it does not count)."""
    if device.type != "cuda":
        t0 = time.process_time()
        fn()
        return (time.process_time() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def providers(device: torch.device) -> tuple[list[str], str, dict[str, str]]:
    """``(providers, reference, unavailable)``: what runs here, what the speedup is over, and why others do not."""
    if device.type == "cuda":
        return ["tritonbn", "torch_sync", "batchnorm"], "torch_sync", {}
    from tritonbn.backend import interpreted

    names, missing = ["tritonbn[torch]"], {}
    if interpreted():
        names.append("tritonbn[triton]")
    else:
        missing["tritonbn[triton]"] = "the Triton kernels run on CPU only under TRITON_INTERPRET=1"
    missing["torch_sync"] = "torch.nn.SyncBatchNorm refuses CPU tensors"
    return names + ["batchnorm"], "batchnorm", missing


def _case(provider: str, s: Shape, mode: str, device: torch.device, group, world: int):
    """A closure running one training forward+backward (``mode="train"``) or one eval forward."""
    g = torch.Generator(device="cpu").manual_seed(0)
    C = s.shape[1]
    x = torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device)
    x.copy_(torch.randn(s.shape, generator=g).to(s.dtype))
    pdtype = compute_dtype(s.dtype)
    w = torch.rand(C, generator=g, dtype=pdtype).to(device).requires_grad_()
    b = torch.randn(C, generator=g, dtype=pdtype).to(device).requires_grad_()
    rm, rv = torch.zeros(C, device=device, dtype=pdtype), torch.ones(C, device=device, dtype=pdtype)
    nbt = torch.zeros((), dtype=torch.long, device=device)
    train = mode == "train"
    if device.type == "cpu":  # what a user's layer runs: the module, its group resolved (none at world size 1)
        return _module_case(provider, s, x, (w, b, rm, rv, nbt), train, group)
    if provider.startswith("tritonbn"):
        from tritonbn.functional import batch_norm

        if "[" in provider:
            os.environ["TRITONBN_BACKEND"] = provider[len("tritonbn[") : -1]
        fwd = lambda: batch_norm(x, rm, rv, w, b, train, 0.1, 1e-5, group if train else None, nbt)  # noqa: E731
    elif provider == "torch_sync" and train:
        from torch.nn.modules._functions import SyncBatchNorm as SyncFunction

        fwd = lambda: SyncFunction.apply(x, w, b, rm, rv, 1e-5, 0.1, group, world)  # noqa: E731
    else:  # batchnorm, and torch_sync in eval (nn.SyncBatchNorm's eval is F.batch_norm)
        fwd = lambda: F.batch_norm(x, rm, rv, w, b, train, 0.1, 1e-5)  # noqa: E731
    if not train:

        def run():
            with torch.no_grad():
                fwd()

        return run
    x.requires_grad_()
    dy = torch.randn_like(x)

    def run():
        x.grad = w.grad = b.grad = None
        fwd().backward(dy)

    return run


def _module_case(provider: str, s: Shape, x: torch.Tensor, state: tuple, train: bool, group):
    """:func:`_case` on CPU: ``tritonbn.SyncBatchNorm`` over ``group`` (resolved as the module resolves it: no
    collective at world size 1) against ``nn.BatchNorm*d``, each module holding the same parameters and buffers;
    train is forward+backward, eval a forward under ``torch.no_grad()`` (as a validation loop runs it)."""
    C = s.shape[1]
    if provider.startswith("tritonbn"):
        import tritonbn

        os.environ["TRITONBN_BACKEND"] = provider[len("tritonbn[") : -1]
        module = tritonbn.SyncBatchNorm(C, process_group=group, device="meta")
    else:
        module = {3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(len(s.shape), nn.BatchNorm1d)(
            C, device="meta"
        )
    w, b, rm, rv, nbt = state
    module.weight, module.bias = nn.Parameter(w.detach()), nn.Parameter(b.detach())
    module.running_mean, module.running_var, module.num_batches_tracked = rm, rv, nbt
    module.train(train)
    if not train:

        def run():
            with torch.no_grad():
                module(x)

        return run
    x.requires_grad_()
    dy = torch.randn_like(x)

    def run():
        x.grad = module.weight.grad = module.bias.grad = None
        module(x).backward(dy)

    return run


class Progress:
    """A one-line progress bar on a terminal, one line per step otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 24
        filled = width * self.done // max(self.total, 1)
        line = f"  [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {what}"
        if self.tty:
            sys.stderr.write("\r" + line[:120].ljust(120) + ("\n" if self.done == self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def measure(args, device: torch.device, rank: int, world: int) -> dict | None:
    """Record, then time every (shape, provider, mode) on this rank; rank 0 returns the results."""
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    model, gpu_input, cpu_input = build_model(args.model)
    shape = args.input or (gpu_input if device.type == "cuda" else cpu_input)
    if shape is None:
        raise ValueError(f"--model {args.model}: give the input shape with --input N,C,H,W")
    dtype = DTYPES[args.dtype]
    fmt = torch.channels_last if args.channels_last and len(shape) == 4 else torch.contiguous_format
    if args.channels_last and len(shape) == 5:
        fmt = torch.channels_last_3d
    model = model.to(device).to(memory_format=fmt) if fmt != torch.contiguous_format else model.to(device)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device).contiguous(memory_format=fmt)
    shapes = record_shapes(model, x, dtype)
    del model, x
    names, reference, missing = providers(device)
    layers = sum(len(s.layers) for s in shapes)
    say(
        f"tritonbn bench: {args.model}, input {'x'.join(map(str, shape))} {args.dtype}"
        f"{' channels_last' if fmt != torch.contiguous_format else ''}: {layers} BatchNorm layers, "
        f"{sum(s.calls for s in shapes)} calls per step, {len(shapes)} distinct inputs; "
        f"{world} rank(s) on {device.type}, providers {', '.join(names)}"
    )
    if device.type != "cuda":
        say(CPU_NOTE)
    for name, why in missing.items():
        say(f"  {name}: not measured ({why})")
    group = dist.group.WORLD
    timer = Timer(device, args.warmup, args.reps)
    deadline = time.time() + args.budget_s if args.budget_s else None
    progress = Progress(len(shapes) * len(names) * 2, rank == 0)
    backend_env = os.environ.get("TRITONBN_BACKEND")
    rows = []
    try:
        for s in shapes:
            for mode in ("train", "eval"):
                if device.type == "cpu" and world == 1:  # every provider in turn, call by call
                    rows += _interleaved_rows(names, s, mode, device, group, world, timer, deadline, backend_env)
                    for provider in names:
                        progress.step(f"{s.label} {mode} {provider}")
                    continue
                for provider in names:
                    row = _row(s, mode, provider)
                    # Every rank decides alike (rank 0's clock), so the collectives still pair up.
                    late = torch.tensor([float(deadline is not None and time.time() > deadline)])
                    if world > 1:
                        late = late.to(collective_device(dist.group.WORLD))
                        dist.broadcast(late, 0)
                    if late.item():
                        row["error"] = "skipped: time budget spent"
                    else:
                        try:
                            row["ms"] = timer(_case(provider, s, mode, device, group, world))
                        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                            if world > 1:
                                raise  # the ranks' collectives would no longer pair up
                            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        finally:
                            _restore_backend(backend_env)
                    rows.append(row)
                    progress.step(f"{s.label} {mode} {provider}")
    finally:
        _restore_backend(backend_env)
    if rank != 0:
        return None
    meta = {
        "model": args.model,
        "input": "x".join(map(str, shape)),
        "dtype": args.dtype,
        "channels_last": fmt != torch.contiguous_format,
        "world": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "reference": reference,
        "providers": names,
    }
    return {"rows": rows, "meta": meta}


def _row(s: Shape, mode: str, provider: str) -> dict:
    """A result row's description of one input, mode and provider (its figures are added to it)."""
    return {
        "shape": s.label,
        "dtype": str(s.dtype).replace("torch.", ""),
        "layout": s.layout,
        "stride": ",".join(map(str, s.stride)),
        "layers": len(s.layers),
        "calls": s.calls,
        "mode": mode,
        "provider": provider,
    }


def _interleaved_rows(names, s: Shape, mode, device, group, world, timer: Timer, deadline, backend_env) -> list:
    """The rows of one (input, mode) on one CPU rank: the providers timed in turn, call by call (:meth:`Timer.
    interleaved`), each with its median and spread; a provider that fails is recorded and left out."""
    rows, cases, envs = {}, {}, {}
    for provider in names:
        rows[provider] = _row(s, mode, provider)
        if deadline is not None and time.time() > deadline:
            rows[provider]["error"] = "skipped: time budget spent"
            continue
        try:
            fn = _case(provider, s, mode, device, group, world)
            envs[provider] = os.environ.get("TRITONBN_BACKEND")  # the backend the provider names
            fn()  # fails here, alone, rather than in the timed rounds
            cases[provider] = fn
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            rows[provider]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            _restore_backend(backend_env)
    try:
        for provider, (ms, var) in timer.interleaved(cases, lambda name: _restore_backend(envs[name])).items():
            rows[provider]["ms"], rows[provider]["spread"] = ms, var
    finally:
        _restore_backend(backend_env)
    return list(rows.values())


def _restore_backend(value: str | None) -> None:
    if value is None:
        os.environ.pop("TRITONBN_BACKEND", None)
    else:
        os.environ["TRITONBN_BACKEND"] = value


def _device_for(rank: int, cpu: bool) -> torch.device:
    return torch.device("cuda", rank) if not cpu and torch.cuda.is_available() else torch.device("cpu")


def _run_rank(rank: int, world: int, args) -> dict | None:
    result = measure(args, _device_for(rank, args.cpu), rank, world)
    if result is not None:
        report(result, args.out)
    return result


def main(args) -> int:
    """Entry point of ``tritonbn bench`` (arguments parsed by :mod:`tritonbn.cli`)."""
    if args.input is not None:
        args.input = parse_input(args.input)
    build_model(args.model)  # fail early, in this process, on a bad --model
    if args.world > 1 and not args.cpu and torch.cuda.is_available() and torch.cuda.device_count() < args.world:
        raise ValueError(f"--world {args.world} needs {args.world} GPUs, found {torch.cuda.device_count()} (or --cpu)")
    if args.world == 1:
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{os.path.join(tmp, 'init')}"
            with process_group(_device_for(0, args.cpu), TIMEOUT, init_method=init, rank=0, world_size=1):
                result = measure(args, _device_for(0, args.cpu), 0, 1)
        if result is not None:
            report(result, args.out)
    else:
        threads = max(1, (os.cpu_count() or 1) // args.world)
        spawn(
            args.world, _run_rank, args, cuda=_device_for(0, args.cpu).type == "cuda", timeout=TIMEOUT, threads=threads
        )
        result = {"rows": []}
    failed = [r for r in (result or {"rows": []})["rows"] if "error" in r and not r["error"].startswith("skipped")]
    return 1 if failed else 0
