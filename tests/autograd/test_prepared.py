"""The launches a layer keeps for eager calls like its last one (``tritonbn/backends/triton/_prepared.py``).

A layer's eager calls find their launches once per checked record (input shape, strides, dtype, device; the same
parameters and buffers) and mode (training or eval, with or without gradients, the upstream gradient's strides
and dtype, which gradients are asked for). One layer runs a sequence of calls that each need other launches than
the call before, and every output, gradient and running statistic is compared with the float64 ``F.batch_norm``
oracle: a launch kept past what it depends on gives wrong numbers here.
"""

from __future__ import annotations

import pytest
import torch
from oracle import PARAM_GRAD_TOL, TOLERANCES, Oracle, make_layout
from torch.utils.checkpoint import checkpoint

import tritonbn
from tritonbn import backend
from tritonbn.backends.triton import _plan, backward_elemt, backward_reduce, elemt, stats

pytestmark = pytest.mark.skipif(not backend.interpreted(), reason="needs the Triton kernels (TRITON_INTERPRET=1)")

C = 6


def _close(got, want, dtype, param=False):
    atol, rtol = (PARAM_GRAD_TOL if param else TOLERANCES).get(dtype, (1e-9, 1e-9))
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def _step(bn, oracle, x, dy=None, *, training=True, grad=True, needs_weight=True, recompute=False):
    """One call of ``bn`` (forward, and backward with ``dy``), checked against ``oracle``'s."""
    if bn.training != training:  # (train() rebuilds the layer's settings, and with them what it kept)
        bn.train(training)
    bn.zero_grad(set_to_none=True)
    bn.weight.requires_grad_(needs_weight)
    xi = x.detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        y = checkpoint(bn, xi, use_reentrant=False) if recompute else bn(xi)
    want_y, want_dx, want_dw, want_db = oracle.step(x, dy if grad else None, training)
    _close(y, want_y, x.dtype)
    if grad:
        y.backward(dy)
        _close(xi.grad, want_dx, x.dtype)
        _close(bn.bias.grad, want_db, x.dtype, param=True)
        if needs_weight:
            _close(bn.weight.grad, want_dw, x.dtype, param=True)
        else:
            assert bn.weight.grad is None
    _close(bn.running_mean, oracle.running_mean, x.dtype)
    _close(bn.running_var, oracle.running_var, x.dtype)
    assert bn.num_batches_tracked.item() == oracle.num_batches_tracked


@pytest.fixture
def finds(monkeypatch):
    """How many times each launcher looked its launch up by its full key."""
    seen = {}
    for module in (stats, elemt, backward_reduce, backward_elemt):
        name = module.__name__.rsplit(".", 1)[1]

        def counting(*args, _find=module.find, _name=name, **kwargs):
            seen[_name] = seen.get(_name, 0) + 1
            return _find(*args, **kwargs)

        monkeypatch.setattr(module, "find", counting)
    return seen


