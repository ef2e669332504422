"""Bad input, cross-rank mismatches, NaN/Inf, activation checkpointing and scale."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from dist import load_ranks, save_rank, spawn
from oracle import Oracle
from torch import nn

import tritonbn
from tritonbn import backend
from tritonbn.kernels import _plan, plan

# --- clear errors before any collective -----------------------------------------------------------


def _state(bn):
    return {k: v.clone() for k, v in bn.state_dict().items()}


ERRORS = [
    # (description, call, exception, message fragment)
    (
        "1-D input",
        lambda bn: bn(torch.randn(5)),
        ValueError,
        "input must have 2 to 5 dimensions (N, C, *S), got shape (5,)",
    ),
    ("6-D input", lambda bn: bn(torch.randn(2, 3, 1, 1, 1, 1)), ValueError, "input must have 2 to 5 dimensions"),
    ("channels", lambda bn: bn(torch.randn(2, 4, 5)), ValueError, "input has 4 channels (dim 1), but num_features=3"),
    ("int input", lambda bn: bn(torch.ones(2, 3, dtype=torch.long)), TypeError, "got dtype torch.int64"),
    ("bool input", lambda bn: bn(torch.ones(2, 3, dtype=torch.bool)), TypeError, "got dtype torch.bool"),
    ("complex input", lambda bn: bn(torch.ones(2, 3, dtype=torch.complex64)), TypeError, "got dtype torch.complex64"),
    ("one value per channel", lambda bn: bn(torch.randn(1, 3)), ValueError, "Expected more than 1 value per channel"),
]


@pytest.mark.parametrize("what, call, exc, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_module_errors(backend_name, what, call, exc, message):
    bn = tritonbn.SyncBatchNorm(3)
    bn(torch.randn(4, 3))  # a real step first, so buffers are not at their defaults
    before = _state(bn)
    with pytest.raises(exc, match=re.escape(message)):
        call(bn)
    after = _state(bn)
    assert all(torch.equal(before[k], after[k]) for k in before), "a rejected call changed a buffer"


@pytest.mark.parametrize("name", ["weight", "running_mean"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_tensor_replaced_by_hand_is_checked_again(backend_name, name, training):
    """An eager call skips the checks its layer's last call passed (tritonbn._core.checks.check_eager_call), but not
    after a parameter's or buffer's ``.data`` was set by hand to another shape: the kernels would read past it."""
    bn = tritonbn.SyncBatchNorm(3).train(training)
    x = torch.randn(4, 3, 2)
    bn(x)
    getattr(bn, name).data = torch.ones(2)
    with pytest.raises(ValueError, match=f"{name} must have shape \\(3,\\)"):
        bn(x)


def test_constructor_errors():
    with pytest.raises(ValueError, match="num_features must be a positive int, got 0"):
        tritonbn.SyncBatchNorm(0)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\] or None, got 1.5"):
        tritonbn.SyncBatchNorm(3, momentum=1.5)


ARGUMENTS = [
    # (training, eps, momentum): torch's F.batch_norm decides which are errors, and what the output is
    (True, 0.0, 0.1),  # eps must be positive in training
    (True, -1e-3, 0.1),
    (True, 1e-5, 0.1),
    (False, 0.0, 0.1),  # eps = 0 is fine in eval
    (False, -1e-3, 0.1),  # negative eps is not
    (False, 1e-5, -1.0),  # momentum is unused in eval: not checked
    (False, 1e-5, 7.0),
]


@pytest.mark.parametrize("training, eps, momentum", ARGUMENTS)
def test_eps_and_momentum_checks_as_torch(backend_name, training, eps, momentum):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 5, generator=g)
    rm, rv = torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5
    ref_rm, ref_rv = rm.double(), rv.double()
    try:
        want = torch.nn.functional.batch_norm(x.double(), ref_rm, ref_rv, None, None, training, momentum, eps)
    except ValueError as e:
        want = e
    if isinstance(want, ValueError):
        with pytest.raises(ValueError, match=re.escape(str(want))):
            tritonbn.sync_batch_norm(x, rm.clone(), rv.clone(), None, None, training, momentum, eps)
        bn = tritonbn.SyncBatchNorm(3, eps=eps).train(training)
        with pytest.raises(ValueError, match=re.escape(str(want).split(", but")[0])):
            bn(x)
        return
    got = tritonbn.sync_batch_norm(x, rm, rv, None, None, training, momentum, eps)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rm.double(), ref_rm, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rv.double(), ref_rv, atol=1e-6, rtol=1e-6)


def test_momentum_set_after_construction(backend_name):
    bn = tritonbn.SyncBatchNorm(3)
    bn.momentum = -0.1
    before = _state(bn)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\] or None, got -0.1"):
        bn(torch.randn(4, 3))
    assert all(torch.equal(v, bn.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        (
            "weight",
            {"weight": torch.ones(4)},
            r"weight must have shape \(3,\) to match the 3 channels of input, got \(4,\)",
        ),
        ("bias", {"bias": torch.ones(3, 1)}, r"bias must have shape \(3,\)"),
        ("running_mean", {"running_mean": torch.zeros(2), "running_var": torch.ones(3)}, r"running_mean must have"),
        ("running_var", {"running_mean": torch.zeros(3), "running_var": torch.ones(5)}, r"running_var must have"),
        ("device", {"weight": torch.ones(3, device="meta")}, r"weight must be on the input's device cpu, got meta"),
        (
            "buffer device",
            {"running_mean": torch.zeros(3, device="meta"), "running_var": torch.ones(3)},
            r"running_mean must be on the input's device cpu",
        ),  # fmt: skip
        ("int weight", {"weight": torch.ones(3, dtype=torch.long)}, r"weight must be a floating-point tensor"),
        ("half pair", {"running_mean": torch.zeros(3)}, r"running_mean and running_var must both be tensors or both"),
        (
            "nbt",
            {"num_batches_tracked": torch.zeros(2, dtype=torch.long)},
            r"num_batches_tracked must be a one-element",
        ),
    ],
)
def test_functional_argument_errors(backend_name, name, kwargs, message):
    args = {"running_mean": None, "running_var": None, **kwargs}
    rm, rv = args.pop("running_mean"), args.pop("running_var")
    untouched = [t.clone() for t in (rm, rv) if t is not None and t.device.type == "cpu"]
    with pytest.raises((ValueError, TypeError), match=message):
        tritonbn.sync_batch_norm(torch.randn(4, 3, 2), rm, rv, training=True, **args)
    for t, u in zip([t for t in (rm, rv) if t is not None and t.device.type == "cpu"], untouched, strict=True):
        assert torch.equal(t, u)


def test_internal_functional_form_refuses_unknown_keywords():
    """``tritonbn.functional.batch_norm`` (the benchmarks' and recalibration's form) names a keyword it does not
    know, as a function that spells its keywords out would, instead of dropping it."""
    from tritonbn.functional import batch_norm

    x = torch.randn(4, 3, 2)
    with pytest.raises(TypeError, match="tritonbn batch_norm.. got unexpected keyword arguments: activaton"):
        batch_norm(x, None, None, None, None, True, 0.1, 1e-5, None, activaton="relu")
    y = batch_norm(x, None, None, None, None, True, 0.1, 1e-5, None, activation="relu")
    torch.testing.assert_close(y.double(), F.relu(F.batch_norm(x.double(), None, None, training=True)))


# --- cross-rank mismatches: TRITONBN_DEBUG=1 -------------------------------------------------------


def _layers(rank, case):
    """Two layers named by conversion, ``bn1`` and ``bn2``; on rank 1 they may differ as ``case`` says."""
    c1 = 5 if case == "channels" and rank == 1 else 4
    c2 = 5 if case == "skip, other shape" else 4
    return tritonbn.convert_sync_batchnorm(nn.ModuleDict({"bn1": nn.BatchNorm1d(c1), "bn2": nn.BatchNorm1d(c2)}))


def _mismatching_forward(rank, case, layers):
    """The forward of one training step, in which rank 1 does something else than rank 0 as ``case`` says."""
    order = ["bn1", "bn2"]
    if rank == 1 and case in ("reorder", "eval, reorder"):
        order = ["bn2", "bn1"]
    if rank == 1 and case.startswith("skip"):
        order = ["bn2"]
    if rank == 1 and case == "mode":
        layers.eval()
    outputs = []
    for name in order:
        x = torch.randn(3, layers[name].num_features, 2, requires_grad=True)
        if rank == 1 and case == "rejects input":
            x = x.detach().to(torch.int32)
        outputs.append(layers[name](x))
    # backward: rank 1's loss does not use bn2, so rank 0 runs bn2's backward while rank 1 runs bn1's
    return outputs[0].sum() if rank == 1 and case == "backward" else sum(y.sum() for y in outputs)


MISMATCHES = ["reorder", "skip", "skip, other shape", "mode", "channels", "rejects input", "backward", "eval, reorder"]


def _snapshot(layers):
    """Buffers and parameter gradients."""
    grads = {f"{k}.grad": p.grad.clone() if p.grad is not None else None for k, p in layers.named_parameters()}
    return {**{k: v.clone() for k, v in layers.state_dict().items()}, **grads}


def _rank_mismatches(rank, world, out_dir):
    results = {}
    backend = os.environ.get("TRITONBN_BACKEND")
    for case in MISMATCHES:
        torch.manual_seed(rank)
        layers = _layers(rank, case)
        # in eval without autograd, after a call like it: the route kept for it on the PyTorch backend (its native eval)
        evaluating = case.startswith("eval")
        grad = torch.no_grad() if evaluating else contextlib.nullcontext()
        if evaluating:
            layers.eval()
            os.environ["TRITONBN_BACKEND"] = "torch"
        if case != "channels":  # a matching step first: the identities agree
            with grad:
                loss = _mismatching_forward(rank, "none", layers)
            if not evaluating:
                loss.backward()
        before = _snapshot(layers)
        try:
            with grad:
                loss = _mismatching_forward(rank, case, layers)
            before = _snapshot(layers)  # the forward matched (case "backward"): it rightly updated the statistics
            if not evaluating:
                loss.backward()
            error = None
        except (ValueError, TypeError) as e:
            error = (type(e).__name__, str(e))
        same = lambda a, b: a is b is None or (a is not None and b is not None and torch.equal(a, b))  # noqa: E731
        changed = [k for k, v in _snapshot(layers).items() if not same(v, before[k])]
        if backend is None:
            os.environ.pop("TRITONBN_BACKEND", None)
        else:
            os.environ["TRITONBN_BACKEND"] = backend
        t = torch.ones(1)
        dist.all_reduce(t)  # the process group is still usable: nothing hangs, nothing is left half-done
        results[case] = {"error": error, "changed": changed, "after": t.item()}
    save_rank(out_dir, rank, results)


# (case, what every rank's error says, what it says of each rank)
EXPECTED = {
    "reorder": (
        "ranks disagree on layer at call",
        ["rank 0: forward of layer 'bn1'", "rank 1: forward of layer 'bn2'"],
    ),
    "skip": ("ranks disagree on layer at call", ["rank 0: forward of layer 'bn1'", "rank 1: forward of layer 'bn2'"]),
    "skip, other shape": (
        "ranks disagree on layer, channels (4 vs 5) at call",
        ["rank 0: forward of layer 'bn1' (channels=4", "rank 1: forward of layer 'bn2' (channels=5"],
    ),
    "mode": (
        "ranks disagree on training (eval vs train)",
        [
            "rank 0: forward of layer 'bn1' (channels=4, ndim=3, dtype=float32, training=train",
            "rank 1: forward of layer 'bn1' (channels=4, ndim=3, dtype=float32, training=eval",
        ],
    ),  # fmt: skip
    "channels": (
        "ranks disagree on channels (4 vs 5)",
        ["rank 0: forward of layer 'bn1'", "rank 1: forward of layer 'bn1'"],
    ),
    "backward": (
        "tritonbn backward: ranks disagree on layer at call",
        ["rank 0: backward of layer 'bn2'", "rank 1: backward of layer 'bn1'"],
    ),
    "eval, reorder": (
        "ranks disagree on layer at call",
        ["rank 0: forward of layer 'bn1'", "rank 1: forward of layer 'bn2'"],
    ),
}


@pytest.mark.distributed
def test_debug_mode_raises_on_every_rank(tmp_path, monkeypatch):
    """At the first call that differs, every rank raises the same error naming each rank's layer; no state changes."""
    monkeypatch.setenv("TRITONBN_DEBUG", "1")
    spawn(2, _rank_mismatches, str(tmp_path))
    ranks = load_ranks(str(tmp_path), 2)
    for case in MISMATCHES:
        got = [r[case] for r in ranks]
        for rank, g in enumerate(got):
            assert g["error"] is not None, f"{case}: rank {rank} did not raise"
            assert g["changed"] == [], f"{case}: rank {rank} changed {g['changed']}"
            assert g["after"] == 2.0
        if case == "rejects input":
            assert (
                got[1]["error"] == ("TypeError", got[1]["error"][1]) and "got dtype torch.int32" in got[1]["error"][1]
            )
            kind, message = got[0]["error"]
            assert kind == "RemoteInputError" and "another rank rejected its input" in message and "(rank 1)" in message
            assert "rank 1: forward of layer 'bn1'" in message and "rejected its input: TypeError" in message
            continue
        assert got[0]["error"] == got[1]["error"], f"{case}: the ranks raise different errors"
        kind, message = got[0]["error"]
        summary, per_rank = EXPECTED[case]
        assert kind == "ValueError" and summary in message, (case, message)
        for line in per_rank:
            assert "\n  " + line in message, (case, line, message)


