"""Drop-in: torch features that act on BatchNorm modules, run on ``nn.BatchNorm*d`` and on tritonbn side by side.

Each feature gives tritonbn's layer the values torch's module gets (float64 to 1e-9, float32 to 1e-5), or the
refusal docs/limits.md documents, where torch's module fails too or tritonbn cannot synchronize: ``torch.func``
transforms, the legacy ONNX exporter on a bare layer, old checkpoints without ``num_batches_tracked``, meta-device
init with ``to_empty``, ``LazyBatchNorm2d``, full backward hooks, ``inference_mode``, CPU autocast and
``torch.compile(dynamic=True)`` with a changing batch. The ``backend_name`` fixture (tests/conftest.py) runs each
test on the Triton kernels under the interpreter and on the PyTorch backend; shapes are tiny and odd-sized.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, replace_all_batch_norm_modules_, stack_module_state, vmap

import tritonbn
from tritonbn.modules import SyncBatchNormAct

C = 3
F64 = {"rtol": 1e-9, "atol": 1e-9}
F32 = {"rtol": 1e-5, "atol": 1e-5}


def _pair(seed=0, cls=nn.BatchNorm2d, dtype=torch.float64, **kwargs):
    """``(torch's layer, tritonbn's)``: the same parameters and running statistics, made-up but fixed."""
    g = torch.Generator().manual_seed(seed)
    ref = cls(C, dtype=dtype, **kwargs)
    with torch.no_grad():
        if ref.affine:
            ref.weight.copy_(torch.rand(C, generator=g, dtype=dtype) + 0.5)
            ref.bias.copy_(torch.randn(C, generator=g, dtype=dtype))
        if ref.track_running_stats:
            ref.running_mean.copy_(torch.randn(C, generator=g, dtype=dtype))
            ref.running_var.copy_(torch.rand(C, generator=g, dtype=dtype) + 0.5)
    return ref, tritonbn.convert_sync_batchnorm(copy.deepcopy(ref))


def _x(*shape, seed=1, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2 + 0.5


def _same_state(ref, ours, tol=F64):
    for (name, a), b in zip(ref.state_dict().items(), ours.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, msg=name, **tol)


# --- torch.func transforms ------------------------------------------------------------------------------


def test_vmap_over_an_ensemble_in_eval(backend_name):
    """``stack_module_state`` + ``functional_call`` under ``vmap``: each member's running statistics."""
    x = _x(5, C, 2, 3)
    outs = []
    for side in range(2):
        members = [_pair(seed)[side].eval() for seed in range(3)]
        params, buffers = stack_module_state(members)
        base = copy.deepcopy(members[0]).to("meta")
        outs.append(vmap(lambda p, b, base=base: functional_call(base, (p, b), (x,)), in_dims=(0, 0))(params, buffers))
    torch.testing.assert_close(outs[1], outs[0], **F64)


def test_per_sample_gradients_in_eval(backend_name):
    """``vmap(grad(...))`` over the samples of a batch: the per-sample gradients of the weight and bias."""
    x = _x(5, C, 2, 3)
    got = []
    for layer in _pair():
        layer.eval()
        params = {k: v.detach() for k, v in layer.named_parameters()}
        buffers = dict(layer.named_buffers())

        def loss(p, xi, layer=layer, buffers=buffers):
            return functional_call(layer, (p, buffers), (xi.unsqueeze(0),)).square().sum()

        got.append(vmap(grad(loss), in_dims=(None, 0))(params, x))
    for name in ("weight", "bias"):
        torch.testing.assert_close(got[1][name], got[0][name], msg=name, **F64)


