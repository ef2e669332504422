"""Fused epilogues act(bn(x) + residual) against the float64 oracle, at world 1 and 2; the fusion helper."""

from __future__ import annotations

import copy
import itertools
import tempfile

import pytest
import torch
import torch.nn.functional as F
from dist import backend_env, load_ranks, save_rank, spawn
from oracle import PARAM_GRAD_TOL, TOLERANCES, make_layout
from torch import nn

import tritonbn

ACTS = {
    None: lambda z: z,
    "relu": F.relu,
    "leaky_relu": lambda z: F.leaky_relu(z, 0.2),
    "silu": F.silu,
}
CASES = list(itertools.product(ACTS, [False, True], ["contiguous", "channels_last"], [torch.float32, torch.bfloat16]))
SHAPE = (6, 5, 3, 7)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g) * 2 + 1
    r = torch.randn(SHAPE, generator=g)
    dy = torch.randn(SHAPE, generator=g)
    w, b = torch.rand(5, generator=g) + 0.5, torch.randn(5, generator=g)
    return x, r, dy, w, b


def _oracle(x, r, dy, w, b, act, with_residual):
    """y, dx, dr, dw, db and the running stats of act(F.batch_norm(x) + r), in float64."""
    x = x.detach().double().requires_grad_()
    r = r.detach().double().requires_grad_()
    w, b = w.double().requires_grad_(), b.double().requires_grad_()
    rm, rv = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    z = F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5) + (r if with_residual else 0)
    y = ACTS[act](z)
    y.backward(dy.double())
    return y.detach(), x.grad, r.grad if with_residual else None, w.grad, b.grad, rm, rv


def _run_rank(x, r, dy, w, b, act, with_residual, layout, dtype):
    bn = tritonbn.SyncBatchNorm(5, activation=act, negative_slope=0.2)
    with torch.no_grad():
        bn.weight.copy_(w)
        bn.bias.copy_(b)
    x = make_layout(x, layout).to(dtype).clone().requires_grad_()  # clone: never mark the caller's tensor
    r = make_layout(r, layout).to(dtype).clone().requires_grad_() if with_residual else None
    y = bn(x, r)
    y.backward(make_layout(dy, layout).to(dtype))
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dr": r.grad if with_residual else None,
        "dw": bn.weight.grad,
        "db": bn.bias.grad,
        "rm": bn.running_mean,
        "rv": bn.running_var,
        "same_format": y.stride() == x.stride(),
    }


def _check(got, x, r, dy, w, b, act, with_residual, dtype):
    y, dx, dr, dw, db, rm, rv = _oracle(x.to(dtype), r.to(dtype), dy.to(dtype), w, b, act, with_residual)
    tol = TOLERANCES[dtype]
    close = lambda a, e, t, what: torch.testing.assert_close(
        a.double(), e, atol=t[0], rtol=t[1], msg=lambda m: f"{what}: {m}"
    )  # noqa: E501
    close(got["y"], y, tol, "y")
    close(got["dx"], dx, (4 * tol[0], 4 * tol[1]), "dx")
    if with_residual:
        close(got["dr"], dr, tol, "dresidual")
    close(got["dw"], dw, PARAM_GRAD_TOL[dtype], "dweight")
    close(got["db"], db, PARAM_GRAD_TOL[dtype], "dbias")
    close(got["rm"], rm, (1e-5, 1e-5), "running_mean")
    close(got["rv"], rv, (1e-5, 1e-5), "running_var")
    assert got["same_format"]


@pytest.mark.parametrize("act, with_residual, layout, dtype", CASES)
def test_epilogue_one_process(backend_name, act, with_residual, layout, dtype):
    x, r, dy, w, b = _data()
    got = _run_rank(x, r, dy, w, b, act, with_residual, layout, dtype)
    _check(got, x, r, dy, w, b, act, with_residual, dtype)


# On two ranks every combination runs on the PyTorch backend; the kernels (every combination of which runs in one
# process above) take five that give each activation, residual or none, layout and dtype: the synchronization is
# the passes', above the backend, and the interpreter's 32 two-rank cases took 18 s of the README's command.
TWO_RANK_CASES = {
    "torch": list(range(len(CASES))),
    "triton": [CASES.index(c) for c in [
        (None, False, "channels_last", torch.bfloat16), ("relu", True, "contiguous", torch.float32),
        ("leaky_relu", True, "channels_last", torch.float32), ("silu", False, "contiguous", torch.bfloat16),
        ("silu", True, "channels_last", torch.bfloat16),
    ]],
}  # fmt: skip