def test_layer_identity():
    """Debug mode's layer identity: the qualified name from conversion, else the construction index."""
    model = nn.Sequential(nn.Conv1d(3, 4, 1), nn.BatchNorm1d(4), nn.Sequential(tritonbn.SyncBatchNorm(4)))
    built = model[2][0]._tritonbn_name
    assert re.fullmatch(r"SyncBatchNorm#\d+", built)
    assert tritonbn.SyncBatchNorm(4)._tritonbn_name != built
    tritonbn.convert_sync_batchnorm(model)
    assert (model[1]._tritonbn_name, model[2][0]._tritonbn_name) == ("1", "2.0")
    outer = tritonbn.convert_sync_batchnorm(nn.ModuleDict({"net": model}))
    assert outer["net"][1]._tritonbn_name == "net.1", "the conversion of an enclosing model renames"


def _rank_debug_ok(rank, world, out_dir):
    bn = tritonbn.SyncBatchNorm(3)
    x = torch.randn(2 + rank, 3, 4, requires_grad=True)
    bn(x).sum().backward()
    bn.eval()
    bn(x)
    save_rank(out_dir, rank, {"grad": x.grad, "rm": bn.running_mean})


@pytest.mark.distributed
def test_debug_mode_passes_matching_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONBN_DEBUG", "1")
    spawn(2, _rank_debug_ok, str(tmp_path))
    r0, r1 = load_ranks(str(tmp_path), 2)
    assert torch.equal(r0["rm"], r1["rm"])


