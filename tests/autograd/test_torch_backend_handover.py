"""The PyTorch backend's hand-overs between its launchers, against the float64 oracle.

The forward's statistics hand their shifted copy ``x - p`` to the output pass, which writes ``y`` over
it; the backward's two launchers share one ``(hi, lo)`` split of the saved mean. Each hand-over is
keyed by the tensor itself and its version: these tests take each path, check it against the oracle,
and show that a different or changed tensor never receives what was made for another.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import make_layout

import tritonbn
import tritonbn.backends.torch as torch_backend
from tritonbn.backends.torch import plain as tb


def _reference(x, w, b, mean, invstd):
    """``(x - mean) * invstd * w + b`` in float64, with the given statistics."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return (x.double() - mean.double().view(shape)) * invstd.double().view(shape) * w.double().view(
        shape
    ) + b.double().view(shape)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "permuted"])
@pytest.mark.parametrize("offset", [0.0, 1e3])  # |mean| / std up to 1e3, where fp32 precision needs the shift
def test_forward_writes_y_over_the_shifted_copy(layout, offset):
    torch.manual_seed(0)
    x = make_layout(torch.randn(4, 5, 6, 7) * 2 + offset, layout)
    w, b = torch.rand(5) + 0.5, torch.randn(5)
    ref = F.batch_norm(x.double(), None, None, w.double(), b.double(), True, 0.0, 1e-5)

    stats = tb.batch_norm_stats(x)
    shifted = tb._shifted.entry[2]
    y, mean, invstd = torch_backend.batch_norm_elemt(x, w, b, stats=stats)
    assert y.data_ptr() == shifted.data_ptr(), "y is written over the statistics' shifted copy"
    assert y.stride() == x.stride() and tb._shifted.entry is None
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)

    tb.batch_norm_stats(x)
    tb._shifted.entry = None  # the other path: elemt forms x - hi itself
    y2, mean2, invstd2 = torch_backend.batch_norm_elemt(x, w, b, stats=stats)
    torch.testing.assert_close(y2.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y2, y, atol=1e-5, rtol=1e-5)  # the two paths agree to rounding
    assert torch.equal(mean, mean2) and torch.equal(invstd, invstd2)


def test_shifted_copy_goes_to_its_own_tensor_only():
    """Another tensor, or the same one changed in place, is normalized from itself, never from the copy."""
    torch.manual_seed(1)
    x1, x2 = torch.randn(6, 3, 4, 4) + 5, torch.randn(6, 3, 4, 4) - 5
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    stats = tb.batch_norm_stats(x1)
    y, mean, invstd = torch_backend.batch_norm_elemt(x2, w, b, stats=stats)  # x2 with x1's statistics
    torch.testing.assert_close(y.double(), _reference(x2, w, b, mean, invstd), atol=1e-5, rtol=1e-5)

    stats = tb.batch_norm_stats(x1)
    x1.mul_(-2.0)  # changed after its statistics: the copy of the old x1 must not be used
    y, mean, invstd = torch_backend.batch_norm_elemt(x1, w, b, stats=stats)
    torch.testing.assert_close(y.double(), _reference(x1, w, b, mean, invstd), atol=1e-5, rtol=1e-5)


def test_split_mean_follows_the_tensor():
    mean = torch.tensor([1e3 + 1e-4, -2.5e-3, 7.0], dtype=torch.float64)
    hi, lo = tb._split_mean(mean, torch.float32)
    assert hi.dtype == lo.dtype == torch.float32
    assert (hi.double() + lo.double() - mean).abs().max() < 1e-9
    assert tb._split_mean(mean, torch.float32)[0] is hi  # the backward's second launcher reuses it
    mean.add_(0.5)  # changed in place: split again
    hi, lo = tb._split_mean(mean, torch.float32)
    assert (hi.double() + lo.double() - mean).abs().max() < 1e-9
    other = mean.clone()
    assert tb._split_mean(other, torch.float32)[0] is not hi


@pytest.mark.parametrize("backend_name", ["torch"], indirect=True)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_in_16_bit_buffers(backend_name, momentum):
    """A module converted to bfloat16 keeps bfloat16 buffers, each step's update within a bfloat16 rounding of the
    float64 one: with a momentum, torch's kernel's float32 update over float32 copies (the local path); without
    (a cumulative average), computed in float64 and rounded once (the packed path)."""
    torch.manual_seed(2)
    bn = tritonbn.SyncBatchNorm(4, momentum=momentum).to(torch.bfloat16)
    ref = torch.nn.BatchNorm2d(4, momentum=momentum).double()
    for step in range(3):
        x = torch.randn(8, 4, 5, 5) * (1 + step) + 3 * step
        bn(x.to(torch.bfloat16))
        ref(x.to(torch.bfloat16).double())
        assert bn.running_mean.dtype == bn.running_var.dtype == torch.bfloat16
        torch.testing.assert_close(bn.running_mean.double(), ref.running_mean, atol=2e-2, rtol=8e-3)
        torch.testing.assert_close(bn.running_var.double(), ref.running_var, atol=2e-2, rtol=8e-3)
    assert bn.num_batches_tracked.item() == 3


@pytest.mark.parametrize("backend_name", ["torch"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("training", [True, False])
def test_inference_mode_then_autograd(backend_name, dtype, training):
    """Under ``torch.inference_mode`` (inference tensors have no version counter, so nothing is handed
    over: the float32 forward forms ``x - hi`` itself), then outside it with autograd: the same results to
    rounding, and nothing made inside (the cached constants) blocks the call outside."""
    torch.manual_seed(3)
    a, b = tritonbn.SyncBatchNorm(6).to(dtype), tritonbn.SyncBatchNorm(6).to(dtype)
    a.train(training)
    b.train(training)
    with torch.inference_mode():
        x = torch.randn(4, 6, 3, 3).to(dtype)  # an inference tensor
        ya = a(x)
    xb = x.clone().requires_grad_()
    yb = b(xb)
    yb.sum().backward()
    torch.testing.assert_close(ya, yb.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(a.running_mean, b.running_mean) and torch.equal(a.running_var, b.running_var)
    assert xb.grad is not None
