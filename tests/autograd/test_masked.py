"""Masked BatchNorm, one process, both backends: against the float64 oracle over the real positions only.

Padded positions of the input (and of the residual) hold NaN in these tests, so that a padded position
that reached a sum, an output or a gradient shows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compilers import COMPILERS
from oracle import PARAM_GRAD_TOL, TOLERANCES, make_layout

import tritonbn
from tritonbn.modules import SyncBatchNormAct


def real(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The real positions of ``t`` ``(N, C, *S)`` as ``(n, C)``."""
    return t.movedim(1, -1)[mask]


def padded(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return t.movedim(1, -1)[~mask]


def make_mask(shape, seed=0, p=0.4):
    mask = torch.rand((shape[0], *shape[2:]), generator=torch.Generator().manual_seed(seed)) > p
    return mask


def make_batch(shape, mask, dtype=torch.float32, layout="contiguous", seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 3
    x = x.masked_fill(~mask.unsqueeze(1), float("nan"))
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    return make_layout(x.to(dtype), layout), dy.to(dtype)


def oracle(x, dy, mask, bn, residual=None, activation=None):
    """``(y, dx, dw, db, dres, running_mean, running_var)`` in float64 over the real positions, as ``(n, C)``."""
    xr = real(x, mask).double().requires_grad_()
    w = bn.weight.detach().double().requires_grad_()
    b = bn.bias.detach().double().requires_grad_()
    rm = bn.running_mean.double().clone()
    rv = bn.running_var.double().clone()
    y = F.batch_norm(xr, rm, rv, w, b, True, bn.momentum, bn.eps)
    res = None
    if residual is not None:
        res = real(residual, mask).double().requires_grad_()
        y = y + res
    if activation == "silu":
        y = F.silu(y)
    elif activation == "relu":
        y = F.relu(y)
    inputs = (xr, w, b) + ((res,) if res is not None else ())
    grads = torch.autograd.grad(y, inputs, real(dy, mask).double())
    return (y.detach(), *grads[:3], grads[3] if res is not None else None, rm, rv)


def close(actual, expected, tol, what):
    atol, rtol = tol
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def make_bn(C, dtype=torch.float32, **kwargs):
    bn = tritonbn.SyncBatchNorm(C, **kwargs)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(C, generator=g) + 0.5)
        bn.bias.copy_(torch.randn(C, generator=g))
    return bn.to(dtype)


def check_step(x, dy, mask, bn, residual=None, activation=None, dtype=torch.float32):
    """One training step of ``bn`` with ``mask`` against the oracle; outputs and gradients 0 at padded positions."""
    want = oracle(x, dy, mask, bn, residual, activation)
    nbt = bn.num_batches_tracked.item()
    x = x.detach().requires_grad_()
    res = residual.detach().requires_grad_() if residual is not None else None
    y = bn(x, res, mask=mask)
    y.backward(dy)
    tol, ptol = TOLERANCES[dtype], PARAM_GRAD_TOL[dtype]
    close(real(y, mask), want[0], tol, "y")
    close(real(x.grad, mask), want[1], tol, "dx")
    close(bn.weight.grad, want[2], ptol, "dweight")
    close(bn.bias.grad, want[3], ptol, "dbias")
    if res is not None:
        close(real(res.grad, mask), want[4], tol, "dresidual")
        assert (padded(res.grad, mask) == 0).all(), "the residual's gradient at padded positions must be 0"
    close(bn.running_mean, want[5], (1e-5, 1e-5), "running_mean")
    close(bn.running_var, want[6], (1e-5, 1e-5), "running_var")
    assert bn.num_batches_tracked.item() == nbt + 1
    assert (padded(y, mask) == 0).all(), "the output at padded positions must be 0"
    assert (padded(x.grad, mask) == 0).all(), "the input's gradient at padded positions must be 0"
    assert y.stride() == torch.empty_like(x).stride(), "the output must keep the input's layout"


CASES = {
    "1d": ((4, 5, 13), "contiguous"),
    "2d_contiguous": ((3, 4, 5, 7), "contiguous"),
    "2d_channels_last": ((3, 4, 5, 7), "channels_last"),
    "3d_channels_last": ((3, 3, 2, 5, 3), "channels_last"),
    "permuted": ((3, 4, 5, 7), "permuted"),
    "sliced": ((4, 5, 11), "sliced"),
    "plane_49": ((3, 8, 49), "contiguous"),  # a plane the unmasked plan packs (see kernels/_plan.py)
    "2d_input": ((9, 6), "contiguous"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_real_positions(backend_name, case):
    shape, layout = CASES[case]
    mask = make_mask(shape)
    x, dy = make_batch(shape, mask, layout=layout)
    bn = make_bn(shape[1])
    check_step(x, dy, mask, bn)
    x, dy = make_batch(shape, mask, layout=layout, seed=2)  # a second step: the running statistics move on
    bn.zero_grad()
    check_step(x, dy, mask, bn)


@pytest.mark.parametrize("activation", ["relu", "silu"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_residual_and_activation(backend_name, activation, layout):
    shape = (3, 4, 5, 6)
    mask = make_mask(shape, seed=3)
    x, dy = make_batch(shape, mask, layout=layout)
    residual, _ = make_batch(shape, mask, layout=layout, seed=4)
    check_step(x, dy, mask, make_bn(4, activation=activation), residual, activation)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_bfloat16(backend_name, layout):
    shape = (4, 6, 5, 5)
    mask = make_mask(shape, seed=5)
    x, dy = make_batch(shape, mask, torch.bfloat16, layout)
    check_step(x, dy, mask, make_bn(6, torch.float32), dtype=torch.bfloat16)


def test_lengths_build_the_mask(backend_name):
    x, dy = make_batch((4, 5, 9), torch.ones(4, 9, dtype=torch.bool))
    lengths = [9, 4, 0, 6]
    mask = torch.arange(9) < torch.tensor(lengths)[:, None]
    a, b = make_bn(5), make_bn(5)
    ya = a(x, lengths=lengths)
    yb = b(x, mask=mask)
    assert torch.equal(ya, yb) and torch.equal(a.running_var, b.running_var)
    assert (padded(ya, mask) == 0).all()
    close(a.running_var, 0.9 + 0.1 * real(x, mask).double().var(0), (1e-5, 1e-5), "running_var")
    yf = tritonbn.sync_batch_norm(x, None, None, a.weight, a.bias, training=True, lengths=torch.tensor(lengths))
    assert torch.equal(yf, yb)


def test_no_real_position_leaves_running_stats(backend_name):
    shape = (3, 4, 6)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    x, dy = make_batch(shape, mask)
    bn = make_bn(4, momentum=None)
    x.requires_grad_()
    y = bn(x, mask=mask)
    y.backward(dy)
    assert (y == 0).all() and (x.grad == 0).all()
    assert (bn.weight.grad == 0).all() and (bn.bias.grad == 0).all()
    assert torch.equal(bn.running_mean, torch.zeros(4)) and torch.equal(bn.running_var, torch.ones(4))
    assert bn.num_batches_tracked.item() == 0


def test_eval_and_batch_stats_eval(backend_name):
    shape = (4, 5, 3, 4)
    mask = make_mask(shape, seed=6)
    x, dy = make_batch(shape, mask)
    bn = make_bn(5).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    x.requires_grad_()
    y = bn(x, mask=mask)
    y.backward(dy)
    want = F.batch_norm(real(x, mask).double(), bn.running_mean.double(), bn.running_var.double(),
                        bn.weight.double(), bn.bias.double(), False, 0.0, bn.eps)  # fmt: skip
    close(real(y, mask), want.detach(), TOLERANCES[torch.float32], "eval y")
    close(real(x.grad, mask), real(dy, mask).double() * (bn.weight / (bn.running_var + bn.eps).sqrt()).double(),
          TOLERANCES[torch.float32], "eval dx")  # fmt: skip
    assert (padded(y, mask) == 0).all() and (padded(x.grad, mask) == 0).all()
    # Without running statistics, eval normalizes with this batch's real positions.
    local = make_bn(5, track_running_stats=False).eval()
    y = local(x.detach(), mask=mask)
    want = F.batch_norm(real(x, mask).double(), None, None, local.weight.double(), local.bias.double(), True, 0.0,
                        local.eps)  # fmt: skip
    close(real(y, mask), want.detach(), TOLERANCES[torch.float32], "eval batch-stats y")


def test_sync_batch_norm_act_zeroes_after_unfused_activation(backend_name):
    bn = SyncBatchNormAct(4, act=torch.nn.Sigmoid())
    shape = (3, 4, 7)
    mask = make_mask(shape, seed=8)
    x, _ = make_batch(shape, mask)
    y = bn(x, mask=mask)
    assert (padded(y, mask) == 0).all(), "sigmoid(0) is 0.5: the padded positions are zeroed after the activation"
    want = torch.sigmoid(F.batch_norm(real(x, mask).double(), None, None, bn.weight.double(), bn.bias.double(), True))
    close(real(y, mask), want.detach(), TOLERANCES[torch.float32], "y")


def test_accumulate_stats_pools_real_positions(backend_name):
    shape = (3, 4, 8)
    bn = make_bn(4)
    masks = [make_mask(shape, seed=10 + i) for i in range(2)]
    xs = [make_batch(shape, m, seed=20 + i)[0] for i, m in enumerate(masks)]
    with tritonbn.accumulate_stats(bn):
        for x, m in zip(xs, masks, strict=True):
            bn(x, mask=m)
    pooled = torch.cat([real(x, m).double() for x, m in zip(xs, masks, strict=True)])
    close(bn.running_mean, 0.1 * pooled.mean(0), (1e-5, 1e-5), "running_mean")
    close(bn.running_var, 0.9 + 0.1 * pooled.var(0), (1e-5, 1e-5), "running_var")


@pytest.mark.parametrize("compiler", COMPILERS)
def test_compiled_matches_eager(backend_name, compiler, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    shape = (4, 5, 9)
    mask = make_mask(shape, seed=11)
    x, dy = make_batch(shape, mask)
    eager, compiled_bn = make_bn(5, activation="silu"), make_bn(5, activation="silu")
    compiled = torch.compile(compiled_bn, fullgraph=True, backend=compiler)
    outs = []
    for model in (eager, compiled):
        xx = x.clone().requires_grad_()
        y = model(xx, mask=mask)
        y.backward(dy)
        outs.append((y.detach(), xx.grad, model.weight.grad, model.running_var.clone()))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert (padded(outs[1][0], mask) == 0).all()


def test_higher_order_gradients_raise(backend_name):
    shape = (3, 4, 6)
    mask = make_mask(shape, seed=12)
    x, _ = make_batch(shape, mask)
    x = x.nan_to_num().requires_grad_()
    bn = make_bn(4)
    y = bn(x, mask=mask)
    with pytest.raises(RuntimeError, match="tritonbn: masked BatchNorm .* double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level(), pytest.raises(RuntimeError, match="tritonbn: masked BatchNorm .* forward-mode AD"):
        fwAD.unpack_dual(bn(fwAD.make_dual(x.detach(), torch.ones_like(x)), mask=mask)).tangent.sum()


def test_export_eval_masks_the_output():
    shape = (3, 4, 6)
    mask = make_mask(shape, seed=13)
    x, _ = make_batch(shape, mask)
    bn = make_bn(4).eval()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = bn

        def forward(self, x, mask):
            return self.bn(x, mask=mask)

    program = torch.export.export(Net(), (x, mask))
    torch.testing.assert_close(program.module()(x, mask), bn(x, mask=mask))
    bn.train()
    with pytest.raises(RuntimeError, match="tritonbn: cannot export masked BatchNorm"):
        torch.export.export(Net(), (x, mask))


BAD = {
    "mask shape": (dict(mask=torch.ones(3, 5, dtype=torch.bool)), ValueError, "mask must have the input's shape"),
    "mask dtype": (dict(mask=torch.ones(3, 6)), TypeError, "mask must be a bool tensor"),
    "mask type": (dict(mask=[[True] * 6] * 3), TypeError, "mask must be a bool tensor"),
    "lengths too long": (dict(lengths=[6, 7, 1]), ValueError, r"lengths must lie in \[0, 6\]"),
    "lengths negative": (dict(lengths=torch.tensor([6, -1, 1])), ValueError, r"lengths must lie in \[0, 6\]"),
    "lengths shape": (dict(lengths=[6, 1]), ValueError, r"lengths must have shape \(3,\)"),
    "lengths dtype": (dict(lengths=torch.tensor([6.0, 1.0, 2.0])), TypeError, "lengths must hold integers"),
    "both": (dict(lengths=[6, 1, 2], mask=torch.ones(3, 6, dtype=torch.bool)), ValueError, "mask or lengths"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_mask_arguments(backend_name, case):
    kwargs, error, match = BAD[case]
    bn = make_bn(4)
    with pytest.raises(error, match=match):
        bn(torch.randn(3, 4, 6), **kwargs)
    with pytest.raises(ValueError, match=r"lengths needs an input of shape \(N, C, L\)"):
        bn(torch.randn(3, 4, 6, 2), lengths=[1, 2, 3])
    assert bn.num_batches_tracked.item() == 0, "a rejected call must not touch the buffers"


def test_mask_on_another_device_is_rejected():
    bn = make_bn(4)
    with pytest.raises(ValueError, match="mask must be on the input's device"):
        bn(torch.randn(3, 4, 6), mask=torch.ones(3, 6, dtype=torch.bool, device="meta"))


def test_lengths_under_compile(backend_name):
    torch._dynamo.reset()
    bn = make_bn(4)
    compiled = torch.compile(lambda x, lengths: bn(x, lengths=lengths), fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 4, 7)
    y = compiled(x, torch.tensor([7, 3, 0]))
    assert (y[1, :, 3:] == 0).all() and (y[2] == 0).all() and (y[0] != 0).all()
    with pytest.raises(RuntimeError, match=r"lengths must lie in \[0, 7\]"):  # checked on the device, no sync
        compiled(x, torch.tensor([8, 3, 0]))