# --- a rank that dies -----------------------------------------------------------------------------


def _rank_dies_before_backward(rank, world, out_dir):
    bn = tritonbn.SyncBatchNorm(3)
    x = torch.randn(4, 3, 2, requires_grad=True)
    y = bn(x)
    if rank == 1:
        os._exit(0)  # dies between the forward and the backward collectives
    start = time.monotonic()
    try:
        y.sum().backward()
        error = None
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    save_rank(out_dir, rank, {"error": error, "seconds": time.monotonic() - start})
    os._exit(0)  # the group is broken: no barrier, no teardown


@pytest.mark.distributed
def test_rank_death_between_forward_and_backward(tmp_path):
    """The survivor's backward all-reduce raises at once, long before the group's 20 s timeout."""
    spawn(2, _rank_dies_before_backward, str(tmp_path), timeout=datetime.timedelta(seconds=20))
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert got["error"] is not None, "the surviving rank's backward did not raise"
    assert got["seconds"] < 5.0, f"the surviving rank raised only after {got['seconds']:.1f} s"


# --- NaN and Inf stay in their channel ------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_poison_one_channel(backend_name, bad):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 5)
    x[2, 1, 3, 4] = bad
    x.requires_grad_()
    bn = tritonbn.SyncBatchNorm(3)
    y = bn(x)
    y.sum().backward()
    # the poisoned channel: the same running statistics become non-finite as in torch
    rm_ref, rv_ref = torch.zeros(3), torch.ones(3)
    y_torch = F.batch_norm(x.detach(), rm_ref, rv_ref, training=True)
    assert not torch.isfinite(rv_ref[1]), "the oracle must see the poison"
    assert torch.equal(torch.isfinite(bn.running_mean), torch.isfinite(rm_ref)), (bn.running_mean, rm_ref)
    assert torch.equal(torch.isfinite(bn.running_var), torch.isfinite(rv_ref)), (bn.running_var, rv_ref)
    assert torch.equal(torch.isfinite(y), torch.isfinite(y_torch))
    clean = [0, 2]
    assert torch.isfinite(y[:, clean]).all() and torch.isfinite(x.grad[:, clean]).all()
    assert torch.isfinite(bn.running_mean[clean]).all() and torch.isfinite(bn.running_var[clean]).all()
    oracle = Oracle(2, weight=torch.ones(2), bias=torch.zeros(2))
    y_ref, *_ = oracle.step(x.detach()[:, clean], None)
    torch.testing.assert_close(y[:, clean].detach().double(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bn.running_var[clean].double(), oracle.running_var, atol=1e-6, rtol=1e-6)


def test_fused_relu_keeps_nan(backend_name):
    """relu(NaN) is NaN in torch; a max that drops NaN operands would give 0."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5)
    x[1, 1, 2] = float("nan")
    bn = tritonbn.SyncBatchNorm(3, activation="relu").eval()
    y = bn(x)
    y_ref = torch.relu(F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias))
    assert torch.isnan(y_ref[1, 1, 2])
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref))
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5, equal_nan=True)


# --- activation checkpointing ---------------------------------------------------------------------


def _block():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv1d(3, 4, 3), tritonbn.SyncBatchNorm(4), torch.nn.ReLU())


def _checkpointed_step(x, reentrant, loss_weights):
    block = _block()
    x = x.clone().requires_grad_()
    if reentrant is None:
        y = block(x)
    else:
        y = cp.checkpoint(block, x, use_reentrant=reentrant)
    (y * loss_weights).sum().backward()
    return block, y, x.grad


def _loss_weights(n):
    return torch.linspace(-1, 1, n * 4 * 7).reshape(n, 4, 7)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_updates_running_stats_once(backend_name, reentrant):
    torch.manual_seed(1)
    x = torch.randn(5, 3, 9)
    plain, y_plain, dx_plain = _checkpointed_step(x, None, _loss_weights(5))
    block, y, dx = _checkpointed_step(x, reentrant, _loss_weights(5))
    bn = block[1]
    assert bn.num_batches_tracked.item() == 1
    assert torch.equal(bn.running_mean, plain[1].running_mean) and torch.equal(bn.running_var, plain[1].running_var)
    assert torch.equal(y, y_plain), "the recompute must give identical outputs"
    assert torch.equal(dx, dx_plain)
    assert torch.equal(bn.weight.grad, plain[1].weight.grad)


def _rank_checkpoint(rank, world, out_dir, reentrant):
    torch.manual_seed(2)
    x = torch.randn(6, 3, 9)
    block, y, dx = _checkpointed_step(x[3 * rank : 3 * rank + 3], reentrant, _loss_weights(6)[3 * rank : 3 * rank + 3])
    bn = block[1]
    save_rank(out_dir, rank, {"y": y.detach(), "dx": dx, "rm": bn.running_mean, "nbt": bn.num_batches_tracked})


@pytest.mark.distributed
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_across_ranks(tmp_path, reentrant):
    spawn(2, _rank_checkpoint, str(tmp_path), reentrant)
    r0, r1 = load_ranks(str(tmp_path), 2)
    torch.manual_seed(2)
    x = torch.randn(6, 3, 9)
    plain, y_plain, dx_plain = _checkpointed_step(x, None, _loss_weights(6))  # one process, global batch
    assert r0["nbt"].item() == r1["nbt"].item() == 1
    assert torch.equal(r0["rm"], r1["rm"])
    torch.testing.assert_close(r0["rm"], plain[1].running_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat([r0["y"], r1["y"]]), y_plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r0["dx"], r1["dx"]]), dx_plain, atol=1e-4, rtol=1e-5)


# --- scale ----------------------------------------------------------------------------------------


@pytest.fixture
def big_tiles(monkeypatch):
    monkeypatch.setattr(_plan, "_CPU_TILE", 1 << 17)
    _plan.clear_caches()
    yield
    _plan.clear_caches()


def test_counts_past_2_pow_24_are_exact(backend_name, big_tiles):
    n = (1 << 24) + 3
    assert float(torch.tensor(float(n), dtype=torch.float32)) != n, "fp32 cannot hold this count"
    x = torch.tensor([[[1.5]], [[-0.5]]]).expand(2, 1, n // 2 + 1)  # stride-0: no memory, N*S = n + 1
    x = x[:, :, : n // 2 + 1]
    ops = backend.ops_for(x)
    stats = ops.batch_norm_stats(x)
    count = x.shape[0] * x.shape[2]
    assert stats[-1].item() == count  # [sum x | sum x^2 | count] for one channel
    assert stats[0].item() == pytest.approx((count // 2) * 1.5 - (count // 2) * 0.5, rel=1e-12)
    assert stats[0].item() / stats[-1].item() == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("shape", [(3, 4099), (2, 4101, 3)])  # many channels, not a power of two
def test_many_channels(backend_name, shape):
    torch.manual_seed(3)
    x = (torch.randn(shape) * 2 + 1).requires_grad_()
    bn = tritonbn.SyncBatchNorm(shape[1])
    y = bn(x)
    dy = torch.randn(shape)
    y.backward(dy)
    oracle = Oracle(shape[1], weight=bn.weight, bias=bn.bias)
    y_ref, dx_ref, _, _ = oracle.step(x, dy)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), dx_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(bn.running_var.double(), oracle.running_var, atol=1e-5, rtol=1e-5)


def test_int64_indexing_is_chosen_past_2_pow_31():
    small = torch.empty(2, 3, 4, 5, device="meta")
    assert not plan(small.shape, small).use_int64
    big = torch.empty(3, 3, 1 << 14, 1 << 14, device="meta")  # 2.4e9 elements, offsets past 2^31
    assert plan(big.shape, big).use_int64
    cl = big.to(memory_format=torch.channels_last)
    assert plan(cl.shape, cl).use_int64


def test_int64_kernel_path(monkeypatch):
    """The int64 code path of every kernel, forced on a small input, matches the oracle."""
    monkeypatch.setenv("TRITONBN_BACKEND", "triton")
    monkeypatch.setattr(_plan, "_INT32_MAX", 10)
    _plan.clear_caches()
    try:
        torch.manual_seed(4)
        x = torch.randn(3, 4, 5, 6).to(memory_format=torch.channels_last).requires_grad_()
        assert plan(x.shape, x).use_int64
        bn = tritonbn.SyncBatchNorm(4)
        y = bn(x)
        dy = torch.randn_like(x)
        y.backward(dy)
        y_ref, dx_ref, _, _ = Oracle(4, weight=bn.weight, bias=bn.bias).step(x, dy)
        torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad.double(), dx_ref, atol=1e-5, rtol=1e-5)
    finally:
        _plan.clear_caches()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a tensor past 2^31 elements)")
def test_past_2_pow_31_elements_on_gpu():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter would copy 2^31 elements to the host; run with TRITON_INTERPRET=0")
    n = (1 << 31) + 64 * 1024
    x = torch.empty(n // 4096, 4, 1024, device="cuda", dtype=torch.bfloat16)
    x.normal_().add_(3)
    bn = tritonbn.SyncBatchNorm(4).cuda()
    y = bn(x)
    for c in range(4):  # per-channel check against torch's own float reductions
        xc = x[:, c].float()
        mean, var = xc.mean(), xc.var(unbiased=False)
        assert abs(bn.running_mean[c].item() - 0.1 * mean.item()) < 1e-3
        torch.testing.assert_close(y[-1, c].float(), ((xc[-1] - mean) / (var + 1e-5).sqrt()), atol=3e-2, rtol=3e-2)
