"""The PyTorch backend's local path (tritonbn/backends/torch/local.py): a layer that synchronizes with nobody.

It is taken exactly where it applies, and keeps the backend's promises against the float64 oracle:
float32 precision at ``|mean| / std = 1e3`` in every layout, 16-bit inputs with 16-bit or float32
parameters and buffers, the running statistics and ``num_batches_tracked``.
"""

from __future__ import annotations

import pytest
import torch
from oracle import PARAM_GRAD_TOL, TOLERANCES, Oracle, make_layout

import tritonbn

FORMS = ["autograd", "function"]


def _step(bn, x, **kwargs):
    x = x.clone().requires_grad_()
    y = bn(x, **kwargs)
    y.backward(torch.ones_like(y))
    return y


@pytest.mark.parametrize("form", FORMS)
def test_taken_where_it_applies(calls, form):
    x = torch.randn(4, 3, 5, 5)
    taken = {"autograd": 0, "forward": 0, "declined": 0, "backward": 0}
    local = "autograd" if form == "autograd" else "forward"

    def expect(**changes):
        taken.update({key: taken[key] + value for key, value in changes.items()})
        assert calls == taken

    _step(tritonbn.SyncBatchNorm(3), x)
    expect(**{local: 1}, backward=int(form == "function"))
    _step(tritonbn.SyncBatchNorm(3, momentum=None), x)  # a cumulative average: the packed path's forward
    expect(declined=1 + int(form == "autograd"), backward=1)  # declined by both forms; its backward is local
    _step(tritonbn.SyncBatchNorm(3, activation="relu"), x)
    _step(tritonbn.SyncBatchNorm(3), x, residual=torch.randn_like(x).requires_grad_())
    expect(**{local: 2}, backward=2 * int(form == "function"))  # epilogues follow the local path
    _step(tritonbn.SyncBatchNorm(3), x, mask=torch.ones(4, 5, 5, dtype=torch.bool))
    expect()  # masks take the packed path
    with tritonbn.accumulate_stats(bn := tritonbn.SyncBatchNorm(3, momentum=None)):
        _step(bn, x)  # pooled statistics: the local path adds them to the sink (any momentum)
    expect(**{local: 1}, backward=int(form == "function"))
    torch.testing.assert_close(bn.running_mean, x.mean((0, 2, 3)), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(bn.running_var, x.var((0, 2, 3)), atol=1e-6, rtol=1e-6)
    bn = tritonbn.SyncBatchNorm(3)
    with torch.autograd.forward_ad.dual_level():  # forward-mode AD: the Function, with its jvp
        bn(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)))
    expect(forward=1)
    with torch.no_grad():  # nothing recorded: local.forward
        bn(x)
    expect(forward=1)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "permuted"])
def test_large_mean_keeps_precision(calls, form, dtype, layout):
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
    _assert_taken(calls, form, layout, 1)


@pytest.mark.parametrize("form", FORMS)
def test_far_from_zero_running_var_is_the_shifted_copys(calls, form):
    """At ``|mean| / std = 2e4`` in channels_last, torch's training kernel over ``x`` itself sums the variance less
    precisely (about 1e-4 of it here): the layer takes its statistics from the shifted copy, running buffers
    included (momentum 1: the buffers are the batch's statistics)."""
    torch.manual_seed(5)
    x = make_layout(torch.randn(6, 4, 9, 7, dtype=torch.float64) * 0.5 + 1e4, "channels_last").float()
    bn = tritonbn.SyncBatchNorm(4, momentum=1.0)
    _step(bn, x)
    x64 = x.double()
    torch.testing.assert_close(bn.running_var.double(), x64.var((0, 2, 3)), atol=0, rtol=1e-5)
    torch.testing.assert_close(bn.running_mean.double(), x64.mean((0, 2, 3)), atol=0, rtol=1e-7)
    _assert_taken(calls, form, "channels_last", 1)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_near_zero_is_plain_batchnorms_kernel(calls, form, layout):
    """Where every channel's mean lies within 16 standard deviations of zero, the output, gradients and running
    statistics are ``nn.BatchNorm2d``'s, bit for bit: the same kernel over ``x`` itself (no shifted copy)."""
    torch.manual_seed(6)
    x = make_layout(torch.randn(6, 4, 9, 7) * 2 + 15, layout)
    dy = make_layout(torch.randn(6, 4, 9, 7), layout)
    ours, plain = tritonbn.SyncBatchNorm(4), torch.nn.BatchNorm2d(4)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        plain.weight.copy_(ours.weight)
    got = []
    for bn in (ours, plain):
        xg = x.clone().requires_grad_()
        y = bn(xg)
        y.backward(dy)
        got.append([y, xg.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var])
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
    _assert_taken(calls, form, layout, 1)


def _assert_taken(calls, form, layout, steps):
    """The form asked for took ``steps`` steps (a layout torch's kernels do not keep: the Function's)."""
    if form == "autograd" and layout != "permuted":
        assert calls["autograd"] == steps and calls["forward"] == calls["backward"] == 0
    else:
        assert calls["forward"] == calls["backward"] == steps and calls["autograd"] == 0


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("params", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "permuted"])
def test_bfloat16(calls, form, params, layout):
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
    _assert_taken(calls, form, layout, 2)


@pytest.mark.parametrize("form", FORMS)
def test_checkpoint_recompute_leaves_running_stats(calls, form):
    bn = tritonbn.SyncBatchNorm(3)
    x = torch.randn(4, 3, 6, requires_grad=True)
    dy = torch.randn(4, 3, 6)
    y = torch.utils.checkpoint.checkpoint(bn, x, use_reentrant=False)
    y.backward(dy)
    assert bn.num_batches_tracked.item() == 1, "the recompute inside backward must not count a batch"
    dx = x.grad
    x.grad = None
    tritonbn.SyncBatchNorm(3)(x).backward(dy)
    assert torch.equal(dx, x.grad)
    if form == "autograd":  # the recompute stops inside the call once its saved tensors are made again (uncounted)
        assert calls["autograd"] == 2 and calls["forward"] == calls["backward"] == 0
    else:
        assert calls["forward"] == 3 and calls["backward"] == 2


@pytest.mark.parametrize("form", FORMS)
def test_empty_input_takes_the_packed_path(calls, form):
    """An empty input (a rank with no samples, here with nobody to sync with): torch's kernels divide by the count
    (a float exception on CPU), so forward and backward are the packed path's; its gradients are empty and zero."""
    bn = tritonbn.SyncBatchNorm(3)
    y = _step(bn, torch.randn(0, 3, 5, 5))
    assert y.shape == (0, 3, 5, 5) and torch.equal(bn.weight.grad, torch.zeros(3))
    assert calls == {"autograd": 0, "forward": 0, "declined": 1 + int(form == "autograd"), "backward": 0}
    # torch counts the step, and its running statistics do not move
    assert bn.num_batches_tracked.item() == 1 and torch.equal(bn.running_mean, torch.zeros(3))
