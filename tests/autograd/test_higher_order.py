"""Gradients beyond first order: double backward (gradient penalties) and forward-mode AD.

The truth is ``torch.nn.functional.batch_norm`` in float64 (on the concatenated global batch across
ranks), and ``gradgradcheck``'s finite differences of tritonbn's own first-order backward, which the
other test files hold to the oracle.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from dist import backend_env, load_ranks, save_rank, spawn

import tritonbn
from tritonbn import functional
from tritonbn._core import route

EPS = 1e-5


def _act(z, activation, slope=0.01):
    if activation == "relu":
        return torch.relu(z)
    if activation == "leaky_relu":
        return F.leaky_relu(z, slope)
    if activation == "silu":
        return F.silu(z)
    return z


def _tensors(shape, affine, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 1.7 + 0.3).requires_grad_()
    w = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5).requires_grad_() if affine else None
    b = torch.randn(C, generator=g, dtype=torch.float64).requires_grad_() if affine and bias else None
    rm = torch.randn(C, generator=g, dtype=torch.float64)
    rv = torch.rand(C, generator=g, dtype=torch.float64) + 0.5
    return x, w, b, rm, rv


GRADGRAD_CASES = [
    pytest.param((2, 3), True, True, True, id="2d-train-affine"),
    pytest.param((2, 3), False, False, True, id="2d-eval-noaffine"),
    pytest.param((2, 2, 3), True, True, False, id="3d-train-nobias"),
    pytest.param((2, 2, 3), False, True, True, id="3d-eval-affine"),
    pytest.param((2, 2, 1, 3), True, False, True, id="4d-train-noaffine"),
    pytest.param((2, 2, 3, 1), False, True, False, id="4d-eval-nobias"),
    pytest.param((2, 2, 1, 1, 2), True, True, True, id="5d-train-affine"),
    pytest.param((3, 2, 1, 1, 1), False, True, True, id="5d-eval-affine"),
]


def _runs(cases, kernel_ids):
    """Every case on the PyTorch backend; on the kernels (under the interpreter, where gradgradcheck's many calls are
    slow) the cases ``kernel_ids`` names. The second-order formulas are torch ops above the backend; what the kernels
    add is the first-order backward, which gradgradcheck differentiates numerically."""
    runs = [pytest.param("torch", *c.values, id=f"torch-{c.id}") for c in cases]
    return runs + [pytest.param("triton", *c.values, id=f"triton-{c.id}") for c in cases if c.id in kernel_ids]


@pytest.mark.parametrize(
    "backend_name, shape, training, affine, bias",
    _runs(GRADGRAD_CASES, {"2d-train-affine", "4d-eval-nobias", "5d-train-affine"}),
    indirect=["backend_name"],
)
def test_gradgradcheck(backend_name, shape, training, affine, bias):
    x, w, b, rm, rv = _tensors(shape, affine, bias)
    inputs = tuple(t for t in (x, w, b) if t is not None)

    def fn(*args):
        it = iter(args)
        xi, wi, bi = next(it), next(it) if w is not None else None, next(it) if b is not None else None
        # Training without running buffers: gradgradcheck calls fn many times, and nothing may drift.
        return tritonbn.sync_batch_norm(xi, None if training else rm, None if training else rv, wi, bi, training)

    assert torch.autograd.gradgradcheck(fn, inputs)


EPILOGUES = [
    pytest.param("silu", True, 0.01, id="silu-residual"),
    pytest.param("relu", True, 0.01, id="relu-residual-output-kept"),
    pytest.param("leaky_relu", True, -0.2, id="leaky-negative-slope-residual-kept"),
    pytest.param("silu", False, 0.01, id="silu-no-residual"),
]


@pytest.mark.parametrize(
    "backend_name, activation, with_residual, slope",
    _runs(EPILOGUES, {"silu-no-residual", "relu-residual-output-kept"}),
    indirect=["backend_name"],
)
def test_gradgradcheck_epilogue(backend_name, activation, with_residual, slope):
    x, w, b, _, _ = _tensors((3, 2, 1), True, True, seed=1)
    r = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    inputs = (x, w, b, r) if with_residual else (x, w, b)

    def fn(xi, wi, bi, ri=None):
        return tritonbn.sync_batch_norm(
            xi, None, None, wi, bi, True, residual=ri, activation=activation, negative_slope=slope
        )

    assert torch.autograd.gradgradcheck(fn, inputs)


def _close(got, want, tol):
    """``None`` (no dependence: relu's zero second derivative, or a bias the penalty ignores) counts as zeros."""
    if got is None and want is None:
        return
    got = torch.zeros_like(want) if got is None else got
    want = torch.zeros_like(got) if want is None else want
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _penalty(fn, x, params, dy):
    """A gradient penalty: ``g = d<y, dy>/dx`` with a graph, then ``sum(g^2)`` backpropagated."""
    y = fn(x)
    (g,) = torch.autograd.grad((y * dy).sum(), x, create_graph=True)
    (g * g).sum().backward()
    return g.detach(), x.grad, [p.grad for p in params]


@pytest.mark.parametrize("custom_ops", [False, True], ids=["eager", "custom-ops"])
@pytest.mark.parametrize("activation", [None, "silu", "relu"])
def test_penalty_matches_torch_and_first_order(backend_name, custom_ops, activation, monkeypatch):
    """The penalty's gradients equal torch's; the differentiable path's first-order gradients equal the kernels'."""
    if custom_ops:  # the path torch.compile and non-eager tensors take
        monkeypatch.setattr(route, "is_eager", lambda x: False)
    g = torch.Generator().manual_seed(3)
    shape = (4, 3, 2, 3)
    x0 = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    r0 = torch.randn(shape, generator=g, dtype=torch.float64) if activation else None
    w0, b0 = torch.rand(3, generator=g, dtype=torch.float64) + 0.5, torch.randn(3, generator=g, dtype=torch.float64)

    def leaves():
        out = [t.clone().requires_grad_() for t in (x0, w0, b0)]
        return out + ([r0.clone().requires_grad_()] if r0 is not None else [])

    def run(xi, w, b, rm, rv, nbt, residual):
        return functional.batch_norm(
            xi, rm, rv, w, b, True, 0.1, EPS, None, nbt, residual=residual, activation=activation
        )

    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    nbt = torch.zeros((), dtype=torch.long)
    x, w, b, *r = leaves()
    got = _penalty(lambda xi: run(xi, w, b, rm, rv, nbt, r[0] if r else None), x, [w, b, *r], dy)
    assert nbt.item() == 1  # once per forward, whatever the backward did
    xo, wo, bo, *ro = leaves()
    rmo, rvo = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    want = _penalty(lambda xi: _act(F.batch_norm(xi, rmo, rvo, wo, bo, True, 0.1, EPS) + (ro[0] if ro else 0),
                                    activation), xo, [wo, bo, *ro], dy)  # fmt: skip
    for a, e in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
        _close(a, e, 1e-9)
    torch.testing.assert_close(rm, rmo, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rv, rvo, rtol=1e-12, atol=1e-12)

    # First order: the create_graph path against the kernels' own backward (create_graph=False).
    x1, w1, b1, *r1 = leaves()
    x2, w2, b2, *r2 = leaves()
    y1 = run(x1, w1, b1, None, None, None, r1[0] if r1 else None)
    y2 = run(x2, w2, b2, None, None, None, r2[0] if r2 else None)
    first = torch.autograd.grad((y1 * dy).sum(), [x1, w1, b1, *r1], create_graph=True)
    kernels = torch.autograd.grad((y2 * dy).sum(), [x2, w2, b2, *r2])
    assert first[0].grad_fn is not None and all(t.grad_fn is None for t in kernels)
    for a, e in zip(first, kernels, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("custom_ops", [False, True], ids=["eager", "custom-ops"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("params_grad", [True, False], ids=["params-grad", "no-grad"])
def test_forward_ad_matches_torch(backend_name, training, params_grad, custom_ops, monkeypatch):
    if custom_ops:
        monkeypatch.setattr(route, "is_eager", lambda x: False)
    g = torch.Generator().manual_seed(4)
    shape = (3, 2, 5)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 - 1
    tx = torch.randn(shape, generator=g, dtype=torch.float64)
    w, tw = torch.rand(2, generator=g, dtype=torch.float64) + 0.5, torch.randn(2, generator=g, dtype=torch.float64)
    b, tb = torch.randn(2, generator=g, dtype=torch.float64), torch.randn(2, generator=g, dtype=torch.float64)
    rm, rv = torch.randn(2, generator=g, dtype=torch.float64), torch.rand(2, generator=g, dtype=torch.float64) + 1
    ours_rm, ours_rv, nbt = rm.clone(), rv.clone(), torch.zeros((), dtype=torch.long)
    w.requires_grad_(params_grad)  # without any requires_grad the call used to skip autograd and drop the tangent
    with fwAD.dual_level():
        xd, wd, bd = fwAD.make_dual(x, tx), fwAD.make_dual(w, tw), fwAD.make_dual(b, tb)
        y = tritonbn.sync_batch_norm(xd, ours_rm, ours_rv, wd, bd, training, num_batches_tracked=nbt)
        want = F.batch_norm(xd, rm, rv, wd, bd, training)
        got_t, want_t = fwAD.unpack_dual(y).tangent, fwAD.unpack_dual(want).tangent
    assert got_t is not None
    torch.testing.assert_close(got_t, want_t, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours_rm, rm, rtol=1e-12, atol=1e-12)
    assert nbt.item() == int(training)

    # torch.func.jvp: tritonbn's tangent is torch's (one process: torch's own ops, which functorch batches).
    want_f = torch.func.jvp(lambda a: F.batch_norm(a, None, None, w, b, True), (x,), (tx,))[1]
    with fwAD.dual_level():
        ref = fwAD.unpack_dual(F.batch_norm(fwAD.make_dual(x, tx), None, None, w, b, True)).tangent
    torch.testing.assert_close(want_f, ref)
    got_f = torch.func.jvp(lambda a: tritonbn.sync_batch_norm(a, None, None, w, b, True), (x,), (tx,))[1]
    torch.testing.assert_close(got_f, want_f, rtol=1e-10, atol=1e-10)


# --- Across ranks: a gradient penalty and a tangent over 2 gloo ranks against one process. ---

CASES = {  # name: (per-rank N of one global batch, fused activation with a residual)
    "uneven": ([3, 2], None),
    "uneven-silu-residual": ([3, 2], "silu"),
    "empty-rank": ([5, 0], None),
}
TAIL = (3, 2, 2)


def _global(sizes):
    g = torch.Generator().manual_seed(11)
    n = sum(sizes)
    x = torch.randn((n, *TAIL), generator=g, dtype=torch.float64) * 1.5 + 0.5
    dy = torch.randn((n, *TAIL), generator=g, dtype=torch.float64)
    r = torch.randn((n, *TAIL), generator=g, dtype=torch.float64)
    tx = torch.randn((n, *TAIL), generator=g, dtype=torch.float64)
    w = torch.rand(TAIL[0], generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(TAIL[0], generator=g, dtype=torch.float64)
    return x, dy, r, tx, w, b


def _slice(t, rank, sizes):
    start = sum(sizes[:rank])
    return t[start : start + sizes[rank]]


def _rank_penalty(rank, world, out_dir):
    result = {}
    for name, (sizes, activation) in CASES.items():
        x, dy, r, tx, w0, b0 = (_slice(t, rank, sizes) if t.dim() > 1 else t for t in _global(sizes))
        xr, w, b, rr = (t.clone().requires_grad_() for t in (x, w0, b0, r))
        rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        nbt = torch.zeros((), dtype=torch.long)

        def fn(xi, w=w, b=b, rr=rr, rm=rm, rv=rv, nbt=nbt, activation=activation):
            res = rr if activation else None
            return tritonbn.sync_batch_norm(xi, rm, rv, w, b, True, num_batches_tracked=nbt, residual=res,
                                            activation=activation)  # fmt: skip

        g, xg, (wg, bg, rg) = _penalty(fn, xr, [w, b, rr], dy)
        result[name] = dict(g=g, x=xg, w=wg, b=bg, r=rg, rm=rm, rv=rv, nbt=nbt.item())
        res = rr.detach() if activation else None
        with fwAD.dual_level():
            y = tritonbn.sync_batch_norm(fwAD.make_dual(x, tx), None, None, w0, b0, True, residual=res,
                                         activation=activation)  # fmt: skip
            result[name]["tangent"] = fwAD.unpack_dual(y).tangent
    save_rank(out_dir, rank, result)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_penalty_two_ranks(backend):
    """Every rank's x.grad (and residual grad), the summed weight and bias grads, buffers and tangents."""
    with tempfile.TemporaryDirectory() as out_dir, backend_env(backend):
        spawn(2, _rank_penalty, out_dir)
        ranks = load_ranks(out_dir, 2)
    for name, (sizes, activation) in CASES.items():
        x, dy, r, tx, w0, b0 = _global(sizes)
        xo, wo, bo, ro = (t.clone().requires_grad_() for t in (x, w0, b0, r))
        rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)

        def oracle(xi, wo=wo, bo=bo, ro=ro, rm=rm, rv=rv, activation=activation):
            return _act(F.batch_norm(xi, rm, rv, wo, bo, True, 0.1, EPS) + (ro if activation else 0), activation)

        g, xg, (wg, bg, rg) = _penalty(oracle, xo, [wo, bo, ro], dy)
        got = [rk[name] for rk in ranks]
        torch.testing.assert_close(torch.cat([k["g"] for k in got]), g, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(torch.cat([k["x"] for k in got]), xg, rtol=1e-9, atol=1e-9)
        _close(sum(k["w"] for k in got), wg, 1e-9)
        _close(None if got[0]["b"] is None else sum(k["b"] for k in got), bg, 1e-9)
        if activation:
            _close(torch.cat([k["r"] for k in got]), rg, 1e-9)
        for k in got:
            torch.testing.assert_close(k["rm"], rm, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(k["rv"], rv, rtol=1e-12, atol=1e-12)
            assert k["nbt"] == 1
        with fwAD.dual_level():
            y = _act(
                F.batch_norm(fwAD.make_dual(x, tx), None, None, w0, b0, True) + (r if activation else 0), activation
            )
            want = fwAD.unpack_dual(y).tangent
        torch.testing.assert_close(torch.cat([k["tangent"] for k in got]), want, rtol=1e-10, atol=1e-10)


def test_forward_ad_under_compile(monkeypatch):
    """Compiled, a forward-AD call breaks the graph and runs eagerly (torch's tangent); fullgraph names tritonbn."""
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    x, tx = (
        torch.randn((4, 3, 2), generator=g, dtype=torch.float64),
        torch.randn((4, 3, 2), generator=g, dtype=torch.float64),
    )
    bn = tritonbn.SyncBatchNorm(3).double()
    with fwAD.dual_level():
        got = fwAD.unpack_dual(torch.compile(bn, backend="aot_eager")(fwAD.make_dual(x, tx))).tangent
        want = fwAD.unpack_dual(F.batch_norm(fwAD.make_dual(x, tx), None, None, bn.weight, bn.bias, True)).tangent
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert bn.num_batches_tracked.item() == 1
    torch._dynamo.reset()
    with fwAD.dual_level(), pytest.raises(Exception, match="tritonbn does not support forward-mode AD"):
        torch.compile(bn, backend="aot_eager", fullgraph=True)(fwAD.make_dual(x, tx))
    torch._dynamo.reset()
