"""Tensor subclasses (``__torch_function__``, as MONAI's MetaTensor) get what ``nn.BatchNorm2d`` gives them.

Both backends, one process: the output keeps the input's subclass and metadata, in-place ops on it work, and
outputs and gradients (of the input, the parameters and the residual) match the float64 oracle, in training
and eval, masked, through the functional form (which hands itself to ``__torch_function__``, as
``F.batch_norm`` does) and under ``torch.compile``. The kernels and the autograd Functions see plain tensors.
Two ranks: tests/distributed/test_subclass_ranks.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from meta_tensor import Meta

import tritonbn

C = 3
META = {"affine": [1.0, 2.0], "filename": "case_07.nii"}


def _data(shape=(4, C, 5, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 2 + 1, torch.randn(shape, generator=g)


def _bn(**kwargs):
    torch.manual_seed(1)
    bn = tritonbn.SyncBatchNorm(C, **kwargs)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(C) + 0.5)
        bn.bias.copy_(torch.randn(C))
    return bn


def _oracle(x, bn, dy, *, training=True, residual=None, act=None, mask=None):
    """``(y, dx, dw, db, dresidual)`` in float64: F.batch_norm (over the real positions for a mask), then the
    residual and the activation."""
    x64 = x.detach().double().requires_grad_()
    w = bn.weight.detach().double().requires_grad_()
    b = bn.bias.detach().double().requires_grad_()
    r64 = residual.detach().double().requires_grad_() if residual is not None else None
    if mask is None:
        rm, rv = (None, None) if training else (bn.running_mean.double(), bn.running_var.double())
        y = F.batch_norm(x64, rm, rv, w, b, training)
    else:
        real = x64.movedim(1, -1)[mask]  # (real positions, C)
        mean, var = real.mean(0), real.var(0, unbiased=False)
        shape = (1, C) + (1,) * (x.dim() - 2)
        y = (x64 - mean.view(shape)) * torch.rsqrt(var.view(shape) + bn.eps) * w.view(shape) + b.view(shape)
    y = y + r64 if r64 is not None else y
    y = act(y) if act is not None else y
    if mask is not None:
        y = y.masked_fill(~mask.unsqueeze(1), 0)
    y.backward(dy.double())
    return y.detach(), x64.grad, w.grad, b.grad, (r64.grad if r64 is not None else None)


def _close(got, want, tol=1e-5):
    torch.testing.assert_close(got.detach().as_subclass(torch.Tensor).double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_output_keeps_the_subclass_and_its_metadata(backend_name, training):
    data, dy = _data()
    bn = _bn().train(training)
    x = Meta(data.clone(), META).requires_grad_()
    y = bn(x)
    assert type(y) is Meta and y.meta == META
    y.backward(dy)
    assert type(x.grad) in (Meta, torch.Tensor)
    want_y, want_dx, want_dw, want_db, _ = _oracle(data, _bn().train(training), dy, training=training)
    _close(y, want_y)
    _close(x.grad, want_dx)
    _close(bn.weight.grad, want_dw, 1e-4)
    _close(bn.bias.grad, want_db, 1e-4)


def test_running_statistics_follow_the_plain_tensors(backend_name):
    data, _ = _data()
    bn, plain = _bn(), _bn()
    with torch.no_grad():
        bn(Meta(data, META))
        plain(data)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert type(getattr(bn, name)) is torch.Tensor
        torch.testing.assert_close(getattr(bn, name), getattr(plain, name), rtol=0, atol=0)


@pytest.mark.parametrize("op", ["relu_", "add_", "mul_"])
def test_in_place_ops_on_the_output(backend_name, op):
    """``torch.relu_(y)`` raised 'Output 0 of SyncBatchNormFunction is a view and is being modified inplace'."""
    data, dy = _data()
    bn = _bn()
    x = Meta(data.clone(), META).requires_grad_()
    y = bn(x)
    out = {"relu_": lambda t: torch.relu_(t), "add_": lambda t: t.add_(1.5), "mul_": lambda t: t.mul_(2.0)}[op](y)
    assert out is y and type(y) is Meta and y.meta == META
    y.backward(dy)
    act = {"relu_": torch.relu, "add_": lambda t: t + 1.5, "mul_": lambda t: t * 2.0}[op]
    want_y, want_dx, want_dw, want_db, _ = _oracle(data, _bn(), dy, act=act)
    _close(y, want_y)
    _close(x.grad, want_dx)
    _close(bn.weight.grad, want_dw, 1e-4)


def test_in_place_activation_after_the_layer_like_dynunet(backend_name):
    """MONAI's DynUNet block: conv, then norm, then LeakyReLU(inplace=True), on a MetaTensor."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, C, 3, padding=1), torch.nn.BatchNorm2d(C),
                                torch.nn.LeakyReLU(0.01, inplace=True))  # fmt: skip
    reference = copy.deepcopy(model).double()
    model = tritonbn.convert_sync_batchnorm(model)
    data = torch.randn(3, 2, 7, 5)
    y = model(Meta(data, META))
    assert type(y) is Meta and y.meta == META
    y.sum().backward()
    want = reference(data.double())
    want.sum().backward()
    _close(y, want.detach())
    _close(model[0].weight.grad, reference[0].weight.grad, 1e-4)


