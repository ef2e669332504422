"""tritonbn.accumulate_stats: one running-statistics update per block of micro-batches.

The oracle is ``F.batch_norm`` in float64 on the concatenation of all the block's micro-batches
(over all ranks): one step of the running statistics per block. Inside each micro-batch the
output must be unchanged, i.e. ``F.batch_norm`` on that micro-batch alone.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.nn.functional as F
from dist import backend_env, load_ranks, save_rank, spawn
from oracle import Oracle
from torch import nn

import tritonbn
from tritonbn import modules, running_stats
from tritonbn.backends.torch import local as torch_local

# (micro-batch sizes per rank) per block; rank 1 is empty in one micro-batch.
SIZES = {1: [[3], [2], [4]], 2: [[2, 1], [2, 0], [1, 3]]}
TAIL = (5, 3, 2)  # C=5, odd spatial sizes
BLOCKS = 2


def _micro_batch(block: int, k: int, world: int) -> torch.Tensor:
    """The global micro-batch ``k`` of ``block`` (float64), off-centre so that the statistics matter."""
    g = torch.Generator().manual_seed(100 * block + k)
    n = sum(SIZES[world][k])
    return torch.randn((n, *TAIL), generator=g, dtype=torch.float64) * (2.0 + k) + 3.0 * (block - k)


def _slice(x: torch.Tensor, k: int, rank: int, world: int) -> torch.Tensor:
    start = sum(SIZES[world][k][:rank])
    return x[start : start + SIZES[world][k][rank]]


def _oracle(momentum, world: int) -> Oracle:
    """The running statistics after each block, as one forward over the concatenated micro-batches."""
    oracle = Oracle(TAIL[0], affine=False, momentum=momentum)
    for block in range(BLOCKS):
        oracle.step(torch.cat([_micro_batch(block, k, world) for k in range(len(SIZES[world]))]), None)
    return oracle


def _run(bn: tritonbn.SyncBatchNorm, rank: int, world: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The blocks, forward and backward per micro-batch; returns this rank's outputs."""
    outputs = []
    for block in range(BLOCKS):
        with tritonbn.accumulate_stats(bn) as acc:
            for k in range(len(SIZES[world])):
                x = _slice(_micro_batch(block, k, world), k, rank, world).to(dtype).requires_grad_()
                y = bn(x)
                y.sum().backward()
                outputs.append(y.detach())
        assert acc.micro_batches == len(SIZES[world])
    return outputs


def _check_outputs(outputs, world, rank, dtype):
    """Each micro-batch is normalized with its own global statistics, as without accumulation."""
    atol = 1e-12 if dtype == torch.float64 else 2e-5
    i = 0
    for block in range(BLOCKS):
        for k in range(len(SIZES[world])):
            x = _micro_batch(block, k, world)
            ref = _slice(F.batch_norm(x, None, None, training=True, eps=1e-5), k, rank, world)
            torch.testing.assert_close(outputs[i].double(), ref, atol=atol, rtol=atol)
            i += 1


def _check_buffers(bn, oracle, dtype):
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(bn.running_mean.double(), oracle.running_mean, atol=tol, rtol=tol)
    torch.testing.assert_close(bn.running_var.double(), oracle.running_var, atol=tol, rtol=tol)
    assert int(bn.num_batches_tracked) == oracle.num_batches_tracked == BLOCKS


@pytest.mark.interpreter
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_one_process_matches_concatenated_batch(backend_name, momentum, dtype):
    torch.manual_seed(0)
    bn = tritonbn.SyncBatchNorm(TAIL[0], momentum=momentum, dtype=dtype)
    outputs = _run(bn, 0, 1, dtype)
    _check_outputs(outputs, 1, 0, dtype)
    _check_buffers(bn, _oracle(momentum, 1), dtype)


def _rank_main(rank, world, out_dir, momentum):
    bn = tritonbn.SyncBatchNorm(TAIL[0], momentum=momentum, dtype=torch.float64)
    outputs = _run(bn, rank, world, torch.float64)
    save_rank(out_dir, rank, {"outputs": outputs, "buffers": {k: v.clone() for k, v in bn.state_dict().items()}})


@pytest.mark.distributed
@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_two_ranks_match_concatenated_batch(backend):
    """2 gloo ranks, uneven and one empty micro-batch slice: every rank ends with the oracle's statistics."""
    world = 2
    with tempfile.TemporaryDirectory() as out, backend_env(backend):
        spawn(world, _rank_main, out, 0.1)
        ranks = load_ranks(out, world)
    oracle = _oracle(0.1, world)
    for rank, saved in enumerate(ranks):
        _check_outputs(saved["outputs"], world, rank, torch.float64)
        bn = tritonbn.SyncBatchNorm(TAIL[0], dtype=torch.float64)
        bn.load_state_dict(saved["buffers"])
        _check_buffers(bn, oracle, torch.float64)
    for key, value in ranks[0]["buffers"].items():
        assert torch.equal(value, ranks[1]["buffers"][key]), f"{key} differs between the ranks"


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = tritonbn.SyncBatchNorm(3)
        self.b = tritonbn.SyncBatchNorm(3)

    def forward(self, x, extra_a=False):
        y = self.b(self.a(x))
        return self.a(y) if extra_a else y


def _buffers(model):
    return {k: v.clone() for k, v in model.state_dict().items() if not k.endswith(("weight", "bias"))}


def _warm(model):
    model(torch.randn(4, 3, 2) + 1.0)  # running statistics away from their initial values
    return _buffers(model)


def _assert_unchanged(model, before):
    for key, value in _buffers(model).items():
        assert torch.equal(value, before[key]), f"{key} changed"


