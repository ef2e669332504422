"""torch.compile(fullgraph=True): no graph break, and the same outputs, gradients and buffers as eager."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from dist import load_ranks, save_rank, spawn
from torch import nn

import tritonbn


class FusedResidual(nn.Module):
    """silu(bn(conv(x)) + x): the fused epilogue under the compiler."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = tritonbn.SyncBatchNorm(4, activation="silu")

    def forward(self, x):
        return self.bn(self.conv(x), x)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        tritonbn.SyncBatchNorm(4),
        nn.ReLU(),
        FusedResidual(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 5),
        tritonbn.SyncBatchNorm(5, momentum=None),
    )


def _steps(model, x, steps=2):
    """Train ``steps`` steps then eval once; returns outputs, grads and the final state.

    The loss weights the output with fixed random numbers. (A loss such as ``(y * y).sum()`` after
    a BatchNorm with unit weight and zero bias has a gradient that cancels to zero before it: the
    gradients upstream would be rounding noise, which inductor's fused code rounds differently.)
    """
    outs = []
    weights = torch.randn(x.shape[0], 5, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model.zero_grad()
        y = model(x)
        (y * weights).sum().backward()
        outs.append(y.detach())
        outs.extend(p.grad.clone() for p in model.parameters())
    model.eval()
    outs.append(model(x).detach())
    model.train()
    return outs


def _compare(compiled_model, eager_model, x, backend):
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    got = _steps(compiled, x)
    want = _steps(eager_model, x)
    # Inductor's convolutions and linear layer round differently from eager's on some CPUs (it fuses
    # their bias and pointwise neighbours), so the BatchNorms' inputs, and what follows, may differ in
    # the last bits; the conv biases before a BatchNorm have a gradient of exactly 0 up to that
    # rounding. tests/autograd/test_eager_path.py shows the tritonbn layers themselves bitwise equal under both.
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for (k, a), b in zip(compiled_model.state_dict().items(), eager_model.state_dict().values(), strict=True):
        if backend == "inductor" and a.is_floating_point():
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=f"buffer {k} differs between compiled and eager")
        else:
            assert torch.equal(a, b), f"buffer {k} differs between compiled and eager"


@pytest.mark.parametrize("backend_name", ["triton", "torch"], indirect=True)
def test_compile_aot_eager(backend_name):
    torch._dynamo.reset()
    model = make_model()
    _compare(copy.deepcopy(model), model, torch.randn(3, 3, 7, 7), "aot_eager")


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None, reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("backend_name", ["torch"], indirect=True)  # the kernels under a compiler: aot_eager above
def test_compile_inductor(backend_name, tmp_path, monkeypatch):
    # A fresh cache: torch's on-disk caches do not key on a custom op's fake implementation, so an
    # entry left by an older tritonbn (another stats shape) would be reused.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    model = make_model()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _compare(copy.deepcopy(model), model, torch.randn(6, 3, 7, 7), "inductor")


def test_custom_ops_are_registered_and_opaque():
    """The collectives sit inside the ops: a traced graph holds the two tritonbn ops and no c10d call."""
    torch._dynamo.reset()
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm.forward

    bn = tritonbn.SyncBatchNorm(3)
    torch.compile(bn, fullgraph=True, backend=capture)(torch.randn(4, 3, 2))
    code = "\n".join(m.code for m in graphs[0].modules() if isinstance(m, torch.fx.GraphModule))
    assert "tritonbn.batch_norm_forward" in code
    assert "all_reduce" not in code and "c10d" not in code
    assert hasattr(torch.ops.tritonbn, "batch_norm_backward")


def _rank_compile(rank, world, out_dir):
    torch._dynamo.reset()
    model = make_model()
    eager = copy.deepcopy(model)
    torch.manual_seed(10 + rank)
    x = torch.randn(3 + rank, 3, 7, 7)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got, want = _steps(compiled, x), _steps(eager, x)
    save_rank(out_dir, rank, {"got": got, "want": want, "state": model.state_dict(), "eager": eager.state_dict()})


@pytest.mark.distributed
@pytest.mark.parametrize("backend_name", ["torch"], indirect=True)  # the kernels across ranks: tests/distributed
def test_compile_across_ranks(backend_name, tmp_path):
    spawn(2, _rank_compile, str(tmp_path))
    ranks = load_ranks(str(tmp_path), 2)
    for r in ranks:
        for a, b in zip(r["got"], r["want"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        for k, v in r["state"].items():
            assert torch.equal(v, r["eager"][k]), k
    for k, v in ranks[0]["state"].items():
        if "running" in k or "num_batches" in k:
            assert torch.equal(v, ranks[1]["state"][k]), f"{k} differs between ranks"