def _rank_epilogues(rank, world, out_dir, indices):
    x, r, dy, w, b = _data()
    rows = slice(0, 2) if rank == 0 else slice(2, 6)  # uneven
    results = {i: _run_rank(x[rows], r[rows], dy[rows], w, b, *CASES[i]) for i in indices}
    save_rank(out_dir, rank, results)


def _world2(name):
    with backend_env(name), tempfile.TemporaryDirectory() as out_dir:
        spawn(2, _rank_epilogues, out_dir, TWO_RANK_CASES[name])
        return load_ranks(out_dir, 2)


@pytest.fixture(scope="module")
def world2_torch():
    return _world2("torch")


@pytest.fixture(scope="module")
def world2_triton():
    return _world2("triton")


def _ids(name):
    return ["-".join(map(str, CASES[i])) for i in TWO_RANK_CASES[name]]


@pytest.mark.distributed
@pytest.mark.parametrize("index", TWO_RANK_CASES["torch"], ids=_ids("torch"))
def test_epilogue_two_ranks(world2_torch, index):
    _check_two_ranks(world2_torch, index)


@pytest.mark.distributed
@pytest.mark.parametrize("index", TWO_RANK_CASES["triton"], ids=_ids("triton"))
def test_epilogue_two_ranks_kernels(world2_triton, index):
    _check_two_ranks(world2_triton, index)


def _check_two_ranks(world2, index):
    act, with_residual, layout, dtype = CASES[index]
    r0, r1 = world2[0][index], world2[1][index]
    assert torch.equal(r0["rm"], r1["rm"]) and torch.equal(r0["rv"], r1["rv"])
    got = {k: torch.cat([r0[k], r1[k]]) for k in ("y", "dx") + (("dr",) if with_residual else ())}
    got.update(dw=r0["dw"] + r1["dw"], db=r0["db"] + r1["db"], rm=r0["rm"], rv=r0["rv"], same_format=r0["same_format"])
    x, r, dy, w, b = _data()
    _check(got, x, r, dy, w, b, act, with_residual, dtype)


# --- the model fusion helper ------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, with a downsampling shortcut."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.downsample = nn.Sequential(nn.Conv2d(3, 6, 1, stride=2, bias=False), nn.BatchNorm2d(6))

    def forward(self, x):
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def test_fusion_helper_on_a_resnet_block(backend_name):
    torch.manual_seed(0)
    block = BasicBlock()
    reference = copy.deepcopy(block)
    fused, report = tritonbn.fuse_batchnorm_activations(copy.deepcopy(block))
    assert report == ["bn1 + relu", "bn2 + add + relu"]
    assert fused.bn1.activation == "relu" and fused.bn2.activation == "relu"
    assert type(fused.get_submodule("downsample.1")) is nn.BatchNorm2d, "a BatchNorm that feeds an add stays"
    x = torch.randn(4, 3, 9, 9)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fused(xa), reference(xb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-5, rtol=1e-5)
    params, buffers = dict(reference.named_parameters()), dict(reference.named_buffers())
    assert set(dict(fused.named_parameters())) == set(params) and set(dict(fused.named_buffers())) == set(buffers)
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, atol=1e-4, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for name, buf in fused.named_buffers():
        torch.testing.assert_close(buf, buffers[name], atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_fusion_helper_patterns_and_refusals():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.BatchNorm1d(3) for _ in range(4))

        def forward(self, x, r):
            u = F.silu(self.a(x))
            v = torch.add(r, self.b(x)).relu()
            w = F.leaky_relu(self.c(x), 0.3)
            shared = self.d(x)  # used twice: not fused
            return u + v + w + F.relu(shared) + shared

    fused, report = tritonbn.fuse_batchnorm_activations(Functional())
    assert report == ["a + silu", "b + add + relu", "c + leaky_relu"]
    assert fused.c.negative_slope == 0.3 and type(fused.d) is nn.BatchNorm1d

    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x):
            return self.bn(x) if x.sum() > 0 else x

    with pytest.raises(ValueError, match="torch.fx cannot trace Untraceable"):
        tritonbn.fuse_batchnorm_activations(Untraceable())
    with pytest.raises(ValueError, match="cannot revert a SyncBatchNorm with a fused activation"):
        tritonbn.revert_sync_batchnorm(fused)