@pytest.mark.interpreter
def test_layer_called_a_different_number_of_times_leaves_stats(backend_name):
    model = TwoLayers()
    before = _warm(model)
    with pytest.raises(RuntimeError, match=r"different numbers of times.*a: 4, b: 2.*left as they were"):
        with tritonbn.accumulate_stats(model):
            for _ in range(2):
                model(torch.randn(4, 3, 2), extra_a=True)
    _assert_unchanged(model, before)
    # The model is left usable: the next block updates once from its 2 micro-batches.
    with tritonbn.accumulate_stats(model):
        model(torch.randn(4, 3, 2))
        model(torch.randn(4, 3, 2))
    assert int(model.a.num_batches_tracked) == int(before["a.num_batches_tracked"]) + 1


@pytest.mark.interpreter
def test_exception_in_block_leaves_stats(backend_name):
    model = TwoLayers()
    before = _warm(model)
    with pytest.raises(ZeroDivisionError):
        with tritonbn.accumulate_stats(model):
            model(torch.randn(4, 3, 2) * 3 + 2)
            raise ZeroDivisionError
    _assert_unchanged(model, before)
    assert not any(modules.ACCUMULATOR in m.__dict__ for m in model.modules())
    model(torch.randn(4, 3, 2))  # outside a block: the usual per-call update again
    assert int(model.a.num_batches_tracked) == int(before["a.num_batches_tracked"]) + 1


@pytest.mark.interpreter
def test_checkpoint_recompute_and_eval_are_not_counted(backend_name):
    """A recompute inside backward and an eval call add nothing: the result is still the concatenation's."""
    torch.manual_seed(0)
    bn = tritonbn.SyncBatchNorm(3, dtype=torch.float64)
    xs = [torch.randn(n, 3, 5, dtype=torch.float64) * 2 + 1 for n in (3, 4)]
    with tritonbn.accumulate_stats(bn) as acc:
        for x in xs:
            bn.train()
            y = torch.utils.checkpoint.checkpoint(bn, x.requires_grad_(), use_reentrant=False)
            y.sum().backward()
            bn.eval()
            bn(x)
    assert acc.micro_batches == 2
    oracle = Oracle(3, affine=False)
    oracle.step(torch.cat(xs), None)
    torch.testing.assert_close(bn.running_mean, oracle.running_mean, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(bn.running_var, oracle.running_var, atol=1e-12, rtol=1e-12)


def test_no_host_sync(monkeypatch):
    """The block and its exit read nothing back from the device (torch backend: the interpreter reads numpy).

    The local path's one read, on CPU alone (whether a channel lies far from zero, which there waits for nothing),
    is made as on a GPU, where the call takes the shifted copy and reads nothing."""
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    monkeypatch.setattr(torch_local, "_needs_shift", lambda mean, invstd: True)
    model = TwoLayers()
    xs = [torch.randn(4, 3, 2) for _ in range(3)]

    def refuse(*_args, **_kwargs):
        raise AssertionError("host synchronization inside accumulate_stats")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
            patch.setattr(torch.Tensor, name, refuse)
        with tritonbn.accumulate_stats(model):
            for x in xs:
                model(x).sum()
    assert int(model.a.num_batches_tracked) == 1


def test_refusals(monkeypatch):
    model = TwoLayers()
    with pytest.raises(ValueError, match="no tritonbn.SyncBatchNorm layer"):
        with tritonbn.accumulate_stats(nn.Sequential(nn.BatchNorm2d(3))):
            pass
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        tritonbn.accumulate_stats("model")
    with tritonbn.accumulate_stats(model):
        with pytest.raises(RuntimeError, match="cannot nest"):
            with tritonbn.accumulate_stats(model.a):
                pass
    with pytest.warns(UserWarning, match=r"1 BatchNorm layer\(s\) are not tritonbn layers.*: 1"):
        with tritonbn.accumulate_stats(nn.Sequential(tritonbn.SyncBatchNorm(3), nn.BatchNorm1d(3))):
            pass


def test_cuda_graph_capture_is_refused(monkeypatch):
    """Inside a capture the call raises an error naming tritonbn, and nothing is updated."""
    monkeypatch.setattr(running_stats, "_capturing", lambda device: True)
    model = TwoLayers()
    before = _warm(model)
    with pytest.raises(RuntimeError, match="tritonbn.accumulate_stats cannot run inside a CUDA graph capture"):
        with tritonbn.accumulate_stats(model):
            model(torch.randn(4, 3, 2))
    _assert_unchanged(model, before)


def test_torch_compile_runs_the_layers_eagerly_in_the_block(monkeypatch):
    """A model compiled (and run) before the block: inside it the layers fall back to eager, and the result is
    the eager one; with ``fullgraph=True`` the call raises an error that quotes tritonbn's."""
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), tritonbn.SyncBatchNorm(3)).double()
    twin = copy.deepcopy(model)
    xs = [torch.randn(n, 3, dtype=torch.float64) for n in (4, 3, 5)]
    compiled = torch.compile(model, backend="eager")
    for m in (compiled, twin):
        m(xs[0])  # outside a block: a graph that updates the running statistics is cached
        with tritonbn.accumulate_stats(m) as acc:
            for x in xs[1:]:
                m(x).sum().backward()
        assert acc.micro_batches == 2
    for key, value in twin.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=1e-12, rtol=1e-12)
    assert int(model[1].num_batches_tracked) == 2

    torch._dynamo.reset()  # forget the graphs above, which a fullgraph call would reuse
    strict = torch.compile(model, backend="eager", fullgraph=True)
    before = _buffers(model)
    with pytest.raises(RuntimeError, match="tritonbn.accumulate_stats needs eager calls"):
        with tritonbn.accumulate_stats(model):
            strict(xs[0])
    _assert_unchanged(model, before)
