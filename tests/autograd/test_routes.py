"""A layer that has run behaves as a fresh one: its routes (``tritonbn._core.route``) follow every change a user can
make between calls, none of what it keeps is state (pickle, ``torch.save``, ``copy.deepcopy``), and
``tritonbn.explain`` tells which route each layer's calls take.

The oracle is torch's own module on the same tensors in float64 (``nn.BatchNorm2d``, then torch's activation):
``F.batch_norm`` over the whole batch, as one process.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tritonbn

C = 4


class Twin:
    """A tritonbn layer and torch's ``nn.BatchNorm2d`` on equal, separate tensors, changed alike between calls."""

    def __init__(self):
        torch.manual_seed(0)
        self.bn = tritonbn.SyncBatchNorm(C).double()
        self.ref = nn.BatchNorm2d(C).double()
        with torch.no_grad():
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.normal_()
        self.ref.load_state_dict(self.bn.state_dict())
        self.activation = None
        self.layout = "contiguous"
        self.grad = "grad"
        self.n = 3

    def both(self, fn):
        fn(self.bn)
        fn(self.ref)

    def input(self):
        g = torch.Generator().manual_seed(self.n)
        x = torch.randn(self.n, C, 3, 5, dtype=torch.float64, generator=g) * 3 + 1
        if self.layout == "channels_last":
            x = x.to(memory_format=torch.channels_last)
        elif self.layout == "transposed":
            x = x.transpose(2, 3).contiguous().transpose(2, 3)
        return x

    def call(self):
        """One call of both; every output, gradient and buffer compared."""
        x = self.input()
        outs = []
        for m in (self.bn, self.ref):
            m.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(self.grad == "grad")
            context = torch.no_grad() if self.grad == "no_grad" else torch.enable_grad()
            if self.grad == "inference_mode":
                context = torch.inference_mode()
            with context:
                y = m(xi)
                if m is self.ref and self.activation is not None:
                    y = getattr(F, self.activation)(y)
            grads = None
            if y.requires_grad:
                y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape))
                grads = (xi.grad, *(p.grad for p in m.parameters()))
            outs.append((y, grads, [b.clone() for b in m.buffers() if b is not None]))
        (y, grads, buffers), (y_ref, grads_ref, buffers_ref) = outs
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        assert (grads is None) == (grads_ref is None)
        for a, b in zip(grads or (), grads_ref or (), strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        assert len(buffers) == len(buffers_ref)
        for a, b in zip(buffers, buffers_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _strided(values: torch.Tensor) -> torch.Tensor:
    """``values`` in a tensor of stride 2 (a slice), as a ``.data`` set by hand."""
    out = torch.empty(2 * values.numel(), dtype=values.dtype)[::2]
    return out.copy_(values)


def _set_data(name):
    def change(twin):
        for m in (twin.bn, twin.ref):
            tensor = getattr(m, name)
            tensor.data = _strided(tensor.data)

    return change


def _replace(name, parameter):
    def change(twin):
        for m in (twin.bn, twin.ref):
            values = getattr(m, name).detach().clone() + 0.25
            setattr(m, name, nn.Parameter(values) if parameter else values)

    return change


def _attribute(name, value):
    return lambda twin: twin.both(lambda m: setattr(m, name, value))


def _field(name, value):
    return lambda twin: setattr(twin, name, value)


def _activation(name):
    def change(twin):
        twin.bn.activation = name
        twin.activation = name

    return change


def _round_trip(how):
    """The tritonbn layer replaced by its pickle, ``torch.save`` or deep copy (torch's by its deep copy)."""

    def change(twin):
        if how == "pickle":
            twin.bn = pickle.loads(pickle.dumps(twin.bn))
        elif how == "torch.save":
            buffer = io.BytesIO()
            torch.save(twin.bn, buffer)
            buffer.seek(0)
            twin.bn = torch.load(buffer, weights_only=False)
        else:
            twin.bn = copy.deepcopy(twin.bn)
        twin.ref = copy.deepcopy(twin.ref)

    return change


def _requires_grad(flag):
    return lambda twin: twin.both(lambda m: [p.requires_grad_(flag) for p in m.parameters()])


CHANGES = {
    "train": lambda twin: twin.both(lambda m: m.train()),
    "eval": lambda twin: twin.both(lambda m: m.eval()),
    "momentum 0.3": _attribute("momentum", 0.3),
    "momentum None": _attribute("momentum", None),
    "eps": _attribute("eps", 1e-3),
    "stop tracking": _attribute("track_running_stats", False),
    "track again": _attribute("track_running_stats", True),
    "new weight": _replace("weight", True),
    "new running_var": _replace("running_var", False),
    "strided weight": _set_data("weight"),
    "strided running_mean": _set_data("running_mean"),
    "frozen parameters": _requires_grad(False),
    "trained parameters": _requires_grad(True),
    "relu": _activation("relu"),
    "no activation": _activation(None),
    "no_grad": _field("grad", "no_grad"),
    "inference_mode": _field("grad", "inference_mode"),
    "grad": _field("grad", "grad"),
    "channels_last": _field("layout", "channels_last"),
    "transposed": _field("layout", "transposed"),
    "contiguous": _field("layout", "contiguous"),
    "batch of 5": _field("n", 5),
    "pickle": _round_trip("pickle"),
    "torch.save": _round_trip("torch.save"),
    "deepcopy": _round_trip("deepcopy"),
}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(sorted(CHANGES)), min_size=1, max_size=10))
def test_a_layer_that_has_run_gives_what_torch_gives_after_any_change(changes):
    """A layer driven through a random sequence of changes, called twice after each (the second call takes the route
    kept by the first), gives torch's module's outputs, gradients and buffers at every call (PyTorch backend)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONBN_BACKEND", "torch")
        twin = Twin()
        twin.call()
        for change in changes:
            CHANGES[change](twin)
            twin.call()
            twin.call()


@pytest.mark.interpreter
def test_the_kernels_follow_changes_between_calls(monkeypatch):
    """The same on the Triton kernels (under the interpreter), for the changes their launches keep something for:
    a strided parameter and buffer (``.data`` set to a slice), the mode, grad mode, the layout and a round trip."""
    monkeypatch.setenv("TRITONBN_BACKEND", "triton")
    twin = Twin()
    twin.call()
    for change in ("strided weight", "strided running_mean", "eval", "no_grad", "train", "channels_last", "pickle"):
        CHANGES[change](twin)
        twin.call()
        twin.call()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_a_model_that_has_run_pickles_saves_and_copies(backend, monkeypatch):
    """A model that trained (momentum None: the cumulative average) and evaluated, with and without autograd, in two
    layouts, pickles, saves with ``torch.save`` and deep-copies, and each copy computes what the model does."""
    monkeypatch.setenv("TRITONBN_BACKEND", backend)
    model = nn.Sequential(nn.Conv2d(3, C, 1), nn.BatchNorm2d(C, momentum=None), nn.ReLU(), nn.BatchNorm2d(C)).double()
    model = tritonbn.convert_sync_batchnorm(model)
    x = torch.randn(3, 3, 4, 5, dtype=torch.float64)
    for layout in (torch.contiguous_format, torch.channels_last):
        for _ in range(2):
            model(x.to(memory_format=layout).requires_grad_()).sum().backward()
    model.eval()
    model(x.transpose(2, 3))
    with torch.no_grad():
        model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [pickle.loads(pickle.dumps(model)), copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    for other in copies:  # nothing kept between calls came along: a copy chooses its routes anew
        assert all("_tritonbn_settings" not in m.__dict__ for m in other.modules())
    with torch.no_grad():
        want = model(x)
        for other in copies:
            assert torch.equal(other(x), want)
    model.train()
    for other in copies:
        other.train()
        torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)


def test_torch_differences_are_gone():
    """What ``nn.BatchNorm2d`` does where tritonbn once differed (PyTorch backend; the kernels take the same path
    through the module and the passes): buffers set to None under ``track_running_stats=True`` still count batches;
    an empty training batch counts; ``num_batches_tracked=None`` with ``momentum=None`` leaves the running statistics
    as they are; a layer whose ``track_running_stats`` was turned off after construction converts with its buffers,
    and eval still reads them."""
    x = torch.randn(3, C, 2, 3, dtype=torch.float64)
    cases = []
    ref = nn.BatchNorm2d(C).double()
    ref.running_mean = ref.running_var = None
    cases.append((ref, x))
    cases.append((nn.BatchNorm2d(C).double(), x[:0]))
    ref = nn.BatchNorm2d(C, momentum=None).double()
    ref.num_batches_tracked = None
    cases.append((ref, x))
    ref = nn.BatchNorm2d(C).double()
    with torch.no_grad():
        ref.running_mean.fill_(0.5)
    ref.track_running_stats = False
    cases.append((ref.eval(), x))
    for ref, xi in cases:
        bn = tritonbn.convert_sync_batchnorm(copy.deepcopy(ref))
        for _ in range(2):
            torch.testing.assert_close(bn(xi), ref(xi), rtol=0, atol=1e-12)
            for a, b in zip(bn.buffers(), ref.buffers(), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
            assert [name for name, _ in bn.named_buffers()] == [name for name, _ in ref.named_buffers()]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("activation", ["relu", "leaky_relu"])
def test_double_backward_through_a_kinked_epilogue_gives_the_bias_a_zero_gradient(backend, activation, monkeypatch):
    """A gradient penalty through relu / leaky_relu: the bias reaches the input's gradient only through the kink, so
    torch gives it a zero gradient (not ``None``, which optimizers with weight decay treat otherwise)."""
    monkeypatch.setenv("TRITONBN_BACKEND", backend)
    if backend == "torch":  # the Function's double backward (tritonbn._core.higher_order), as on the kernels
        from tritonbn.backends.torch import local

        monkeypatch.setattr(local, "takes_recorded", lambda *args: False)
    bn = tritonbn.SyncBatchNorm(C, activation=activation).double()
    ref = nn.BatchNorm2d(C).double()
    x = torch.randn(3, C, 2, 3, dtype=torch.float64, requires_grad=True)
    for residual in (None, torch.randn_like(x)):
        grads = []
        for m in (bn, ref):
            m.zero_grad()
            if m is bn:
                y = bn(x) if residual is None else bn(x, residual)
            else:
                y = getattr(F, activation)(ref(x) if residual is None else ref(x) + residual)
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            g.pow(2).sum().backward()
            grads.append((m.weight.grad, m.bias.grad))
        assert torch.equal(grads[1][1], torch.zeros(C, dtype=torch.float64))  # torch's: zero, not None
        for a, b in zip(*grads, strict=True):
            assert a is not None
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_explain_names_every_layers_route(monkeypatch):
    """``tritonbn.explain``: per layer call, the route its mode and grad mode take, on a copy (the model's buffers
    stay as they are); a model without tritonbn layers is an error."""
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    model = nn.Sequential(nn.Conv2d(3, C, 1), nn.BatchNorm2d(C), nn.ReLU(), nn.BatchNorm1d(C))
    with pytest.raises(ValueError, match="no tritonbn BatchNorm"):
        tritonbn.explain(model, torch.randn(2, 3, 4, 4))
    model = tritonbn.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, C, 1), nn.BatchNorm2d(C), nn.ReLU()))
    x = torch.randn(2, 3, 4, 4)
    explained = tritonbn.explain(model, x)
    assert [(r.name, r.mode, r.synchronizes, r.backend, r.route) for r in explained] == [
        ("1", "train", False, "torch", "local training")
    ]
    assert model[1].num_batches_tracked.item() == 0
    model.eval()
    with torch.no_grad():
        assert [r.route for r in tritonbn.explain(model, x)] == ["native eval"]
    assert [r.route for r in tritonbn.explain(model, x)] == ["local eval"]
    monkeypatch.setenv("TRITONBN_BACKEND", "auto")
    text = str(tritonbn.explain(model, x.transpose(2, 3)))
    assert "eager function" in text and text.splitlines()[0].split()[:3] == ["layer", "class", "mode"]
