"""A real training loop: a converted CNN under DDP matches one process on the global batch."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import load_ranks, save_rank, spawn

import tritonbn
from tritonbn.cli.demo import ddp_without_buffer_sync
from tritonbn.cli.demo import make_model as demo_model

pytestmark = pytest.mark.distributed

SIZES = [3, 5]  # uneven per-rank batches
STEPS = 3


def make_model():
    return demo_model((8, 8, 6), classes=3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(sum(SIZES), 3, 10, 10, generator=g) * 2 + 1, torch.randint(0, 3, (sum(SIZES),), generator=g)


def _rank_train(rank, world, out_dir):
    model = tritonbn.convert_sync_batchnorm(make_model())
    ddp = ddp_without_buffer_sync(model, torch.device("cpu"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    start = sum(SIZES[:rank])
    for step in range(STEPS):
        x, t = batch(step)
        x, t = x[start : start + SIZES[rank]], t[start : start + SIZES[rank]]
        opt.zero_grad()
        # DDP averages gradients over ranks: scale so the average is the global mean loss's gradient.
        loss = F.cross_entropy(ddp(x), t, reduction="sum") * world / sum(SIZES)
        loss.backward()
        opt.step()
    dist.barrier()
    save_rank(out_dir, rank, {k: v.detach().clone() for k, v in model.state_dict().items()})


@pytest.mark.parametrize("backend_name", ["triton", "torch"], indirect=True)
def test_ddp_training_matches_single_process(backend_name, tmp_path):
    spawn(len(SIZES), _rank_train, str(tmp_path))
    ranks = load_ranks(str(tmp_path), len(SIZES))

    reference = make_model().double()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, t = batch(step)
        opt.zero_grad()
        F.cross_entropy(reference(x.double()), t).backward()
        opt.step()
    expected = reference.state_dict()

    assert set(ranks[0]) == set(expected)
    for key, value in expected.items():
        for rank, state in enumerate(ranks):
            assert torch.equal(state[key], ranks[0][key]), f"{key} differs between rank 0 and rank {rank}"
        if value.is_floating_point():
            got = ranks[0][key].double()
            torch.testing.assert_close(got, value, atol=1e-4, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
        else:
            assert torch.equal(ranks[0][key], value), key
