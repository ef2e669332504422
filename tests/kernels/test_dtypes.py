"""Every dtype combination of input x parameters x buffers, float64 at float64 precision, one launch per pass."""

import pytest
import torch
import torch.nn.functional as F
from oracle import PARAM_GRAD_TOL, TOLERANCES

import tritonbn
from tritonbn.kernels import _plan, _workspace

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ATOL = {**TOLERANCES, torch.float64: (1e-12, 1e-12)}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("buffers", [torch.float32, torch.float64], ids=["buf32", "buf64"])
@pytest.mark.parametrize("params", [torch.float32, torch.float64], ids=["par32", "par64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_combinations(backend_name, dtype, params, buffers, training):
    """Output in the input's dtype, buffers keep theirs, values as the float64 oracle; never an aliasing error."""
    torch.manual_seed(11)
    C = 3
    x = (torch.randn(4, C, 3, 5, dtype=torch.float64) * 2 + 1).to(dtype)
    w = (torch.rand(C, dtype=torch.float64) + 0.5).to(params)
    b = torch.randn(C, dtype=torch.float64).to(params)
    rm = torch.randn(C, dtype=torch.float64).to(buffers)
    rv = (torch.rand(C, dtype=torch.float64) + 0.5).to(buffers)
    rm_ref, rv_ref = rm.double().clone(), rv.double().clone()
    xd = x.double().clone().requires_grad_()  # a copy also when x is already float64
    y_ref = F.batch_norm(xd, rm_ref, rv_ref, w.double(), b.double(), training, 0.1, 1e-5)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)

    xt = x.detach().clone().requires_grad_()
    y = tritonbn.sync_batch_norm(xt, rm, rv, w, b, training=training, momentum=0.1, eps=1e-5)
    y.backward(dy.to(dtype))
    assert y.dtype == dtype and rm.dtype == buffers and rv.dtype == buffers
    atol, rtol = ATOL[dtype]
    torch.testing.assert_close(y.double(), y_ref.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(xt.grad.double(), xd.grad, atol=4 * atol, rtol=4 * rtol)
    # Buffers: the oracle's update rounded once to the buffers' dtype.
    btol = 1e-12 if buffers == torch.float64 and dtype == torch.float64 else 1e-6
    torch.testing.assert_close(rm.double(), rm_ref, atol=btol, rtol=btol)
    torch.testing.assert_close(rv.double(), rv_ref, atol=btol, rtol=btol)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_module(backend_name, dtype, training):
    """``SyncBatchNorm(C).to(dtype)``: weight, bias and buffers in fp16/bf16 too (the kernels compute in
    fp32/fp64 and round once into them). Output, every gradient and the running statistics against the
    float64 oracle on the same rounded parameters."""
    torch.manual_seed(13)
    C = 5
    bn = tritonbn.SyncBatchNorm(C).to(dtype).train(training)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(C) + 0.5)
        bn.bias.copy_(torch.randn(C))
        bn.running_mean.copy_(torch.randn(C))
        bn.running_var.copy_(torch.rand(C) + 0.5)
    rm_ref, rv_ref = bn.running_mean.double().clone(), bn.running_var.double().clone()
    w_ref = bn.weight.detach().double().requires_grad_()
    b_ref = bn.bias.detach().double().requires_grad_()
    x = (torch.randn(4, C, 3, 7, dtype=torch.float64) * 2 + 1).to(dtype)
    xd = x.double().requires_grad_()
    y_ref = F.batch_norm(xd, rm_ref, rv_ref, w_ref, b_ref, training, 0.1, 1e-5)
    dy = torch.randn_like(y_ref).to(dtype)
    y_ref.backward(dy.double())

    xt = x.clone().requires_grad_()
    y = bn(xt)
    y.backward(dy)
    atol, rtol = ATOL[dtype]
    assert y.dtype == bn.weight.grad.dtype == bn.running_mean.dtype == dtype
    torch.testing.assert_close(y.double(), y_ref.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(xt.grad.double(), xd.grad, atol=4 * atol, rtol=4 * rtol)
    gatol, grtol = PARAM_GRAD_TOL[dtype]
    torch.testing.assert_close(bn.weight.grad.double(), w_ref.grad, atol=gatol, rtol=grtol)
    torch.testing.assert_close(bn.bias.grad.double(), b_ref.grad, atol=gatol, rtol=grtol)
    # Buffers: the oracle's update rounded once to the buffers' dtype; to bf16 within one unit in the last
    # place, since Triton's interpreter truncates fp32 to bf16 where a GPU rounds to nearest.
    btol = 2.0**-7 if dtype == torch.bfloat16 and backend_name == "triton" else 0.0
    torch.testing.assert_close(bn.running_mean, rm_ref.to(dtype), atol=0, rtol=btol)
    torch.testing.assert_close(bn.running_var, rv_ref.to(dtype), atol=0, rtol=btol)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_float64_module_eval_and_train(backend_name, training):
    """A float64 module runs (no aliasing error) and matches torch's BatchNorm2d in float64 bit for bit or nearly."""
    torch.manual_seed(2)
    bn = tritonbn.SyncBatchNorm(3).double().train(training)
    ref = torch.nn.BatchNorm2d(3).double().train(training)
    with torch.no_grad():
        for m in (bn, ref):
            m.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
            m.running_var.copy_(torch.tensor([1.5, 0.25, 4.0]))
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(bn(x), ref(x), atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(bn.running_var, ref.running_var, atol=1e-14, rtol=1e-14)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_gradcheck_float64(backend_name, training):
    """torch.autograd.gradcheck at its default tolerances, as F.batch_norm passes it."""
    torch.manual_seed(4)
    x = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)  # 6 values per channel, 2 programs each
    w = (torch.rand(2, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)

    def f(x, w, b, r):
        return tritonbn.sync_batch_norm(
            x, rm.clone(), rv.clone(), w, b, training=training, residual=r, activation="silu"
        )

    assert torch.autograd.gradcheck(f, (x, w, b, r))

    def plain(x, w, b):
        return tritonbn.sync_batch_norm(x, rm.clone(), rv.clone(), w, b, training=training)

    assert torch.autograd.gradcheck(plain, (x, w, b))


def test_one_launch_per_pass_and_tickets_reset(small_tiles, monkeypatch):
    """Training forward and backward take one launch each after the collective, eval one; tickets go back to 0."""
    from tritonbn import kernels

    monkeypatch.setenv("TRITONBN_BACKEND", "triton")
    launches = []
    for name in ("stats", "elemt", "backward_reduce", "backward_elemt"):
        module = getattr(kernels, name)
        kernel = next(v for k, v in vars(module).items() if k.startswith("_batch_norm") and k.endswith("_kernel"))
        original = kernel.run

        def counting(*args, _original=original, _name=name, **kwargs):
            launches.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", counting)
    torch.manual_seed(0)
    x = torch.randn(5, 6, 7, requires_grad=True)
    bn = tritonbn.SyncBatchNorm(6, momentum=None)
    assert _plan.plan(x.shape, x).r_progs > 1
    y = bn(x)
    assert launches == ["stats", "elemt"]
    y.backward(torch.randn_like(y))
    assert launches == ["stats", "elemt", "backward_reduce", "backward_elemt"]
    bn.eval()
    bn(x.detach())
    assert launches[4:] == ["elemt"]
    for ws in _workspace._workspaces.values():
        assert not ws.tickets.any(), "a kernel left a ticket counter non-zero"
    # Two identical steps give the same bits: the merge order does not depend on arrival order.
    outs = []
    for _ in range(2):
        fresh = tritonbn.SyncBatchNorm(6, momentum=None)
        xi = x.detach().clone().requires_grad_()
        yi = fresh(xi)
        yi.backward(torch.ones_like(yi) + xi.detach())
        outs.append((yi, xi.grad, fresh.running_var, fresh.num_batches_tracked))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True)) and outs[0][3].item() == 1
