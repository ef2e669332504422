"""Benchmark cases, byte counts and one setup factory for every provider and mode."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import tritonbn
from tritonbn.functional import batch_norm

# The BatchNorm input shapes of torchvision's ResNet-50 at a per-GPU batch of 32, (N, C, H, W).
RESNET50 = [
    (32, 64, 112, 112),
    (32, 64, 56, 56),
    (32, 128, 56, 56),
    (32, 256, 56, 56),
    (32, 128, 28, 28),
    (32, 256, 28, 28),
    (32, 512, 28, 28),
    (32, 256, 14, 14),
    (32, 512, 14, 14),
    (32, 1024, 14, 14),
    (32, 512, 7, 7),
    (32, 2048, 7, 7),
]
# Small to large activations at a fixed channel count.
SWEEP = [(32, 64, s, s) for s in (8, 16, 32, 64, 128, 256)]
# Fused epilogue act(bn(x) + residual): ResNet-50 shapes where a residual add and ReLU follow BN.
EPILOGUE = [(32, 256, 56, 56), (32, 512, 28, 28), (32, 1024, 14, 14), (32, 2048, 7, 7)]
# CPU smoke sizes: the same kinds of shape, small enough for the interpreter.
SMOKE_RESNET = [(2, 16, 14, 14), (2, 64, 7, 7), (2, 256, 2, 2)]
SMOKE_SWEEP = [(2, 8, s, s) for s in (4, 8, 16)]
SMOKE_EPILOGUE = [(2, 16, 7, 7)]

MODES = ("forward", "forward_backward", "eval")
LAYOUTS = ("contiguous", "channels_last")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bytes_per_pass(shape, dtype: torch.dtype, mode: str, epilogue: bool = False) -> int:
    """The activation traffic a pass cannot avoid, the same for every provider.

    forward (training): read x for the statistics, read x and write y to normalize: 3 tensors.
    backward: read dy and x to reduce, read dy and x and write dx: 5 more.
    eval: read x, write y: 2.
    With the epilogue relu(bn(x) + r): the forward also reads r (4); the backward reads y for the
    ReLU mask in both passes and writes dr (4 more than plain: 12 for forward+backward; eval 3).
    """
    numel = 1
    for d in shape:
        numel *= d
    if epilogue:
        tensors = {"forward": 4, "forward_backward": 12, "eval": 3}[mode]
    else:
        tensors = {"forward": 3, "forward_backward": 8, "eval": 2}[mode]
    return tensors * numel * dtype.itemsize


def collective_bytes(C: int, world: int) -> dict[str, int]:
    """Bytes each rank sends into the collectives of one training step (forward and backward)."""
    return {
        "tritonbn_forward": (2 * C + 1) * 8,  # all_reduce of [sum x (C) | sum x^2 (C) | count] in fp64
        "tritonbn_backward": 2 * C * 4,  # all_reduce of [sum dy | sum dy*xhat] in fp32
        "torch_forward": world * (2 * C + 1) * 4,  # all_gather of (mean, invstd, count) from every rank
        "torch_backward": 2 * C * 4,  # all_reduce of [sum dy | sum dy*xmu]
    }


TRITONBN_PROVIDERS = ("tritonbn", "tritonbn_local", "tritonbn_torch")


@dataclass
class Setup:
    run: callable  # one pass
    reset: callable  # between passes (clears grads)


def make(provider: str, shape, layout: str, dtype: torch.dtype, mode: str, device, group, epilogue=False) -> Setup:
    """The one setup factory: inputs for ``shape`` and a callable running ``mode`` with ``provider``.

    With ``epilogue`` every provider computes ``relu(bn(x) + r)``: tritonbn fused in its kernels,
    the others as batch norm followed by a separate add and ReLU.

    Providers: ``tritonbn`` (the kernels, synchronizing over a real one-rank group), ``tritonbn_local``
    (the kernels at world size 1: no collective, the path compared with cuDNN), ``tritonbn_torch``
    (tritonbn's PyTorch backend), ``torch_sync`` (``torch.nn.SyncBatchNorm``'s synchronized autograd
    Function, with the same group, not its world-size-1 shortcut), ``cudnn`` (``F.batch_norm``:
    cuDNN on GPU, ATen on CPU; the single-device floor).
    """
    torch.manual_seed(0)
    C = shape[1]
    x = torch.randn(shape, device=device).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    training = mode != "eval"
    backward = mode == "forward_backward"
    x.requires_grad_(backward)
    weight = torch.rand(C, device=device, requires_grad=backward)
    bias = torch.randn(C, device=device, requires_grad=backward)
    rm, rv = torch.zeros(C, device=device), torch.ones(C, device=device)
    nbt = torch.zeros((), dtype=torch.long, device=device)
    dy = torch.randn_like(x) if backward else None
    r = torch.randn_like(x).requires_grad_(backward) if epilogue else None

    ours = provider in TRITONBN_PROVIDERS
    if ours:
        sync_group = group if training and provider != "tritonbn_local" else None
        fused = {"residual": r, "activation": "relu"} if epilogue else {}

        def forward():
            return batch_norm(x, rm, rv, weight, bias, training, 0.1, 1e-5, sync_group, nbt, **fused)
    elif provider == "torch_sync":
        from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNorm

        def forward():
            if not training:  # torch.nn.SyncBatchNorm evaluates with F.batch_norm
                return F.batch_norm(x, rm, rv, weight, bias, False, 0.1, 1e-5)
            return TorchSyncBatchNorm.apply(x, weight, bias, rm, rv, 1e-5, 0.1, group, 1)
    elif provider == "cudnn":

        def forward():
            return F.batch_norm(x, rm, rv, weight, bias, training, 0.1, 1e-5)
    else:
        raise ValueError(provider)

    def run():
        y = forward()
        if epilogue and not ours:
            y = torch.relu(y + r)
        if backward:
            y.backward(dy)
        return y

    def reset():
        for t in (x, weight, bias, r):
            if t is not None:
                t.grad = None

    return Setup(run, reset)


def provider_env(provider: str):
    """Environment a provider runs under (the torch backend is chosen by TRITONBN_BACKEND)."""
    return {"TRITONBN_BACKEND": "torch" if provider == "tritonbn_torch" else "auto"}


def time_cpu(fn, reset, reps: int = 3) -> list[float]:
    """Wall-clock milliseconds of ``reps`` calls (CPU: nothing runs asynchronously)."""
    times = []
    for _ in range(reps):
        reset()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def quantiles(times: list[float]) -> tuple[float, float, float]:
    if len(times) < 3:
        m = statistics.median(times)
        return m, m, m
    q = statistics.quantiles(times, n=10)
    return statistics.median(times), q[1], q[7]


def versions() -> dict[str, str]:
    import triton

    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tritonbn": tritonbn.__version__,
        "interpreter": os.environ.get("TRITON_INTERPRET", "0"),
    }