def test_jacrev_in_eval_with_the_fused_epilogue(backend_name):
    """``jacrev`` of a layer in eval, and of ``leaky_relu(bn(x) + residual)`` against torch's modules unfused."""
    x, r = _x(2, C, 3), _x(2, C, 3, seed=2)
    ref, ours = (m.eval() for m in _pair(cls=nn.BatchNorm1d))
    torch.testing.assert_close(jacrev(ours)(x), jacrev(ref)(x), **F64)
    fused = tritonbn.SyncBatchNorm(C, activation="leaky_relu", negative_slope=0.2, dtype=torch.float64).eval()
    fused.load_state_dict(ref.state_dict())
    want = jacrev(lambda a, b: F.leaky_relu(ref(a) + b, 0.2), argnums=(0, 1))(x, r)
    got = jacrev(lambda a, b: fused(a, b), argnums=(0, 1))(x, r)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **F64)


def test_grad_in_training_after_replace_all_batch_norm_modules(backend_name):
    """``torch.func.replace_all_batch_norm_modules_`` drops the running statistics: ``grad`` in training works."""
    x = _x(5, C, 2, 3)
    got = []
    for layer in _pair():
        replace_all_batch_norm_modules_(layer)
        params = {k: v.detach() for k, v in layer.named_parameters()}
        got.append(grad(lambda p, layer=layer: functional_call(layer, p, (x,)).pow(3).sum())(params))
    for name in ("weight", "bias"):
        torch.testing.assert_close(got[1][name], got[0][name], msg=name, **F64)


def test_vmap_over_a_stack_of_batches_in_training(backend_name):
    """Training without running statistics under ``vmap``: each slice normalized over its own batch, gradients too."""
    xs = _x(4, 5, C, 2, 3)
    outs = []
    for layer in _pair(track_running_stats=False):
        x = xs.clone().requires_grad_()
        y = vmap(layer)(x)
        (gx,) = torch.autograd.grad(y.pow(3).sum(), x)
        outs.append((y, gx))
    for a, b in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(a, b, **F64)


def test_vmap_over_an_ensemble_in_training_updates_each_members_statistics(backend_name):
    """Stacked (batched) running statistics under ``vmap`` in training: each member's update in place, as torch's.
    With ``momentum=None`` torch's module reads the count on the host and fails; tritonbn's fails by name."""
    x = _x(5, C, 2, 3)
    outs = []
    for side in range(2):
        members = [_pair(seed)[side] for seed in range(2)]
        params, buffers = stack_module_state(members)
        base = copy.deepcopy(members[0]).to("meta")
        y = vmap(lambda p, b, base=base: functional_call(base, (p, b), (x,)))(params, buffers)
        outs.append((y, buffers))
    torch.testing.assert_close(outs[1][0], outs[0][0], **F64)
    for name, want in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], want, msg=name, **F64)
    for side in range(2):
        members = [_pair(seed, momentum=None)[side] for seed in range(2)]
        params, buffers = stack_module_state(members)
        base = copy.deepcopy(members[0]).to("meta")
        match = "tritonbn: .* cannot update its running statistics .* float momentum" if side else "item"
        with pytest.raises(RuntimeError, match=match):
            vmap(lambda p, b, base=base: functional_call(base, (p, b), (x,)))(params, buffers)


def test_transforms_that_torch_refuses_in_training_are_refused_by_name(backend_name):
    """Running statistics that ``grad`` captured, or that ``vmap`` would batch into an unbatched buffer: torch's
    module fails, and tritonbn's fails too, with an error that names tritonbn and the way out, changing no buffer."""
    x, xs = _x(5, C, 2, 3), _x(2, 5, C, 2, 3)
    for side, layer in enumerate(_pair()):
        params = {k: v.detach() for k, v in layer.named_parameters()}
        match = "tritonbn: .* cannot update its running statistics .*replace_all_batch_norm_modules_" if side else None
        with pytest.raises(RuntimeError, match=match):
            grad(lambda p, layer=layer: functional_call(layer, p, (x,)).sum())(params)
        with pytest.raises(RuntimeError, match=match):
            vmap(layer)(xs)
    _same_state(_pair()[0], layer)  # tritonbn's refused calls changed no buffer


