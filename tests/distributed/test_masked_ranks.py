"""Masked BatchNorm over 2 gloo ranks, both backends: the float64 oracle over the real positions of every rank.

Each rank holds its own batch, padded to its own length, with NaN at the padded positions. The cases
cover uneven lengths, a rank whose every position is padding, and each layout the kernels take. A
Conformer-style convolution module trained under DDP is compared with one process that runs the
unpadded sequences.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn.functional as F
from dist import backend_env, count_all_reduces, load_ranks, save_rank, spawn
from oracle import PARAM_GRAD_TOL, TOLERANCES, make_layout
from torch import nn

import tritonbn

pytestmark = pytest.mark.distributed

WORLD = 2
C = 4
# name -> (per-rank shapes, layout, per-rank fraction of padding; 1.0: a rank of only padding)
CASES = {
    "uneven_1d": ([(3, C, 11), (2, C, 6)], "contiguous", [0.3, 0.5]),
    "padding_rank": ([(3, C, 9), (2, C, 9)], "contiguous", [0.3, 1.0]),
    "channels_last": ([(2, C, 5, 6), (3, C, 5, 6)], "channels_last", [0.4, 0.2]),
    "channels_last_3d": ([(2, C, 3, 4, 2), (1, C, 3, 4, 2)], "channels_last", [0.4, 0.4]),
    "permuted": ([(3, C, 4, 5), (2, C, 4, 5)], "permuted", [0.3, 0.6]),
}


def _rank_batch(name, rank, step):
    shapes, layout, frac = CASES[name]
    g = torch.Generator().manual_seed(100 * step + 10 * rank + len(name))
    shape = shapes[rank]
    mask = torch.rand((shape[0], *shape[2:]), generator=g) >= frac[rank]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * (1 + step) + 2).masked_fill(
        ~mask.unsqueeze(1), torch.nan
    )
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    return make_layout(x.float(), layout), dy.float(), mask


def _real(t, mask):
    return t.movedim(1, -1)[mask]


def _bn():
    bn = tritonbn.SyncBatchNorm(C, activation="silu")
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 1.5, C))
        bn.bias.copy_(torch.linspace(-1, 1, C))
    return bn


def _rank_cases(rank, world, out_dir):
    calls = count_all_reduces()
    results = {}
    for name in CASES:
        bn = _bn()
        steps = []
        for step in range(2):
            x, dy, mask = _rank_batch(name, rank, step)
            x.requires_grad_()
            calls.clear()
            y = bn(x, mask=mask)
            forward_calls = list(calls)
            y.backward(dy)
            steps.append({"y": y.detach(), "dx": x.grad, "dw": bn.weight.grad.clone(), "db": bn.bias.grad.clone(),
                          "buffers": [b.clone() for b in bn.buffers()], "forward": forward_calls,
                          "backward": calls[len(forward_calls):]})  # fmt: skip
            bn.zero_grad()
        results[name] = steps
    save_rank(out_dir, rank, results)


@pytest.fixture(scope="module", params=["triton", "torch"])
def masked_run(request):
    with backend_env(request.param), tempfile.TemporaryDirectory() as out_dir:
        spawn(WORLD, _rank_cases, out_dir)
        yield load_ranks(out_dir, WORLD)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_real_positions_of_every_rank(masked_run, name):
    ref = _bn()
    w = ref.weight.detach().double()
    b = ref.bias.detach().double()
    rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    tol, ptol = TOLERANCES[torch.float32], PARAM_GRAD_TOL[torch.float32]
    for step in range(2):
        seen = [r[name][step] for r in masked_run]
        batches = [_rank_batch(name, rank, step) for rank in range(WORLD)]
        for s in seen:  # one all-reduce per pass, of the unmasked size
            assert s["forward"] == [2 * C + 3] and s["backward"] == [2 * C + 3], (s["forward"], s["backward"])
        for a, other in zip(seen[0]["buffers"], seen[1]["buffers"], strict=True):
            assert torch.equal(a, other), "buffers differ between ranks"
        xr = torch.cat([_real(x, m) for x, _, m in batches]).double().requires_grad_()
        dyr = torch.cat([_real(dy, m) for _, dy, m in batches]).double()
        wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
        y = F.silu(F.batch_norm(xr, rm, rv, wr, br, True, 0.1, 1e-5))
        dx, dw, db = torch.autograd.grad(y, (xr, wr, br), dyr)
        got_y = torch.cat([_real(s["y"], m) for s, (_, _, m) in zip(seen, batches, strict=True)])
        got_dx = torch.cat([_real(s["dx"], m) for s, (_, _, m) in zip(seen, batches, strict=True)])
        torch.testing.assert_close(got_y.double(), y.detach(), atol=tol[0], rtol=tol[1])
        torch.testing.assert_close(got_dx.double(), dx, atol=tol[0], rtol=tol[1])
        torch.testing.assert_close(sum(s["dw"] for s in seen).double(), dw, atol=ptol[0], rtol=ptol[1])
        torch.testing.assert_close(sum(s["db"] for s in seen).double(), db, atol=ptol[0], rtol=ptol[1])
        running_mean, running_var, nbt = seen[0]["buffers"]
        torch.testing.assert_close(running_mean.double(), rm, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(running_var.double(), rv, atol=1e-5, rtol=1e-5)
        assert nbt.item() == step + 1
        for s, (_, _, m) in zip(seen, batches, strict=True):
            assert (s["y"].movedim(1, -1)[~m] == 0).all() and (s["dx"].movedim(1, -1)[~m] == 0).all()


# --- a real client: a Conformer-style convolution module under DDP -----------------------------------


class ConformerConv(nn.Module):
    """Conformer's convolution module: pointwise conv, GLU, depthwise conv, BatchNorm1d, SiLU, pointwise conv.

    ``masked``: the BatchNorm is tritonbn's, given the padding mask; else plain ``nn.BatchNorm1d``. As in
    Conformer implementations, padded positions are zeroed before the depthwise convolution, so that
    they read as the convolution's own zero padding.
    """

    def __init__(self, channels=6, kernel=5, masked=True):
        super().__init__()
        self.pointwise1 = nn.Conv1d(channels, 2 * channels, 1)
        self.depthwise = nn.Conv1d(channels, channels, kernel, padding=kernel // 2, groups=channels)
        self.norm = tritonbn.SyncBatchNorm(channels) if masked else nn.BatchNorm1d(channels)
        self.pointwise2 = nn.Conv1d(channels, channels, 1)
        self.masked = masked

    def forward(self, x, mask):
        z = F.glu(self.pointwise1(x), dim=1).masked_fill(~mask.unsqueeze(1), 0)
        z = self.depthwise(z)
        z = self.norm(z, mask=mask) if self.masked else self.norm(z)
        return self.pointwise2(F.silu(z))


LENGTHS = [[13, 7, 10], [4, 9]]  # per rank: the lengths of its items; each rank pads to its own longest


def _sequences(step):
    g = torch.Generator().manual_seed(50 + step)
    return [[torch.randn(6, n, generator=g, dtype=torch.float64) + 1.5 for n in ranks] for ranks in LENGTHS]


def _padded(seqs):
    L = max(s.shape[1] for s in seqs)
    x = torch.zeros((len(seqs), seqs[0].shape[0], L), dtype=torch.float64)  # padded with zeros, as data loaders do
    for i, s in enumerate(seqs):
        x[i, :, : s.shape[1]] = s
    return x, torch.arange(L) < torch.tensor([s.shape[1] for s in seqs])[:, None]


def _targets(step):
    g = torch.Generator().manual_seed(90 + step)
    return [[torch.randn(6, n, generator=g, dtype=torch.float64) for n in ranks] for ranks in LENGTHS]


def _model(masked=True):
    torch.manual_seed(3)
    return ConformerConv(masked=masked).double()


def _rank_conformer(rank, world, out_dir):
    model = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    outs = []
    for step in range(3):
        x, mask = _padded(_sequences(step)[rank])
        t, _ = _padded(_targets(step)[rank])
        y = model(x, mask)
        # Each rank's share of the global loss, times the world size: DDP averages the gradients.
        loss = world * ((y - t) ** 2).movedim(1, -1)[mask].sum()
        opt.zero_grad()
        loss.backward()
        outs.append({"y": y.detach(), "grads": [p.grad.clone() for p in model.parameters()]})
        opt.step()
    outs.append({"state": {k: v.clone() for k, v in model.module.state_dict().items()}})
    save_rank(out_dir, rank, outs)


def _reference_step(model, seqs, targets):
    """One process, unpadded: the convolutions per sequence, the BatchNorm over all sequences' positions at once."""
    norm = model.norm
    z = [model.depthwise(F.glu(model.pointwise1(s[None]), dim=1)) for s in seqs]
    zn = F.batch_norm(torch.cat(z, dim=2), norm.running_mean, norm.running_var, norm.weight, norm.bias, True,
                      norm.momentum, norm.eps)  # fmt: skip
    norm.num_batches_tracked += 1
    ys = [model.pointwise2(F.silu(part)) for part in zn.split([s.shape[1] for s in seqs], dim=2)]
    loss = sum(((y - t[None]) ** 2).sum() for y, t in zip(ys, targets, strict=True))
    return [y.detach() for y in ys], loss


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_conformer_module_under_ddp(backend):
    with backend_env(backend), tempfile.TemporaryDirectory() as out_dir:
        spawn(WORLD, _rank_conformer, out_dir)
        ranks = load_ranks(out_dir, WORLD)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(3):
        seqs, targets = _sequences(step), _targets(step)
        ys, loss = _reference_step(ref, [s for r in seqs for s in r], [t for r in targets for t in r])
        opt.zero_grad()
        loss.backward()
        k = 0
        for rank in range(WORLD):
            for i, n in enumerate(LENGTHS[rank]):
                torch.testing.assert_close(ranks[rank][step]["y"][i, :, :n], ys[k][0], atol=1e-10, rtol=1e-10)
                k += 1
        # float64 rounding, relative to the largest gradient (a bias before the BatchNorm has a gradient of
        # exactly 0 in exact arithmetic: what is left of it is rounding of the other terms)
        atol = 1e-12 * max(float(p.grad.abs().max()) for p in ref.parameters())
        for rank in range(WORLD):
            for got, p in zip(ranks[rank][step]["grads"], ref.parameters(), strict=True):
                torch.testing.assert_close(got, p.grad, atol=atol, rtol=1e-10)
        opt.step()
    for rank in range(WORLD):
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(ranks[rank][-1]["state"][key], value, atol=1e-10, rtol=1e-10, msg=key)
