"""The PyTorch backend's local path (tritonbn/_torch_local.py): a layer that synchronizes with nobody.

It is taken exactly where it applies, and keeps the backend's promises against the float64 oracle:
float32 precision at ``|mean| / std = 1e3`` in every layout, 16-bit inputs with 16-bit or float32
parameters and buffers, the running statistics and ``num_batches_tracked``.
"""

from __future__ import annotations

import pytest
import torch
from oracle import PARAM_GRAD_TOL, TOLERANCES, Oracle, make_layout

import tritonbn
from tritonbn import _torch_backend


@pytest.fixture
def calls(monkeypatch):
    """Count the local path's calls, and the times the forward declined."""
    seen = {"forward": 0, "declined": 0, "backward": 0}
    forward, backward = _torch_backend.local_forward, _torch_backend.local_backward

    def counting_forward(*args):
        out = forward(*args)
        seen["forward" if out is not None else "declined"] += 1
        return out

    def counting_backward(*args):
        seen["backward"] += 1
        return backward(*args)

    monkeypatch.setattr(_torch_backend, "local_forward", counting_forward)
    monkeypatch.setattr(_torch_backend, "local_backward", counting_backward)
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    return seen


def _step(bn, x, **kwargs):
    x = x.clone().requires_grad_()
    y = bn(x, **kwargs)
    y.backward(torch.ones_like(y))
    return y


def test_taken_where_it_applies(calls):
    x = torch.randn(4, 3, 5, 5)
    _step(tritonbn.SyncBatchNorm(3), x)
    assert calls == {"forward": 1, "declined": 0, "backward": 1}
    _step(tritonbn.SyncBatchNorm(3, momentum=None), x)  # a cumulative average: the packed path's forward
    assert calls == {"forward": 1, "declined": 1, "backward": 2}
    _step(tritonbn.SyncBatchNorm(3, activation="relu"), x)
    _step(tritonbn.SyncBatchNorm(3), x, residual=torch.randn_like(x).requires_grad_())
    _step(tritonbn.SyncBatchNorm(3), x, mask=torch.ones(4, 5, 5, dtype=torch.bool))
    assert calls == {"forward": 1, "declined": 1, "backward": 2}, "epilogues and masks take the packed path"
    with tritonbn.accumulate_stats(bn := tritonbn.SyncBatchNorm(3, momentum=None)):
        _step(bn, x)  # pooled statistics: the local path adds them to the sink (any momentum)
    assert calls == {"forward": 2, "declined": 1, "backward": 3}
    torch.testing.assert_close(bn.running_mean, x.mean((0, 2, 3)), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(bn.running_var, x.var((0, 2, 3)), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "permuted"])
def test_large_mean_keeps_precision(calls, dtype, layout):
    torch.manual_seed(4)
    x = make_layout(torch.randn(6, 4, 9, 7, dtype=torch.float64) * 0.5 + 1e3, layout).to(dtype).requires_grad_()
    dy = torch.randn(6, 4, 9, 7, dtype=dtype)
    bn = tritonbn.SyncBatchNorm(4).to(dtype)
    y = bn(x)
    y.backward(dy)
    oracle = Oracle(4, weight=bn.weight, bias=bn.bias)
    y_ref, dx_ref, dw_ref, db_ref = oracle.step(x, dy)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-10, 1e-10)
    torch.testing.assert_close(y.double(), y_ref, atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(x.grad.double(), dx_ref, atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(bn.weight.grad.double(), dw_ref, atol=100 * tol[0], rtol=tol[1])
    torch.testing.assert_close(bn.running_var.double(), oracle.running_var, atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(bn.running_mean.double(), oracle.running_mean, atol=tol[0], rtol=tol[1])
    assert bn.num_batches_tracked.item() == 1
    assert y.stride() == torch.empty_like(x).stride()
    assert calls["forward"] == 1 and calls["backward"] == 1


@pytest.mark.parametrize("params", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "permuted"])
def test_bfloat16(calls, params, layout):
    torch.manual_seed(5)
    x = make_layout(torch.randn(6, 4, 5, 7) * 2 + 3, layout).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(6, 4, 5, 7).to(torch.bfloat16)
    bn = tritonbn.SyncBatchNorm(4).to(params)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    oracle = Oracle(4, weight=bn.weight, bias=bn.bias)
    for _ in range(2):
        x.grad = bn.weight.grad = bn.bias.grad = None
        y = bn(x)
        y.backward(dy)
        y_ref, dx_ref, dw_ref, db_ref = oracle.step(x, dy)
        tol = TOLERANCES[torch.bfloat16]
        torch.testing.assert_close(y.double(), y_ref, atol=tol[0], rtol=tol[1])
        torch.testing.assert_close(x.grad.double(), dx_ref, atol=4 * tol[0], rtol=4 * tol[1])
        torch.testing.assert_close(bn.weight.grad.double(), dw_ref, atol=PARAM_GRAD_TOL[torch.bfloat16][0],
                                   rtol=PARAM_GRAD_TOL[torch.bfloat16][1])  # fmt: skip
        assert bn.weight.grad.dtype == params and x.grad.dtype == torch.bfloat16
        rtol = 1e-5 if params == torch.float32 else 1e-2  # bfloat16 buffers round to bfloat16
        torch.testing.assert_close(bn.running_mean.double(), oracle.running_mean, atol=rtol, rtol=rtol)
        torch.testing.assert_close(bn.running_var.double(), oracle.running_var, atol=rtol, rtol=rtol)
        assert y.stride() == torch.empty_like(x).stride()
    assert bn.num_batches_tracked.item() == 2
    assert calls["forward"] == 2 and calls["backward"] == 2


def test_checkpoint_recompute_leaves_running_stats(calls):
    bn = tritonbn.SyncBatchNorm(3)
    x = torch.randn(4, 3, 6, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(bn, x, use_reentrant=False)
    y.sum().backward()
    assert bn.num_batches_tracked.item() == 1, "the recompute inside backward must not count a batch"
    assert calls["forward"] == 2 and calls["backward"] == 1


def test_empty_input_takes_the_packed_path(calls):
    """An empty input (a rank with no samples, here with nobody to sync with): torch's kernels divide by the count
    (a float exception on CPU), so forward and backward are the packed path's; its gradients are empty and zero."""
    bn = tritonbn.SyncBatchNorm(3)
    y = _step(bn, torch.randn(0, 3, 5, 5))
    assert y.shape == (0, 3, 5, 5) and torch.equal(bn.weight.grad, torch.zeros(3))
    assert calls == {"forward": 0, "declined": 1, "backward": 0}
    assert bn.num_batches_tracked.item() == 0 and torch.equal(bn.running_mean, torch.zeros(3))  # no batch seen
