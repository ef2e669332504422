"""Epilogues on the PyTorch backend at world size 1 (tritonbn/backends/torch/local.py, plain.py, masked.py).

A layer with a residual, relu, leaky_relu (either sign of slope) or silu takes the local path, in both of its
forms (an eager call records torch's own ops; the Function over ``local.forward`` / ``local.backward``, which
the custom ops run under torch.compile), and keeps the float64 oracle (``F.batch_norm``, then the ops): the
output, every gradient (input, weight, bias, residual), the running statistics, both layouts, float32 and
bfloat16, and float32 precision at ``|mean| / std = 1e3``. Eager and compiled (aot_eager) calls agree bitwise.
A 16-bit layer with a residual and relu or leaky_relu keeps its forward on the packed path (``z`` in float32);
its backward, read from the kept output, is local. A mask does not take the local path (torch's kernels count
every position): the masked launchers run, with no collective, and hand their zeroed copies and ``dz`` on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import PARAM_GRAD_TOL, TOLERANCES, make_layout

import tritonbn
import tritonbn.backends.torch as tb
from tritonbn._core import passes, recompute
from tritonbn._core.call import kept as kept_for_backward
from tritonbn.backends.torch import local, masked, plain

C = 5
SHAPE = (6, C, 3, 7)
# (activation, negative_slope, residual): every epilogue, leaky_relu with a slope of each sign
EPILOGUES = [
    ("relu", 0.01, False),
    ("leaky_relu", 0.2, False),
    ("leaky_relu", -0.5, False),
    ("silu", 0.01, False),
    (None, 0.01, True),
    ("relu", 0.01, True),
    ("leaky_relu", 0.2, True),
    ("leaky_relu", -0.5, True),
    ("silu", 0.01, True),
]
IDS = [f"{a}{'' if a != 'leaky_relu' else f'({s})'}{'+residual' if r else ''}" for a, s, r in EPILOGUES]
LAYOUTS = ["contiguous", "channels_last"]
DTYPES = [torch.float32, torch.bfloat16]


def _data(dtype, layout, offset=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g, dtype=torch.float64) * 2 + offset
    r, dy = torch.randn(SHAPE, generator=g, dtype=torch.float64), torch.randn(SHAPE, generator=g, dtype=torch.float64)
    w, b = torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g)
    return *(make_layout(t, layout).to(dtype) for t in (x, r, dy)), w, b


def _layer(activation, slope, w, b, dtype):
    bn = tritonbn.SyncBatchNorm(C, activation=activation, negative_slope=slope)
    with torch.no_grad():
        bn.weight.copy_(w)
        bn.bias.copy_(b)
    return bn.to(dtype)


def _act(z, activation, slope):
    if activation == "relu":
        return F.relu(z)
    if activation == "leaky_relu":
        return F.leaky_relu(z, slope)
    return F.silu(z) if activation == "silu" else z


def _oracle(bn, x, r, dy, activation, slope):
    """``(y, dx, dw, db, dr, running_mean, running_var)`` of ``act(F.batch_norm(x) + r)`` in float64."""
    x64 = x.detach().double().requires_grad_()
    r64 = r.detach().double().requires_grad_() if r is not None else None
    w, b = (p.detach().double().requires_grad_() for p in (bn.weight, bn.bias))
    rm, rv = bn.running_mean.double().clone(), bn.running_var.double().clone()
    z = F.batch_norm(x64, rm, rv, w, b, True, bn.momentum, bn.eps)
    y = _act(z + r64 if r64 is not None else z, activation, slope)
    y.backward(dy.double())
    return y.detach(), x64.grad, w.grad, b.grad, r64.grad if r64 is not None else None, rm, rv


def _step(bn, x, r, dy):
    x = x.clone().requires_grad_()
    r = r.clone().requires_grad_() if r is not None else None
    y = bn(x) if r is None else bn(x, r)
    y.backward(dy)
    return y, x, r


def _close(actual, expected, tol, what):
    torch.testing.assert_close(actual.double(), expected, atol=tol[0], rtol=tol[1], msg=lambda m: f"{what}: {m}")


def _expected_calls(form, activation, slope, residual, dtype):
    """What a training step takes: the local path in the asked form, except a 16-bit residual + relu/leaky_relu,
    whose forward is packed (both forms decline it) and whose backward is local where it reads act'(z) from the
    kept output (relu, leaky_relu with a slope >= 0), and packed where it would make z again (a negative slope)."""
    if residual and dtype != torch.float32 and activation in ("relu", "leaky_relu"):
        from_output = activation == "relu" or slope >= 0
        return {"autograd": 0, "forward": 0, "backward": int(from_output),
                "declined": 1 + (form == "autograd") + (not from_output)}  # fmt: skip
    if form == "autograd":
        return {"autograd": 1, "forward": 0, "backward": 0, "declined": 0}
    return {"autograd": 0, "forward": 1, "backward": 1, "declined": 0}


@pytest.mark.parametrize("form", ["autograd", "function"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation, slope, residual", EPILOGUES, ids=IDS)
def test_epilogue_takes_the_local_path_and_matches_the_oracle(calls, form, activation, slope, residual, layout, dtype):
    x, r, dy, w, b = _data(dtype, layout)
    r = r if residual else None
    bn = _layer(activation, slope, w, b, dtype)
    want = _oracle(bn, x, r, dy, activation, slope)
    y, xg, rg = _step(bn, x, r, dy)
    assert calls == _expected_calls(form, activation, slope, residual, dtype)
    tol, ptol = TOLERANCES[dtype], PARAM_GRAD_TOL[dtype]
    _close(y, want[0], tol, "y")
    _close(xg.grad, want[1], (4 * tol[0], 4 * tol[1]), "dx")
    _close(bn.weight.grad, want[2], ptol, "dweight")
    _close(bn.bias.grad, want[3], ptol, "dbias")
    if residual:
        _close(rg.grad, want[4], tol, "dresidual")
    stats_tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)  # 16-bit buffers round to 16 bits
    _close(bn.running_mean, want[5], stats_tol, "running_mean")
    _close(bn.running_var, want[6], stats_tol, "running_var")
    assert bn.num_batches_tracked.item() == 1
    assert y.stride() == xg.stride() and y.dtype == dtype


@pytest.mark.parametrize("form", ["autograd", "function"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation, slope, residual", EPILOGUES, ids=IDS)
def test_large_mean_keeps_precision(calls, form, activation, slope, residual, layout):
    """|mean| / std = 1e3 (x = 1e3 + 0.5 N(0, 1)) in float32: the epilogue runs on the shifted copy's output."""
    g = torch.Generator().manual_seed(3)
    x64 = torch.randn(SHAPE, generator=g, dtype=torch.float64) * 0.5 + 1e3
    x, r, dy, w, b = _data(torch.float32, layout, seed=4)
    x = make_layout(x64, layout).float()
    r = r if residual else None
    bn = _layer(activation, slope, w, b, torch.float32)
    want = _oracle(bn, x, r, dy, activation, slope)
    y, xg, rg = _step(bn, x, r, dy)
    assert calls == _expected_calls(form, activation, slope, residual, torch.float32)
    _close(y, want[0], (1e-5, 1e-5), "y")
    _close(xg.grad, want[1], (1e-4, 1e-4), "dx")
    _close(bn.weight.grad, want[2], (1e-4, 1e-5), "dweight")
    if residual:
        _close(rg.grad, want[4], (1e-5, 1e-5), "dresidual")
    _close(bn.running_mean, want[5], (1e-5, 1e-5), "running_mean")
    _close(bn.running_var, want[6], (1e-5, 1e-5), "running_var")