@pytest.mark.parametrize("fused", ["residual", "mask"])
def test_residual_and_mask(backend_name, fused):
    data, dy = _data((4, C, 11))
    residual = torch.randn_like(data)
    mask = torch.arange(11) < torch.tensor([11, 7, 3, 9])[:, None]
    x = Meta(data.clone(), META).requires_grad_()
    bn = _bn(activation="silu") if fused == "residual" else _bn()
    if fused == "residual":
        r = Meta(residual.clone(), {"residual": True}).requires_grad_()
        y = bn(x, r)
        want = _oracle(data, _bn(), dy, residual=residual, act=F.silu)
    else:
        y = bn(x, mask=mask)
        want = _oracle(data, _bn(), dy, mask=mask)
    assert type(y) is Meta and y.meta == META
    y.backward(dy)
    _close(y, want[0])
    _close(x.grad, want[1])
    _close(bn.weight.grad, want[2], 1e-4)
    if fused == "residual":
        _close(r.grad, want[4])


def test_functional_form_follows_the_torch_function_protocol(backend_name):
    """``sync_batch_norm`` hands itself to ``__torch_function__`` first, as ``F.batch_norm`` does."""
    data, _ = _data()
    bn = _bn()
    Meta.seen.clear()
    y = tritonbn.sync_batch_norm(Meta(data, META), bn.running_mean, bn.running_var, bn.weight, bn.bias, True)
    assert Meta.seen[0] is tritonbn.sync_batch_norm
    assert type(y) is Meta and y.meta == META
    _close(y, _oracle(data, _bn(), torch.zeros_like(data))[0])


def test_plain_tensors_take_no_torch_function_path(backend_name):
    data, _ = _data()
    Meta.seen.clear()
    y = _bn()(data)
    assert type(y) is torch.Tensor and not Meta.seen


def test_compiled(backend_name):
    data, dy = _data()
    bn = _bn()
    compiled = torch.compile(bn, backend="aot_eager")
    torch._dynamo.reset()
    x = Meta(data.clone(), META).requires_grad_()
    y = compiled(x)
    assert isinstance(y, Meta) and y.meta == META
    y.backward(dy)
    want = _oracle(data, _bn(), dy)
    _close(y, want[0])
    _close(x.grad, want[1])
    torch._dynamo.reset()


def test_fullgraph_compile_says_why_it_breaks(backend_name):
    """A subclass call is a graph break: with ``fullgraph=True`` dynamo's error carries tritonbn's reason."""
    torch._dynamo.reset()
    compiled = torch.compile(_bn(), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="tritonbn: a call on a __torch_function__ tensor subclass runs uncompiled"):
        compiled(Meta(_data()[0], META))
    torch._dynamo.reset()
