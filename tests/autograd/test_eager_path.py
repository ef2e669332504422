"""The eager path (an autograd Function straight over the launchers) against the custom ops that torch.compile traces.

Both paths call the same ``forward_pass`` / ``backward_pass`` over the same launchers, so they must
agree bitwise: outputs, every gradient, the running statistics and ``num_batches_tracked``. A training call that
repeats the layer's last one takes the route kept for it (``tritonbn._core.route``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from compilers import NO_CXX
from oracle import Oracle
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tritonbn
from tritonbn._core import custom_ops, route


class Net(nn.Module):
    """Every kind of layer call: plain, fused residual + silu (keeps the residual), fused residual + relu
    with momentum=None (keeps the output), no affine parameters."""

    def __init__(self):
        super().__init__()
        self.bn1 = tritonbn.SyncBatchNorm(4)
        self.bn2 = tritonbn.SyncBatchNorm(4, activation="silu")
        self.bn3 = tritonbn.SyncBatchNorm(4, activation="relu", momentum=None)
        self.bn4 = tritonbn.SyncBatchNorm(4, affine=False)

    def forward(self, x, r):
        y = self.bn1(x)
        y = self.bn2(y, r)
        y = self.bn3(y, r)
        return self.bn4(y)


def _run(model, x, r, w):
    """Two training steps, then eval with gradients; every output, gradient and buffer, in order."""
    got = []
    for training in (True, True, False):
        model.train(training)
        model.zero_grad(set_to_none=True)
        xi, ri = x.clone().requires_grad_(), r.clone().requires_grad_()
        y = model(xi, ri)
        (y * w).sum().backward()
        got += [y.detach(), xi.grad, ri.grad]
        got += [p.grad for p in model.parameters()]
        got += [b.clone() for b in model.buffers()]
    return got


def _inputs():
    torch.manual_seed(0)
    return torch.randn(5, 4, 3, 2), torch.randn(5, 4, 3, 2), torch.randn(5, 4, 3, 2)


def _assert_identical(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"item {i} differs"


def _custom_op_path(monkeypatch):
    monkeypatch.setattr(route, "is_eager", lambda x: False)


@pytest.mark.parametrize("backend_name", ["triton", "torch"], indirect=True)
def test_eager_skips_the_custom_ops(backend_name, monkeypatch):
    """An eager call never enters the custom-op Function; under a dispatch mode it does (so tracers see the ops)."""

    def refuse(*args):
        raise AssertionError("an eager call went through the custom ops")

    monkeypatch.setattr(custom_ops.SyncBatchNormFunction, "apply", refuse)
    x, r, w = _inputs()
    _run(Net(), x, r, w)
    monkeypatch.undo()

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record() as mode:
        tritonbn.SyncBatchNorm(4)(x.requires_grad_()).sum().backward()
    assert any("tritonbn.batch_norm_forward" in op for op in mode.ops)
    assert any("tritonbn.batch_norm_backward" in op for op in mode.ops)


@pytest.mark.parametrize("backend_name", ["triton", "torch"], indirect=True)
def test_eager_matches_custom_ops_bitwise(backend_name, monkeypatch):
    x, r, w = _inputs()
    torch.manual_seed(1)
    model = Net()
    ops_model = copy.deepcopy(model)
    eager = _run(model, x, r, w)
    _custom_op_path(monkeypatch)
    _assert_identical(eager, _run(ops_model, x, r, w))


# The kernels under aot_eager; inductor (which compiles the graph around the same custom ops) on the PyTorch backend.
INDUCTOR = pytest.param("torch", "inductor", marks=pytest.mark.skipif(NO_CXX, reason="inductor needs a C++ compiler"))


@pytest.mark.parametrize(
    "backend_name, compiler", [("triton", "aot_eager"), ("torch", "aot_eager"), INDUCTOR], indirect=["backend_name"]
)
def test_eager_matches_compiled_bitwise(backend_name, compiler):
    """torch.compile(fullgraph=True) runs the custom ops; eager runs the Function over the launchers: same bits."""
    torch._dynamo.reset()
    x, r, w = _inputs()
    torch.manual_seed(1)
    model = Net()
    compiled_model = copy.deepcopy(model)
    eager = _run(model, x, r, w)
    compiled = torch.compile(compiled_model, fullgraph=True, backend=compiler)
    _assert_identical(eager, _run(compiled, x, r, w))


@pytest.mark.parametrize("backend_name", ["triton", "torch"], indirect=True)
def test_no_grad_call_matches_the_graph_path(backend_name):
    """Without anything to differentiate, the call skips autograd: same outputs and buffers."""
    x, r, _ = _inputs()
    torch.manual_seed(1)
    a = Net()
    b = copy.deepcopy(a)
    for p in b.parameters():
        p.requires_grad_(False)
    for training in (True, False):
        a.train(training)
        b.train(training)
        with torch.no_grad():
            ya = a(x, r)
        yb = b(x, r)
        assert yb.grad_fn is None
        assert torch.equal(ya, yb)
        for ba, bb in zip(a.buffers(), b.buffers(), strict=True):
            assert torch.equal(ba, bb)


def _step_against(bn, oracle, x, exact=True):
    """One training step of the float64 layer ``bn``: its output, gradients and buffers ``F.batch_norm``'s, to the bit
    (``exact``), or within 1e-10."""
    dy = torch.randn_like(x)
    xg = x.clone().requires_grad_()
    bn.zero_grad()
    y = bn(xg)
    y.backward(dy)
    got = (y, xg.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var)
    want = (*oracle.step(x, dy), oracle.running_mean, oracle.running_var)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-10, atol=1e-10)
    assert bn.num_batches_tracked.item() == oracle.num_batches_tracked


def test_a_repeated_training_call_takes_its_kept_route(dispatched, routes, monkeypatch):
    """A training call under autograd like the layer's last checked one takes the route chosen for the first
    (``tritonbn._core.route.route_for``, once per record and context), with no checks and no choice made again: the
    PyTorch backend's local path (the float64 output, gradients and buffers of ``F.batch_norm``, to the bit), the
    eager Function where the local path declines the layout, and the kernels. A residual (another record), no
    autograd, another ``TRITONBN_BACKEND``, a checkpoint's recompute inside backward (which leaves the buffers
    alone) and forward-mode AD are other contexts: a route is chosen for each, once."""
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")

    def expect(chosen, taken):
        assert len(dispatched) == chosen
        assert routes == taken
        routes.clear()

    torch.manual_seed(5)
    bn = tritonbn.SyncBatchNorm(6).double()
    oracle = Oracle(6, weight=bn.weight, bias=bn.bias)
    x = torch.randn(4, 6, 5, 3, dtype=torch.float64) * 3 + 2
    for _ in range(3):
        _step_against(bn, oracle, x)
    expect(1, ["local training"] * 3)  # chosen at the first call, kept for the next two
    bn(x.clone().requires_grad_(), torch.randn_like(x))  # a residual: checked again, a record of its own
    oracle.step(x, None)
    for _ in range(3):
        _step_against(bn, oracle, x)
    expect(3, ["local training"] * 4)
    with torch.no_grad():  # nothing recorded: the forward pass (its local forward), chosen for that context
        bn(x)
        bn(x)
    oracle.step(x, None)
    oracle.step(x, None)
    _step_against(bn, oracle, x)
    expect(4, ["forward pass", "forward pass", "local training"])
    xt = x.transpose(2, 3)  # strides torch's kernels do not keep: the Function
    for _ in range(3):
        _step_against(bn, oracle, xt, exact=False)
    expect(5, ["eager function"] * 3)
    monkeypatch.setenv("TRITONBN_BACKEND", "auto")  # under the interpreter: the kernels, in the Function
    for _ in range(3):
        _step_against(bn, oracle, xt, exact=False)
    expect(6, ["eager function"] * 3)
    assert bn._tritonbn_settings.record.launches is not None  # the kernels' launches, prepared for the record
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    with torch.no_grad():  # the Function's buffers are within 1e-10 of the oracle's: the exact steps start from its
        bn.running_mean.copy_(oracle.running_mean)
        bn.running_var.copy_(oracle.running_var)
    _step_against(bn, oracle, x)
    _step_against(bn, oracle, x)
    expect(7, ["local training"] * 2)
    y = torch.utils.checkpoint.checkpoint(bn, x.clone().requires_grad_(), use_reentrant=False)
    y.sum().backward()  # the forward: the kept route; its recompute inside backward: a context of its own
    oracle.step(x, None)
    assert bn.num_batches_tracked.item() == oracle.num_batches_tracked
    assert torch.equal(bn.running_mean, oracle.running_mean) and torch.equal(bn.running_var, oracle.running_var)
    expect(8, ["local training"] * 2)
    with torch.autograd.forward_ad.dual_level():  # forward-mode AD: the Function
        bn(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)))
    oracle.step(x, None)
    _step_against(bn, oracle, x)
    expect(9, ["eager function", "local training"])