def test_training_under_a_transform_that_would_synchronize_is_refused(backend_name, monkeypatch):
    """A layer with a process group of 2 ranks in training under a transform raises before any collective, naming
    the way out; in eval it needs no group and runs. (A stand-in group: the refusal comes before it is used.)"""

    class TwoRanks:
        def size(self):
            return 2

    monkeypatch.setattr(tritonbn.modules, "resolve_group", lambda group: TwoRanks())
    layer = tritonbn.SyncBatchNorm(C, track_running_stats=False, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="synchronizes its statistics over a process group of 2 ranks.*revert"):
        vmap(layer)(_x(2, 5, C, 3))
    ref, ours = _pair(cls=nn.BatchNorm1d)
    torch.testing.assert_close(vmap(ours.eval())(_x(2, 5, C, 3)), vmap(ref.eval())(_x(2, 5, C, 3)), **F64)


def test_masked_call_under_a_transform_is_refused(backend_name):
    layer = tritonbn.SyncBatchNorm(C, dtype=torch.float64).eval()
    with pytest.raises(RuntimeError, match="tritonbn: masked BatchNorm .* torch.func transform"):
        jacrev(lambda a: layer(a, lengths=torch.tensor([3, 1])))(_x(2, C, 3))


# --- the legacy ONNX exporter on a bare layer --------------------------------------------------------------


@pytest.mark.parametrize("layer", ["SyncBatchNorm", "SyncBatchNormAct"])
def test_legacy_onnx_export_of_a_bare_layer(layer, tmp_path):
    """``torch.onnx.export(layer, (x,), dynamo=False)`` of the layer alone, as of ``nn.BatchNorm1d`` alone: both
    files give the eager layer's output in onnxruntime. A positional mask outside that exporter stays an error."""
    ort = pytest.importorskip("onnxruntime", reason="the test extra installs onnxruntime")
    ref, ours = (m.float().eval() for m in _pair(cls=nn.BatchNorm1d))
    if layer == "SyncBatchNormAct":
        ref = nn.Sequential(ref, nn.GELU()).eval()
        ours = SyncBatchNormAct(C, act=nn.GELU()).eval()
        ours.load_state_dict(ref[0].state_dict())
    x = _x(4, C, 5, dtype=torch.float32)
    for name, model in (("torch", ref), ("tritonbn", ours)):
        path = str(tmp_path / f"{name}.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"], output_names=["y"])
        (got,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
        torch.testing.assert_close(torch.from_numpy(got), ref(x), msg=name, **F32)
    with pytest.raises(TypeError, match="pass mask= and lengths= by keyword"):
        ours(x, None, torch.ones(4, 5, dtype=torch.bool))


# --- modules, checkpoints, hooks, modes ------------------------------------------------------------------------


def _train_step(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.pow(3).sum().backward()
    return y.detach(), x.grad


def test_old_checkpoint_without_num_batches_tracked(backend_name):
    """A checkpoint from before ``num_batches_tracked`` (version 1 metadata): loaded as torch's module loads it,
    then trained and evaluated alike (``momentum=None``, whose factor that count gives, included)."""
    for momentum in (0.1, None):
        ref, ours = _pair(momentum=momentum)
        state = ref.state_dict()
        del state["num_batches_tracked"]
        state._metadata[""]["version"] = 1
        for layer in (ref, ours):
            layer.num_batches_tracked.fill_(7)
            layer.load_state_dict(state)
        assert ours.num_batches_tracked.item() == ref.num_batches_tracked.item() == 7  # torch keeps the count it had
        x = _x(5, C, 2, 3)
        for a, b in zip(_train_step(ours, x), _train_step(ref, x), strict=True):
            torch.testing.assert_close(a, b, **F64)
        _same_state(ref, ours)
        torch.testing.assert_close(ours.eval()(x), ref.eval()(x), **F64)


def test_meta_device_init_with_to_empty(backend_name):
    """Built on the meta device, moved with ``to_empty`` and reset: torch's initial state, then the same step."""
    layers = []
    for cls in (nn.BatchNorm2d, tritonbn.SyncBatchNorm):
        with torch.device("meta"):
            layer = cls(C, dtype=torch.float64)
        layer.to_empty(device="cpu")
        layer.reset_parameters()
        layers.append(layer)
    ref, ours = layers
    _same_state(ref, ours)
    x = _x(5, C, 2, 3)
    for a, b in zip(_train_step(ours, x), _train_step(ref, x), strict=True):
        torch.testing.assert_close(a, b, **F64)
    _same_state(ref, ours)


def test_lazy_batchnorm(backend_name):
    """``LazyBatchNorm2d``: before its first call conversion leaves it alone with a warning naming it (it has no
    parameters yet); after a dry run it is a ``BatchNorm2d`` and converts, computing the same."""
    with pytest.warns(UserWarning, match="uninitialized lazy module"):
        lazy = tritonbn.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d(dtype=torch.float64)))
    assert type(lazy[0]) is nn.LazyBatchNorm2d
    model = nn.Sequential(nn.LazyBatchNorm2d(dtype=torch.float64))
    x = _x(5, C, 2, 3)
    model.eval()(x)  # the dry run materializes it
    ref = model.train()
    ours = tritonbn.convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(ours[0], tritonbn.SyncBatchNorm)
    for a, b in zip(_train_step(ours, x), _train_step(ref, x), strict=True):
        torch.testing.assert_close(a, b, **F64)
    _same_state(ref, ours)


