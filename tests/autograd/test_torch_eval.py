"""Eval with running statistics on the PyTorch backend: one native pass, as ``nn.BatchNorm2d``'s
(``tritonbn.backends.torch.local.evaluated``), and the per-call checks an eager layer remembers
(``tritonbn._core.checks.check_eager_call``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from meta_tensor import Meta

import tritonbn
from tritonbn.backends.torch import local


@pytest.fixture
def evals(monkeypatch):
    """How many eval calls the one native pass took (``taken``) and declined, and how many eager calls under autograd
    torch's own ops took, recorded by autograd (``recorded``, counted only when taken)."""
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    seen = {"taken": 0, "declined": 0}
    original, original_native, original_recorded = local.evaluated, local.evaluate, local.recorded_eval

    def count(*args):
        y = original(*args)
        seen["taken" if y is not None else "declined"] += 1
        return y

    def count_native(*args):
        seen["taken"] += 1
        return original_native(*args)

    def count_recorded(*args):
        seen["recorded"] = seen.get("recorded", 0) + 1
        return original_recorded(*args)

    monkeypatch.setattr(local, "evaluated", count)
    monkeypatch.setattr(local, "evaluate", count_native)
    monkeypatch.setattr(local, "recorded_eval", count_recorded)
    return seen


def _layer(C, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    bn = tritonbn.SyncBatchNorm(C, **kwargs).to(dtype)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    return bn.eval()


def _reference(bn, x, residual=None, running_mean=None, running_var=None):
    """``nn.BatchNorm2d``'s eval (over the layer's buffers, or the ones given: the float64 oracle's, as they were)
    followed by torch's own add and activation."""
    rm = bn.running_mean if running_mean is None else running_mean
    rv = bn.running_var if running_var is None else running_var
    y = F.batch_norm(x, rm, rv, bn.weight, bn.bias, False, 0.0, bn.eps)
    if residual is not None:
        y = y + residual
    if bn.activation == "relu":
        y = F.relu(y)
    elif bn.activation == "silu":
        y = F.silu(y)
    elif bn.activation == "leaky_relu":
        y = F.leaky_relu(y, bn.negative_slope)
    return y


@pytest.mark.parametrize("grad", ["inference_mode", "no_grad", "autograd"])
@pytest.mark.parametrize("epilogue", [None, "relu", "residual_silu"])
def test_float64_is_f_batch_norm(evals, grad, epilogue):
    """float64: the values of ``F.batch_norm`` (and torch's own epilogue ops) to the bit, and its gradients."""
    activation = {"relu": "relu", "residual_silu": "silu"}.get(epilogue)
    bn = _layer(6, torch.float64, activation=activation)
    x = torch.randn(4, 6, 5, 3, dtype=torch.float64) * 3 + 2
    r = torch.randn_like(x) if epilogue == "residual_silu" else None
    if grad == "autograd":
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = bn(xa, r)
        dy = torch.randn_like(y)
        y.backward(dy)
        grads = (xa.grad, bn.weight.grad.clone(), bn.bias.grad.clone())
        bn.zero_grad()
        ref = _reference(bn, xb, r)
        ref.backward(dy)
        assert torch.equal(y, ref)
        for got, want in zip(grads, (xb.grad, bn.weight.grad, bn.bias.grad), strict=True):
            assert torch.equal(got, want)  # torch's own eval backward, recorded by autograd
        assert evals == {"taken": 0, "declined": 0, "recorded": 1}
    else:
        with torch.inference_mode() if grad == "inference_mode" else torch.no_grad():
            assert torch.equal(bn(x, r), _reference(bn, x, r))
        assert evals == {"taken": 1, "declined": 0}


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("grad", [False, True])
def test_large_mean_within_the_inputs_rounding(evals, layout, grad):
    """float32 at ``|mean| / std = 1e3`` against float64: the one affine pass errs by a few ulp of ``|x| * alpha``
    (the input's own rounding at that size, about ``1e3`` ulp of ``y``), never more; and it is torch's eval
    kernel's own value, bit for bit."""
    C = 5
    bn = _layer(C)
    std = torch.tensor([1e-3, 0.1, 1.0, 10.0, 300.0])
    mean = 1e3 * std * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    with torch.no_grad():
        bn.running_mean.copy_(mean)
        bn.running_var.copy_(std**2)
    x = torch.randn(8, C, 6, 6) * std[:, None, None] + mean[:, None, None]
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_(grad)
    y = bn(x)
    assert y.stride() == x.stride()
    x64 = x.detach().double()
    w64, b64 = bn.weight.detach().double(), bn.bias.detach().double()
    y64 = F.batch_norm(x64, bn.running_mean.double(), bn.running_var.double(), w64, b64, False, 0.0, bn.eps)
    alpha = (w64 / (bn.running_var.double() + bn.eps).sqrt())[None, :, None, None]
    bound = 4 * 2.0**-24 * (x64.abs() * alpha.abs()).amax(dim=(0, 2, 3), keepdim=True)
    assert ((y.detach().double() - y64).abs() <= bound).all()
    assert bound.max() < 1e-3 * y64.abs().max()  # the bound is the input's rounding, not a loose one
    assert torch.equal(y.detach(), F.batch_norm(x.detach(), bn.running_mean, bn.running_var, bn.weight, bn.bias))
    assert evals == {"taken": 0, "declined": 0, "recorded": 1}  # the parameters require grad: autograd records


def test_declines_where_the_packed_path_takes_the_call(evals):
    """An empty batch, a layout torch's kernels do not keep and mixed parameter types keep the packed path."""
    bn = _layer(4)
    x = torch.randn(3, 4, 5, 5)
    with torch.no_grad():
        bn(x[:0])
        assert bn(x.permute(0, 1, 3, 2)).stride() == x.permute(0, 1, 3, 2).stride()
        bn16 = _layer(4, torch.bfloat16, activation="relu").to(torch.float32)
        bn16.running_var.data = bn16.running_var.data.double()  # another type than the others'
        bn16(x.to(torch.bfloat16))
        bn16.running_var.data = bn16.running_var.data.float()
    assert evals == {"taken": 0, "declined": 3}
    with torch.no_grad():
        bn16(x.to(torch.bfloat16))  # 16-bit input, float32 parameters: torch's mixed-type kernel
    assert evals == {"taken": 1, "declined": 3}


@pytest.mark.parametrize("grad", ["inference_mode", "no_grad"])
def test_a_repeated_eval_call_takes_its_kept_route(evals, dispatched, monkeypatch, grad):
    """An eval call without autograd like the layer's last checked one takes the route kept for it (the one native
    pass, with ``F.batch_norm``'s float64 values) without its checks and without choosing again; a call with a mask
    is chosen for at each call, another record or context once."""
    calls = dispatched
    bn = _layer(6, torch.float64)
    x = torch.randn(4, 6, 5, 3, dtype=torch.float64) * 3 + 2
    with torch.inference_mode() if grad == "inference_mode" else torch.no_grad():
        for _ in range(3):
            assert torch.equal(bn(x), _reference(bn, x))
        assert len(calls) == 1 and evals == {"taken": 3, "declined": 0}  # chosen at the first call, kept
        r = torch.randn_like(x)
        assert torch.equal(bn(x, r), _reference(bn, x, r))  # a residual
        bn(x, mask=torch.ones(4, 5, 3, dtype=torch.bool))  # a mask
        assert len(calls) == 3
        for _ in range(2):  # strides torch's eval kernel does not keep: the packed path, chosen once for its record
            torch.testing.assert_close(bn(x.transpose(2, 3)), _reference(bn, x.transpose(2, 3)), rtol=0, atol=1e-12)
        bn(x)  # the record of x again: checked, and its route chosen again
        assert len(calls) == 5
        monkeypatch.setenv("TRITONBN_BACKEND", "auto")  # under the interpreter: the kernels, a context of its own
        for _ in range(2):
            torch.testing.assert_close(bn(x), _reference(bn, x), rtol=0, atol=1e-12)
        monkeypatch.setenv("TRITONBN_BACKEND", "torch")
        assert len(calls) == 6
        bn(x)  # the route kept for TRITONBN_BACKEND=torch
        assert len(calls) == 6
        with torch.no_grad():
            bn.running_var.copy_(bn.running_var * 2)  # the same buffer, new values: read at each call
        assert torch.equal(bn(x), _reference(bn, x)) and len(calls) == 6
        bn.running_var = bn.running_var.clone()  # another buffer: checked again
        bn(x)
        bn(x)
        assert len(calls) == 7
        bn.running_var.data = bn.running_var.data.float()  # by hand, another dtype: checked again
        torch.testing.assert_close(bn(x), _reference(bn, x, running_var=bn.running_var.double()))
        assert len(calls) == 8
    bn.double().train()
    bn(x)
    bn.eval()
    with torch.no_grad():
        bn(x)
        assert len(calls) == 10
    bn(x.requires_grad_())  # autograd records: another context
    assert len(calls) == 11


def _traced_kinds(bn, x) -> list[str]:
    with torch.no_grad():
        return [node.kind() for node in torch.jit.trace(bn, x).graph.nodes()]


def _fx_targets(bn, x) -> list[str]:
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return [str(node.target) for node in make_fx(bn)(x).graph.nodes]


def _compiled_targets(bn, x) -> list[str]:
    targets = []

    def backend(gm, inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    with torch.no_grad():
        torch.compile(bn, fullgraph=True, backend=backend)(x)
    return targets


@pytest.mark.parametrize("how", ["jit.trace", "make_fx", "compile", "subclass", "vmap", "forward_ad", "grad_mode"])
def test_a_repeated_eval_call_still_traces_as_the_first(evals, dispatched, monkeypatch, how):
    """After an eager eval call, a call like it under a tracer, a dispatch mode, a ``torch.func`` transform or
    forward-mode AD, with a ``__torch_function__`` subclass or with autograd records what a fresh layer's call does:
    the route kept for the eager call never takes it."""
    calls = dispatched
    fresh, bn = _layer(4), _layer(4)
    x = torch.randn(3, 4, 5)
    with torch.no_grad():
        bn(x)
    if how == "jit.trace":
        assert _traced_kinds(bn, x) == _traced_kinds(fresh, x)
    elif how == "make_fx":
        assert _fx_targets(bn, x) == _fx_targets(fresh, x)
    elif how == "compile":
        assert _compiled_targets(bn, x) == _compiled_targets(fresh, x)
    elif how == "subclass":
        from tritonbn._core.dispatch import normalize

        Meta.seen.clear()
        with torch.no_grad():
            y = bn(Meta(x, meta={"affine": 1}))
        assert type(y) is Meta and y.meta == {"affine": 1} and normalize in Meta.seen
    elif how == "vmap":
        with torch.no_grad():
            y = torch.func.vmap(bn)(torch.stack([x, x]))  # per sample, the strides of x
        assert torch.allclose(y, _reference(bn, x).expand(2, 3, 4, 5))
    elif how == "forward_ad":
        import torch.autograd.forward_ad as fwAD

        tangent = torch.randn_like(x)
        with torch.no_grad(), fwAD.dual_level():
            y = fwAD.unpack_dual(bn(fwAD.make_dual(x, tangent)))
        scale = bn.weight / (bn.running_var + bn.eps).sqrt()
        assert torch.allclose(y.tangent, tangent * scale[:, None], atol=1e-6)
    else:
        y = bn(x.clone().requires_grad_())
        y.sum().backward()
        assert bn.weight.grad is not None
    if how == "subclass":  # torch's protocol hands the call back on plain tensors: the same call, its kept route
        assert len(calls) == 1
    else:
        assert len(calls) == 2 if how not in ("jit.trace", "make_fx", "compile") else len(calls) >= 3


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_16_bit_activation_is_the_unfused_modules(evals, activation):
    """bfloat16 with an activation and no residual: the values of ``nn.BatchNorm2d`` followed by the activation
    module, to the bit (what the layer computed before conversion)."""
    bn = _layer(5, torch.bfloat16, activation=activation)
    x = torch.randn(3, 5, 7, 6).mul(3).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(bn(x), _reference(bn, x))
    assert evals == {"taken": 1, "declined": 0}


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_16_bit_epilogue_rounds_once(evals, activation):
    """bfloat16 with a residual and an activation: the batch norm, the residual and the activation in float32 and
    one rounding, within half an ulp (plus float32 rounding) of the float64 oracle, as the export lowering."""
    bn = _layer(5, activation=activation)  # float32 parameters and buffers, as under autocast
    x, r = (torch.randn(3, 5, 7, 6).mul(3).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        y = bn(x, r)
    assert y.dtype == torch.bfloat16
    z = _reference(bn.double(), x.double(), r.double())
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(z.abs().clamp_min(1e-3))))
    assert ((y.double() - z).abs() <= ulp / 2 + 1e-6 * z.abs() + 1e-6).all()
    assert evals == {"taken": 1, "declined": 0}


@pytest.mark.parametrize("training", [False, True])
def test_remembered_checks_still_reject(monkeypatch, training):
    """The checks an eager layer skips are those its last call passed: another shape, a new parameter or buffer, a
    wrong residual, or a module moved by ``.to()`` is checked again."""
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    bn = _layer(4).train(training)
    x = torch.randn(3, 4, 5)
    bn(x)
    bn(x)
    with pytest.raises(ValueError, match="num_features=4"):
        bn(torch.randn(3, 5, 5))
    with pytest.raises(ValueError, match="residual must have the input's shape"):
        bn(x, torch.randn(3, 4, 4))
    bn(x)
    bn.weight = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        bn(x)
    bn.weight = torch.nn.Parameter(torch.ones(4))
    bn(x)
    bn.running_var = torch.ones(5)
    with pytest.raises(ValueError, match=r"running_var must have shape \(4,\)"):
        bn(x)
    bn.running_var = torch.ones(4)
    bn(x)
    settings = bn._tritonbn_settings
    assert settings.record is not None
    bn.double()  # the same tensors in another dtype: the settings go, and the next call checks again
    assert "_tritonbn_settings" not in bn.__dict__
    bn(x.double())
    assert bn._tritonbn_settings is not settings


EPILOGUES = [None, "relu", "residual", "residual_relu", "residual_silu", "residual_leaky"]


def _epilogue_layer(C, epilogue, dtype=torch.float32):
    activation = {"relu": "relu", "residual_relu": "relu", "residual_silu": "silu", "residual_leaky": "leaky_relu"}
    kwargs = {"negative_slope": -0.2} if epilogue == "residual_leaky" else {}  # a slope autograd needs z for
    return _layer(C, dtype, activation=activation.get(epilogue), **kwargs)


def _eval_step(bn, x, r, dy, train_between=False):
    """One eval forward under autograd (nothing in ``no_grad``), optionally a training call that updates the buffers
    in place before the backward; ``(y, dx, dweight, dbias, dresidual)``."""
    bn.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    r = None if r is None else r.clone().requires_grad_()
    y = bn(x, r)
    if train_between:
        bn.train()
        bn(torch.randn_like(x) * 2 + 1)
        bn.eval()
    y.backward(dy)
    return y.detach(), x.grad, bn.weight.grad, bn.bias.grad, None if r is None else r.grad


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_eval_under_autograd_is_the_float64_oracle(evals, layout, dtype, epilogue):
    """An eval call that autograd records (input, parameters and residual requiring grad): the values and every
    gradient of the float64 oracle, to the bit in float64 and within rounding in float32 and bfloat16 (float32
    parameters and buffers beside a bfloat16 input, as under autocast), in both layouts, a training call updating
    the buffers between forward and backward (the backward reads them as they were)."""
    bn = _epilogue_layer(6, epilogue, torch.float64 if dtype == torch.float64 else torch.float32)
    rm, rv = bn.running_mean.double().clone(), bn.running_var.double().clone()
    x = torch.randn(4, 6, 5, 3, dtype=torch.float64) * 3 + 1
    r = torch.randn_like(x) if epilogue is not None and epilogue.startswith("residual") else None
    dy = torch.randn_like(x)
    if layout == "channels_last":
        x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
    x, dy = x.to(dtype), dy.to(dtype)
    r = None if r is None else r.to(dtype)
    got = _eval_step(bn, x, r, dy, train_between=True)
    assert got[0].dtype == dtype and got[0].stride() == x.stride()
    ref = bn.double()
    xs = x.double().requires_grad_()
    rs = None if r is None else r.double().requires_grad_()
    ref.zero_grad(set_to_none=True)
    want_y = _reference(ref, xs, rs, rm, rv)
    want_y.backward(dy.double())
    want = (want_y.detach(), xs.grad, ref.weight.grad, ref.bias.grad, None if r is None else rs.grad)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if b is None:
            assert a is None
        elif dtype == torch.float64:
            assert torch.equal(a, b), f"item {i}"
        elif dtype == torch.float32:
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=f"item {i}")
        else:  # a 16-bit value within bf16 rounding of its size; float32 weight and bias gradients summed over it
            torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=3e-2, msg=f"item {i}")
    if dtype == torch.bfloat16 and r is not None:  # a 16-bit residual: the Function (float32 sum, rounded once)
        assert evals.get("recorded", 0) == 0
    else:
        assert evals.get("recorded", 0) == 1


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, "bfloat16_layer"])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_eval_under_autograd_eager_is_the_custom_ops_bitwise(monkeypatch, layout, dtype, epilogue):
    """The eager eval call autograd records (torch's own eval kernel and backward) against the custom ops that
    ``torch.compile`` traces (``tritonbn._core.custom_ops``): the same bits, the output and every gradient, with a
    training call updating the buffers between forward and backward; and so is the eager Function where it takes
    the call (forward-mode AD on, a 16-bit residual)."""
    from tritonbn._core import route

    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    layer_dtype = torch.bfloat16 if dtype == "bfloat16_layer" else torch.float64 if dtype == torch.float64 else None
    dtype = torch.bfloat16 if dtype == "bfloat16_layer" else dtype
    x = (torch.randn(4, 6, 5, 3) * 3 + 1).to(dtype)
    r = torch.randn_like(x) if epilogue is not None and epilogue.startswith("residual") else None
    dy = torch.randn_like(x)
    if layout == "channels_last":
        x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
    runs = []
    for path in ("eager", "function", "custom_ops"):
        bn = _epilogue_layer(6, epilogue, layer_dtype or torch.float32)
        if path == "function":  # the eager Function: as under forward-mode AD
            monkeypatch.setattr(local, "takes_recorded_eval", lambda *args: False)
        if path == "custom_ops":
            monkeypatch.setattr(route, "is_eager", lambda x: False)
        runs.append(_eval_step(bn, x, r, dy, train_between=True))
    for path, other in zip(("function", "custom_ops"), runs[1:], strict=True):
        for i, (a, b) in enumerate(zip(runs[0], other, strict=True)):
            assert (a is None and b is None) or torch.equal(a, b), f"{path}: item {i}"


@pytest.mark.parametrize("custom_ops", [False, True], ids=["eager", "custom-ops"])
def test_eval_gradient_penalty_is_torchs(evals, monkeypatch, custom_ops):
    """Double backward of an eval call (a gradient penalty, ``create_graph=True``): torch's own answer, whether
    autograd recorded torch's ops (eager) or the custom ops' Function recomputes the gradients (``higher_order``)."""
    from tritonbn._core import route

    if custom_ops:
        monkeypatch.setattr(route, "is_eager", lambda x: False)
    bn = _layer(3, torch.float64)
    plain = torch.nn.BatchNorm2d(3).double().eval()
    plain.load_state_dict(bn.state_dict())
    x = torch.randn(4, 3, 5, 2, dtype=torch.float64) * 2 + 1
    dy = torch.randn_like(x)
    grads = []
    for layer in (bn, plain):
        xg = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad((layer(xg) * dy).sum(), xg, create_graph=True)
        (gx.pow(2).sum() + gx.sum()).backward()
        grads.append((gx.detach(), layer.weight.grad.clone()))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    assert evals.get("recorded", 0) == (0 if custom_ops else 1)