def test_launches_follow_every_change_of_the_call(finds):
    torch.manual_seed(0)
    bn = tritonbn.SyncBatchNorm(C)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    oracle = Oracle(C, weight=bn.weight, bias=bn.bias)
    shape = (4, C, 5, 3)
    x, dy = torch.randn(shape), torch.randn(shape)
    _step(bn, oracle, x, dy)
    first = dict(finds)
    assert first == {"stats": 1, "elemt": 1, "backward_reduce": 1, "backward_elemt": 1}
    _step(bn, oracle, torch.randn(shape), torch.randn(shape))
    assert finds == first, "a call like the last one found its launches again"

    def found_again(*names, **call):
        """The call ``_step(bn, oracle, **call)``, which the launchers ``names`` must each look up anew."""
        before = dict(finds)
        _step(bn, oracle, **call)
        stale = [name for name in names if finds.get(name, 0) == before.get(name, 0)]
        assert not stale, f"{stale} kept a launch for {[(k, getattr(v, 'shape', v)) for k, v in call.items()]}"

    all_four = ("stats", "elemt", "backward_reduce", "backward_elemt")
    # New strides (the same shape): channels_last, a non-dense slice, a permuted layout.
    for layout in ("channels_last", "sliced", "permuted"):
        found_again(*all_four, x=make_layout(torch.randn(shape), layout), dy=torch.randn(shape))
    # A new shape, of another rank; then the first again, with gradients of other strides.
    found_again(*all_four, x=torch.randn(3, C, 7), dy=torch.randn(3, C, 7))
    found_again(*all_four, x=x, dy=dy)
    backward = ("backward_reduce", "backward_elemt")
    found_again(*backward, x=x, dy=torch.randn(1, C, 1, 1).expand(shape))  # stride 0, as from .sum().backward()
    found_again(*backward, x=x, dy=make_layout(torch.randn(shape), "channels_last"))
    _step(bn, oracle, x, dy.double())  # (autograd hands backward the gradient in y's dtype)
    found_again("backward_reduce", x=x, dy=dy, needs_weight=False)  # another set of gradients asked for
    found_again("elemt", x=x, dy=None, grad=False)  # no autograd: the statistics are not saved
    found_again("elemt", x=x, dy=dy, recompute=True)  # a checkpoint's recompute leaves the running statistics alone
    found_again("elemt", "backward_elemt", x=x, dy=dy, training=False)  # eval, with gradients
    found_again("elemt", x=x, dy=dy)  # training again: new settings, the launches found once more
    _step(bn, oracle, x, dy)
    _plan.clear_caches()  # the plans' constants changed: what the layer kept is stale
    before = finds["stats"]
    _step(bn, oracle, x, dy)
    assert finds["stats"] == before + 1
    # A new dtype (the module converted, the input too), and a parameter replaced by hand.
    bn.double()
    oracle = Oracle(C, weight=bn.weight, bias=bn.bias)
    oracle.running_mean, oracle.running_var = bn.running_mean.clone(), bn.running_var.clone()
    oracle.num_batches_tracked = bn.num_batches_tracked.item()
    _step(bn, oracle, x.double(), dy.double())
    bn.weight.data = bn.weight.data.float()
    bn.bias.data = bn.bias.data.float()
    for name in ("running_mean", "running_var"):
        setattr(bn, name, getattr(bn, name).float())
    _step(bn, oracle, x, dy)


@pytest.mark.parametrize("dtype, affine", [(torch.float32, True), (torch.bfloat16, True), (torch.float64, False)])
def test_prepared_launchers_return_the_public_launchers_tensors(dtype, affine):
    """A layer's prepared launchers allocate their outputs like the ones they kept (``Prepared.like``): on each call,
    the second too, every output has the public launcher's shape, strides, dtype and device, and its values, bitwise
    (a launch found for a float32 pointer and handed a float64 buffer reads garbage on a GPU, not here)."""
    from tritonbn.backends.launchers import Launchers
    from tritonbn.backends.triton._prepared import Prepared

    torch.manual_seed(0)
    x, dy = torch.randn(3, C, 5, dtype=dtype), torch.randn(3, C, 5, dtype=dtype)
    w, b = (torch.rand(C, dtype=dtype) + 0.5, torch.randn(C, dtype=dtype)) if affine else (None, None)
    kept = Prepared()
    prepared = Launchers(kept.stats, kept.elemt, kept.backward_reduce, kept.backward_elemt)  # public signatures

    def same(got, want):
        for g, h in zip(got, want, strict=True):
            assert (g is None) == (h is None)
            if g is not None:
                assert (g.shape, g.stride(), g.dtype, g.device) == (h.shape, h.stride(), h.dtype, h.device)
                assert torch.equal(g, h)

    for _ in range(2):
        st = prepared.batch_norm_stats(x)
        same([st], [stats.batch_norm_stats(x)])
        rm, rv = torch.zeros(C, dtype=dtype), torch.ones(C, dtype=dtype)
        got = prepared.batch_norm_elemt(x, w, b, stats=st, running_mean=rm.clone(), running_var=rv.clone())
        y, mean, invstd = elemt.batch_norm_elemt(x, w, b, stats=st, running_mean=rm.clone(), running_var=rv.clone())
        same(got, (y, mean, invstd))
        got = prepared.batch_norm_backward_reduce(dy, x, mean, invstd, w, weight_grad=affine, bias_grad=affine)
        sums, *grads = backward_reduce.batch_norm_backward_reduce(
            dy, x, mean, invstd, w, weight_grad=affine, bias_grad=affine
        )
        same(got, (sums, *grads))
        count = st[-1:]
        same([prepared.batch_norm_backward_elemt(dy, x, mean, invstd, w, sums, count)],
             [backward_elemt.batch_norm_backward_elemt(dy, x, mean, invstd, w, sums, count)])  # fmt: skip