def test_full_backward_hooks(backend_name):
    """``register_full_backward_hook`` (and its pre-hook) see the same gradients on both layers."""
    x = _x(5, C, 2, 3)
    seen = []
    for layer in _pair():
        got = {}
        layer.register_full_backward_pre_hook(lambda m, gout, got=got: got.update(pre=gout[0].clone()))
        layer.register_full_backward_hook(lambda m, gin, gout, got=got: got.update(gin=gin[0], gout=gout[0]))
        _train_step(layer, x)
        seen.append(got)
    for name in ("pre", "gin", "gout"):
        torch.testing.assert_close(seen[1][name], seen[0][name], msg=name, **F64)


def test_inference_mode(backend_name):
    """Under ``torch.inference_mode``: eval, and training (which updates the running statistics)."""
    x = _x(5, C, 2, 3)
    ref, ours = _pair()
    for training in (False, True):
        with torch.inference_mode():
            got, want = ours.train(training)(x), ref.train(training)(x)
        torch.testing.assert_close(got, want, **F64)
        _same_state(ref, ours)


def test_cpu_autocast(backend_name):
    """Under CPU autocast (bfloat16) a float32 layer computes in float32, as torch's: same dtype, same values."""
    ref, ours = (m.float() for m in _pair())
    x = _x(5, C, 2, 3, dtype=torch.float32)
    for training in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = nn.Sequential(nn.Identity(), ref.train(training))(x)
            got = ours.train(training)(x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **F32)
        _same_state(ref, ours, F32)


def test_compile_dynamic_with_a_changing_batch(backend_name):
    """``torch.compile(dynamic=True)`` (aot_eager) in training over batches of 3, 5 and 2: torch's eager values."""
    torch._dynamo.reset()
    ref, ours = (m.float() for m in _pair())
    compiled = torch.compile(ours, dynamic=True, backend="aot_eager")
    for n, seed in ((3, 1), (5, 2), (2, 3)):
        x = _x(n, C, 3, 1, seed=seed, dtype=torch.float32)
        for a, b in zip(_train_step(compiled, x), _train_step(ref, x), strict=True):
            torch.testing.assert_close(a, b, **F32)
        _same_state(ref, ours, F32)
