"""The eager path (an autograd Function straight over the launchers) against the custom ops that torch.compile traces.

Both paths call the same ``forward_pass`` / ``backward_pass`` over the same launchers, so they must
agree bitwise: outputs, every gradient, the running statistics and ``num_batches_tracked``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from compilers import NO_CXX
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tritonbn
from tritonbn._core import dispatch


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
    monkeypatch.setattr(dispatch, "is_eager", lambda x: False)


@pytest.mark.parametrize("backend_name", ["triton", "torch"], indirect=True)
def test_eager_skips_the_custom_ops(backend_name, monkeypatch):
    """An eager call never enters the custom-op Function; under a dispatch mode it does (so tracers see the ops)."""

    def refuse(*args):
        raise AssertionError("an eager call went through the custom ops")

    monkeypatch.setattr(dispatch.SyncBatchNormFunction, "apply", refuse)
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
