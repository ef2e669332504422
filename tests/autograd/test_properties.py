"""Property-based tests: random shapes, layouts, dtypes, offsets, scales and world sizes.

World sizes above 1 are emulated in one process with the launchers themselves: each rank's local
statistics are summed, exactly what the one all-reduce does, and every rank then normalizes and
back-propagates with the summed buffers. (Real multi-rank runs are in test_sync.py.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist import backend_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import TOLERANCES, make_layout

from tritonbn import backend


@st.composite
def problems(draw):
    world = draw(st.integers(1, 3))
    ndim = draw(st.integers(2, 5))
    C = draw(st.integers(1, 9))
    spatial = [draw(st.integers(1, 5)) for _ in range(ndim - 2)]
    sizes = [draw(st.integers(0, 4)) for _ in range(world)]
    per_sample = 1
    for s in spatial:
        per_sample *= s
    if sum(sizes) * per_sample < 2:
        sizes[0] = 2
    layouts = ["contiguous", "permuted"] + (["channels_last"] if ndim in (4, 5) else [])
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    ratio = 1e3 if dtype == torch.float32 else 4.0  # |offset| / scale the dtype can still resolve
    scale = draw(st.floats(1e-2, 1e2))
    offset = draw(st.floats(-ratio, ratio)) * scale
    return {
        "world": world,
        "tail": (C, *spatial),
        "sizes": sizes,
        "layout": draw(st.sampled_from(layouts)),
        "dtype": dtype,
        "scale": scale,
        "offset": offset,
        "backend": draw(st.sampled_from(["triton", "torch"])),
        "momentum": draw(st.sampled_from([0.1, None])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_problems_match_the_oracle(p):
    with backend_env(p["backend"]):  # hypothesis draws the backend; monkeypatch is per test, not per example
        _check(p)


def _check(p):
    g = torch.Generator().manual_seed(p["seed"])
    C, dtype = p["tail"][0], p["dtype"]
    n = sum(p["sizes"])
    device = torch.empty(0).device  # the default device (CPU, or CUDA in the GPU check)
    x = (torch.randn((n, *p["tail"]), generator=g, device="cpu") * p["scale"] + p["offset"]).to(device, dtype)
    dy = torch.randn((n, *p["tail"]), generator=g, device="cpu").to(device, dtype)
    w = (torch.rand(C, generator=g, device="cpu") + 0.5).to(device)
    b = torch.randn(C, generator=g, device="cpu").to(device)
    ops = backend.ops_for(x)
    assert backend.name_for(x) == p["backend"]

    bounds = [sum(p["sizes"][:r]) for r in range(p["world"] + 1)]
    xs = [make_layout(x[lo:hi], p["layout"]) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    dys = [make_layout(dy[lo:hi], p["layout"]) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    stats = sum(ops.batch_norm_stats(xr) for xr in xs)  # the forward all-reduce
    outs, buffers = [], []
    for xr in xs:
        rm, rv, nbt = torch.zeros(C), torch.ones(C), torch.tensor(3)
        y, mean, invstd = ops.batch_norm_elemt(
            xr, w, b, stats=stats, running_mean=rm, running_var=rv, num_batches_tracked=nbt, momentum=p["momentum"]
        )
        assert y.stride() == xr.stride()
        outs.append((y, mean, invstd))
        buffers.append((rm, rv, nbt))
    reduced = [ops.batch_norm_backward_reduce(dyr, xr, o[1], o[2], w) for dyr, xr, o in zip(dys, xs, outs, strict=True)]
    sums = sum(r[0] for r in reduced)  # the backward all-reduce
    dxs = [
        ops.batch_norm_backward_elemt(dyr, xr, o[1], o[2], w, sums, stats[-1:])
        for dyr, xr, o in zip(dys, xs, outs, strict=True)
    ]

    xd = x.double().requires_grad_()
    wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
    rm_ref, rv_ref = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    factor = 0.25 if p["momentum"] is None else p["momentum"]  # cumulative: 1 / (3 + 1)
    y_ref = F.batch_norm(xd, rm_ref, rv_ref, wd, bd, True, factor, 1e-5)
    y_ref.backward(dy.double())

    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(torch.cat([o[0] for o in outs]).double(), y_ref.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(torch.cat(dxs).double(), xd.grad, atol=4 * atol, rtol=4 * rtol)
    gw = sum(r[1] for r in reduced).double()
    gb = sum(r[2] for r in reduced).double()
    grad_tol = 10 * atol * max(1.0, float(n * x[0, 0].numel()) ** 0.5)
    torch.testing.assert_close(gw, wd.grad, atol=grad_tol, rtol=10 * rtol)
    torch.testing.assert_close(gb, bd.grad, atol=grad_tol, rtol=10 * rtol)
    for rm, rv, nbt in buffers:
        assert torch.equal(rm, buffers[0][0]) and torch.equal(rv, buffers[0][1])
        assert nbt.item() == 4
        torch.testing.assert_close(rm.double(), rm_ref, atol=1e-5 * (1 + abs(p["offset"])), rtol=1e-5)
        torch.testing.assert_close(rv.double(), rv_ref, atol=1e-5, rtol=1e-4)