def _two_steps(bn, x, r, dy):
    got = []
    for scale in (1.0, -0.5):
        bn.zero_grad(set_to_none=True)
        y, xg, rg = _step(bn, x * scale, r, dy)
        got += [y.detach(), xg.grad, bn.weight.grad, bn.bias.grad, *(b.clone() for b in bn.buffers())]
        got += [rg.grad] if rg is not None else []
    return got


@pytest.mark.parametrize("form", ["autograd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation, slope, residual", EPILOGUES, ids=IDS)
def test_eager_and_compiled_agree_bitwise(calls, form, activation, slope, residual, layout, dtype):
    """Eager (autograd records torch's ops) and torch.compile (aot_eager: the custom ops over local.forward and
    local.backward) make the same bits: outputs, every gradient, the buffers."""
    torch._dynamo.reset()
    x, r, dy, w, b = _data(dtype, layout, seed=5)
    r = r if residual else None
    eager = _two_steps(_layer(activation, slope, w, b, dtype), x, r, dy)
    ran = dict(calls)
    compiled = _two_steps(
        torch.compile(_layer(activation, slope, w, b, dtype), backend="aot_eager", fullgraph=True), x, r, dy
    )
    assert len(eager) == len(compiled)
    for i, (a, c) in enumerate(zip(eager, compiled, strict=True)):
        assert torch.equal(a, c), f"item {i} differs between eager and compiled"
    steps = _expected_calls("function", activation, slope, residual, dtype)
    assert ran["autograd"] == 2 * steps["forward"]  # eager: recorded where the local path takes the forward
    assert calls["forward"] - ran["forward"] == 2 * steps["forward"]  # compiled: the custom ops run it
    assert calls["backward"] - ran["backward"] == 2 * steps["backward"]


def _masked_oracle(bn, x, r, dy, mask, activation, slope):
    """The oracle over the real positions only, ``(n, C)``, as tests/autograd/test_masked.py computes it."""

    def real(t):
        return t.movedim(1, -1)[mask].double()

    xr = real(x).requires_grad_()
    rr = real(r).requires_grad_() if r is not None else None
    w, b = (p.detach().double().requires_grad_() for p in (bn.weight, bn.bias))
    rm, rv = bn.running_mean.double().clone(), bn.running_var.double().clone()
    z = F.batch_norm(xr, rm, rv, w, b, True, bn.momentum, bn.eps)
    y = _act(z + rr if rr is not None else z, activation, slope)
    y.backward(real(dy))
    return y.detach(), xr.grad, w.grad, b.grad, rr.grad if rr is not None else None, rm, rv


@pytest.mark.parametrize("form", ["autograd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation, slope, residual", EPILOGUES[:4] + EPILOGUES[5:7], ids=IDS[:4] + IDS[5:7])
def test_mask_takes_the_masked_launchers(calls, form, activation, slope, residual, layout, dtype, monkeypatch):
    """A mask at world size 1: not the local path (torch's kernels count every position) but the masked launchers,
    with no collective; NaN at padded positions reaches nothing, and outputs and gradients are 0 there."""

    def no_collective(*args):
        raise AssertionError("a collective at world size 1")

    monkeypatch.setattr(passes, "all_reduce_sums", no_collective)
    monkeypatch.setattr(recompute, "all_reduce_stats", no_collective)
    x, r, dy, w, b = _data(dtype, layout, seed=6)
    mask = torch.rand(SHAPE[0], *SHAPE[2:], generator=torch.Generator().manual_seed(7)) > 0.3
    padded = ~mask.unsqueeze(1)
    x, r = x.masked_fill(padded, float("nan")), (r.masked_fill(padded, float("nan")) if residual else None)
    bn = _layer(activation, slope, w, b, dtype)
    want = _masked_oracle(bn, x, r, dy, mask, activation, slope)
    xg = x.clone().requires_grad_()
    rg = r.clone().requires_grad_() if r is not None else None
    y = bn(xg, rg, mask=mask)
    y.backward(dy)
    assert calls == {"autograd": 0, "forward": 0, "backward": 0, "declined": 0}
    tol, ptol = TOLERANCES[dtype], PARAM_GRAD_TOL[dtype]

    def real(t):
        return t.movedim(1, -1)[mask]

    _close(real(y), want[0], tol, "y")
    _close(real(xg.grad), want[1], (4 * tol[0], 4 * tol[1]), "dx")
    _close(bn.weight.grad, want[2], ptol, "dweight")
    _close(bn.bias.grad, want[3], ptol, "dbias")
    if residual:
        _close(real(rg.grad), want[4], tol, "dresidual")
        assert (rg.grad.movedim(1, -1)[~mask] == 0).all()
    stats_tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    _close(bn.running_mean, want[5], stats_tol, "running_mean")
    _close(bn.running_var, want[6], stats_tol, "running_var")
    for t in (y, xg.grad):
        assert (t.movedim(1, -1)[~mask] == 0).all() and not t.isnan().any()
    assert y.stride() == xg.stride()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation, slope, residual", EPILOGUES, ids=IDS)
def test_packed_backward_makes_dz_once(activation, slope, residual, dtype, monkeypatch):
    """The packed launchers (2 ranks and more): the reduction makes ``dz = dy * act'(z)`` once and hands it to the
    elementwise launcher, which gives what it gives when it makes ``dz`` itself, to the bit."""
    x, r, dy, w, b = _data(dtype, "channels_last", seed=8)
    r = r if residual else None
    stats = tb.batch_norm_stats(x)
    y, mean, invstd = tb.batch_norm_elemt(x, w, b, stats=stats, residual=r, activation=activation,
                                          negative_slope=slope)  # fmt: skip
    kept = kept_for_backward(y, r, activation, slope)
    made = []
    epilogue_grad = plain._epilogue_grad
    monkeypatch.setattr(plain, "_epilogue_grad", lambda *a: made.append(1) or epilogue_grad(*a))
    args = dict(bias=b, activation=activation, negative_slope=slope, residual=kept[0], output=kept[1])

    def backward(hand_over: bool):
        sums, dw, db = tb.batch_norm_backward_reduce(dy, x, mean, invstd, w, **args)
        if not hand_over:
            plain._grads.entry = None
        dr = torch.empty_like(x) if residual else None
        dx = tb.batch_norm_backward_elemt(dy, x, mean, invstd, w, sums, stats[-1:], out_grad_residual=dr, **args)
        return [t for t in (dx, dw, db, dr) if t is not None]

    handed = backward(True)
    assert len(made) == (1 if activation is not None else 0) and plain._grads.entry is None
    for a, c in zip(handed, backward(False), strict=True):
        assert torch.equal(a, c)
    assert len(made) == (3 if activation is not None else 0)


def test_masked_backward_zeroes_once(monkeypatch):
    """The masked launchers: the reduction's copies zeroed at padded positions go on to the elementwise launcher."""
    x, r, dy, w, b = _data(torch.float32, "contiguous", seed=9)
    mask = torch.rand(SHAPE[0], *SHAPE[2:], generator=torch.Generator().manual_seed(10)) > 0.3
    stats = tb.batch_norm_stats(x, mask=mask)
    y, mean, invstd = tb.batch_norm_elemt(x, w, b, stats=stats, activation="silu", mask=mask)
    copies, made = [], []
    zeroed_copy, epilogue_grad = masked._zeroed_copy, plain._epilogue_grad
    monkeypatch.setattr(masked, "_zeroed_copy", lambda t, m: copies.append(t) or zeroed_copy(t, m))
    monkeypatch.setattr(plain, "_epilogue_grad", lambda *a: made.append(1) or epilogue_grad(*a))
    args = dict(bias=b, activation="silu", mask=mask)
    sums, dw, db = tb.batch_norm_backward_reduce(dy, x, mean, invstd, w, **args)
    dx = tb.batch_norm_backward_elemt(dy, x, mean, invstd, w, sums, stats[-1:], **args)
    assert len([c for c in copies if c is not None]) == 2  # dy and x, once each
    assert len(made) == 1, "the elementwise launcher takes the reduction's dz"
    assert dx.movedim(1, -1)[~mask].eq(0).all()


def test_dispatch_hands_the_residual_to_the_local_path(monkeypatch):
    """The eager dispatch passes the residual to ``local.recorded``, which returns act(bn(x) + residual)."""
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    seen = []
    recorded = local.recorded
    monkeypatch.setattr(local, "recorded", lambda layer, call: seen.append(call.residual) or recorded(layer, call))
    x, r, dy, w, b = _data(torch.float32, "contiguous", seed=11)
    bn = _layer("relu", 0.01, w, b, torch.float32)
    y, _, _ = _step(bn, x, r, dy)
    assert len(seen) == 1 and torch.equal(seen[0], r)
