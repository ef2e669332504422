"""A ``__torch_function__`` subclass (as MONAI's MetaTensor) over 2 gloo ranks, both backends: the statistics are
the global batch's, against the float64 oracle on the concatenated batch, with one all-reduce per pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist import count_all_reduces, run_ranks, save_rank
from meta_tensor import Meta
from oracle import PARAM_GRAD_TOL, TOLERANCES

import tritonbn

pytestmark = pytest.mark.distributed

WORLD = 2
C = 3
SHAPES = [(3, C, 4, 5), (2, C, 4, 5)]  # uneven per-rank batches


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(SHAPES[rank], generator=g) * (1 + rank) + rank, torch.randn(SHAPES[rank], generator=g)


def _bn():
    torch.manual_seed(3)  # the same parameters on every rank and in the oracle
    bn = tritonbn.SyncBatchNorm(C)
    torch.nn.init.uniform_(bn.weight, 0.5, 1.5)
    torch.nn.init.normal_(bn.bias)
    return bn


def _rank(rank, world, out_dir):
    sizes = count_all_reduces()
    data, dy = _batch(rank)
    bn = _bn()
    x = Meta(data.clone(), {"rank": rank}).requires_grad_()
    y = bn(x)
    y = torch.relu_(y)  # in place on the output
    y.backward(dy)
    save_rank(out_dir, rank, {"type": type(y).__name__, "meta": y.meta, "y": y.detach().as_subclass(torch.Tensor),
                              "dx": x.grad.as_subclass(torch.Tensor), "dw": bn.weight.grad, "db": bn.bias.grad,
                              "buffers": [b.clone() for b in bn.buffers()], "sizes": sizes})  # fmt: skip


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_global_statistics(backend):
    seen = run_ranks(WORLD, _rank, backend)
    ref = _bn()
    x = torch.cat([_batch(r)[0] for r in range(WORLD)]).double().requires_grad_()
    dy = torch.cat([_batch(r)[1] for r in range(WORLD)]).double()
    w, b = ref.weight.detach().double().requires_grad_(), ref.bias.detach().double().requires_grad_()
    rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    y = F.relu(F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5))
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    tol, ptol = TOLERANCES[torch.float32], PARAM_GRAD_TOL[torch.float32]
    for rank, s in enumerate(seen):
        assert s["type"] == "Meta" and s["meta"] == {"rank": rank}
        assert s["sizes"] == [2 * C + 3, 2 * C + 3], s["sizes"]  # one all-reduce per pass (tritonbn.lockstep)
    torch.testing.assert_close(torch.cat([s["y"] for s in seen]).double(), y.detach(), atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(torch.cat([s["dx"] for s in seen]).double(), dx, atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(sum(s["dw"] for s in seen).double(), dw, atol=ptol[0], rtol=ptol[1])
    torch.testing.assert_close(sum(s["db"] for s in seen).double(), db, atol=ptol[0], rtol=ptol[1])
    for a, other in zip(seen[0]["buffers"], seen[1]["buffers"], strict=True):
        assert torch.equal(a, other), "buffers differ between ranks"
    torch.testing.assert_close(seen[0]["buffers"][0].double(), rm, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seen[0]["buffers"][1].double(), rv, atol=1e-5, rtol=1e-5)
