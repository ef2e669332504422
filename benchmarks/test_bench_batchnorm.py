"""tritonbn against torch.nn.SyncBatchNorm's synchronized path and cuDNN.

    pytest benchmarks --benchmark-json results.json
    python benchmarks/report.py results.json --out DIR

On a GPU (``TRITONBN_TEST_DEVICE=cuda``) each case is timed with ``triton.testing.do_bench``
(median of CUDA-event timings, L2 flushed), and ``extra_info`` records GB/s from an explicit byte
count, that as a % of the copy bandwidth measured in the same run, peak memory, kernel launches per
pass (profiler), and the collective bytes per step at several world sizes. On CPU the suite is a
smoke run at small sizes under the Triton interpreter, with no timing assertions.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
from cases import (
    DTYPES,
    EPILOGUE,
    LAYOUTS,
    MODES,
    RESNET50,
    SMOKE_EPILOGUE,
    SMOKE_RESNET,
    SMOKE_SWEEP,
    SWEEP,
    bytes_per_pass,
    collective_bytes,
    make,
    provider_env,
    quantiles,
    time_cpu,
    versions,
)

GPU = os.environ.get("TRITONBN_TEST_DEVICE", "cpu") == "cuda"
PROVIDERS = ["tritonbn", "tritonbn_local", "torch_sync", "cudnn"] + ([] if GPU else ["tritonbn_torch"])


def _cases():
    resnet, sweep, epilogue = (RESNET50, SWEEP, EPILOGUE) if GPU else (SMOKE_RESNET, SMOKE_SWEEP, SMOKE_EPILOGUE)
    for shape in resnet:
        for layout in LAYOUTS:
            for dtype in DTYPES:
                for mode in MODES:
                    yield pytest.param(
                        "resnet50", shape, layout, dtype, mode, id=f"resnet50-{shape}-{layout}-{dtype}-{mode}"
                    )
    for shape in sweep:
        for layout in LAYOUTS:
            for mode in MODES:
                yield pytest.param("sweep", shape, layout, "bf16", mode, id=f"sweep-{shape}-{layout}-bf16-{mode}")
    for shape in epilogue:  # relu(bn(x) + r): fused in tritonbn, separate ops for the others
        for mode in ("forward", "forward_backward"):
            case_id = f"epilogue-{shape}-channels_last-bf16-{mode}"
            yield pytest.param("epilogue", shape, "channels_last", "bf16", mode, id=case_id)


@pytest.fixture(scope="session")
def copy_gbps(device):
    """Device copy bandwidth measured in this run: read + write of a large buffer."""
    if device.type == "cuda":
        import triton.testing

        src = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), quantiles=[0.5])[0]
        return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
    src = torch.empty(1 << 24, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = min(time_cpu(lambda: dst.copy_(src), lambda: None, reps=5))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def _launches(setup, device, provider):
    """Kernel launches of one pass: CUDA kernels in the profiler, or interpreted Triton kernels on CPU."""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        setup.reset()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            setup.run()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    if provider not in ("tritonbn", "tritonbn_local"):
        return None  # CPU ops launch no kernels to count
    from triton.runtime.interpreter import InterpretedFunction

    count = 0
    original = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        nonlocal count
        count += 1
        return original(self, *args, **kwargs)

    InterpretedFunction.run = counting
    try:
        setup.reset()
        setup.run()
    finally:
        InterpretedFunction.run = original
    return count


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("suite, shape, layout, dtype, mode", list(_cases()))
def test_batchnorm(
    benchmark, monkeypatch, device, process_group, copy_gbps, provider, suite, shape, layout, dtype, mode
):
    if provider == "torch_sync" and device.type != "cuda" and mode != "eval":
        pytest.skip("torch.nn.SyncBatchNorm's synchronized path refuses CPU tensors")
    for key, value in provider_env(provider).items():
        monkeypatch.setenv(key, value)
    torch_dtype = DTYPES[dtype]
    epilogue = suite == "epilogue"
    setup = make(provider, shape, layout, torch_dtype, mode, device, process_group, epilogue)
    setup.reset()
    setup.run()  # warm-up: compiles kernels, checks the provider runs

    if device.type == "cuda":
        import triton.testing

        def timed():
            setup.reset()
            setup.run()

        median, q20, q80 = triton.testing.do_bench(timed, warmup=10, rep=40, quantiles=[0.5, 0.2, 0.8])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        timed()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        benchmark.pedantic(lambda: (timed(), torch.cuda.synchronize()), rounds=5, iterations=1)
    else:
        median, q20, q80 = quantiles(time_cpu(setup.run, setup.reset))
        peak = None
        benchmark.pedantic(setup.run, setup=setup.reset, rounds=1, iterations=1)

    nbytes = bytes_per_pass(shape, torch_dtype, mode, epilogue)
    gbps = nbytes / (median * 1e-3) / 1e9
    benchmark.extra_info.update(
        {
            "suite": suite,
            "provider": provider,
            "shape": list(shape),
            "layout": layout,
            "dtype": dtype,
            "mode": mode,
            "median_ms": median,
            "q20_ms": q20,
            "q80_ms": q80,
            "bytes": nbytes,
            "gbps": gbps,
            "copy_gbps": copy_gbps,
            "pct_of_copy": 100.0 * gbps / copy_gbps,
            "peak_memory_bytes": peak,
            "launches": _launches(setup, device, provider),
            "collective_bytes": {w: collective_bytes(shape[1], w) for w in (2, 8, 64)} if mode != "eval" else None,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
            "date": datetime.date.today().isoformat(),
            **versions(),
            "backend_env": os.environ.get("TRITONBN_BACKEND", "auto"),
        }
    )
