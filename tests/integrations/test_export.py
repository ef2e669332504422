"""Export and serving: a model with tritonbn layers leaves through torch.export, ONNX, AOTInductor and jit.trace.

Every consumer's output is compared with the eager model under both backends (to fp32 rounding) and
with the float64 oracle: ``F.batch_norm`` with the same running statistics, then the epilogue. The
exported graphs are the same for both backends (they hold torch's own ops), so each is exported once.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings
import zipfile

import pytest
import torch
import torch.nn.functional as F
from timm_standin import BatchNormAct2d
from torch import nn
from torch.export import Dim

import tritonbn
from tritonbn import _compat
from tritonbn import backend as _backend
from tritonbn.modules import SyncBatchNormAct

ATOL, RTOL = 1e-5, 1e-5


class Net(nn.Module):
    """A small CNN whose BatchNorms fuse every epilogue: relu, add + relu (a residual), leaky_relu, silu."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 5, 3, padding=1)
        self.bn1 = tritonbn.SyncBatchNorm(5, activation="relu")
        self.conv2 = nn.Conv2d(5, 5, 3, padding=1, bias=False)
        self.bn2 = tritonbn.SyncBatchNorm(5, activation="relu")
        self.conv3 = nn.Conv2d(5, 7, 1)
        self.bn3 = tritonbn.SyncBatchNorm(7, activation="leaky_relu", negative_slope=0.2)
        self.conv4 = nn.Conv2d(7, 7, 3, padding=1, bias=False)
        self.bn4 = tritonbn.SyncBatchNorm(7, activation="silu", bias=False)

    def forward(self, x):
        y = self.bn1(self.conv1(x))
        y = self.bn2(self.conv2(y), y)
        y = self.bn3(self.conv3(y))
        return self.bn4(self.conv4(y))

    def oracle(self, x):
        """The same network in float64: ``F.conv2d``, ``F.batch_norm`` over the running statistics, the epilogue."""
        p = {k: v.detach().double() for k, v in self.state_dict().items()}

        def conv(name, t, padding):
            return F.conv2d(t, p[f"{name}.weight"], p.get(f"{name}.bias"), padding=padding)

        def bn(name, t):
            return F.batch_norm(t, p[f"{name}.running_mean"], p[f"{name}.running_var"], p[f"{name}.weight"],
                                p.get(f"{name}.bias"), False, 0.0, 1e-5)  # fmt: skip

        x = x.double()
        y = F.relu(bn("bn1", conv("conv1", x, 1)))
        y = F.relu(bn("bn2", conv("conv2", y, 1)) + y)
        y = F.leaky_relu(bn("bn3", conv("conv3", y, 0)), 0.2)
        return F.silu(bn("bn4", conv("conv4", y, 1)))


def _trained(seed=0) -> Net:
    """A :class:`Net` after one training step of its BatchNorms (running statistics moved), in eval mode."""
    torch.manual_seed(seed)
    net = Net()
    for m in net.modules():
        if isinstance(m, tritonbn.SyncBatchNorm):
            m.weight.data.uniform_(0.5, 1.5)
            if m.bias is not None:
                m.bias.data.normal_(0, 0.5)
    with torch.no_grad():
        net.train()(torch.randn(4, 3, 5, 7) * 2 + 0.5)
    return net.eval()


def _input(n, seed=1):
    torch.manual_seed(seed)
    return torch.randn(n, 3, 5, 7).contiguous(memory_format=torch.channels_last)  # odd sizes, channels_last


def _check(got, net, x, monkeypatch, what):
    """``got`` equals the eager model under both backends, and the float64 oracle."""
    got = torch.as_tensor(got).float()
    for name in ("triton", "torch"):
        monkeypatch.setenv("TRITONBN_BACKEND", name)
        assert _backend.name_for(x) == name
        with torch.no_grad():
            want = net(x)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{what} vs {n}: {m}")
    torch.testing.assert_close(got.double(), net.oracle(x), atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _targets(graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


def _tritonbn_ops(ep) -> list[str]:
    """The tritonbn ops anywhere in an exported program, nested graphs (higher-order ops) included."""
    graphs = [m.graph for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    return [t for g in graphs for t in _targets(g) if "tritonbn" in t]


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_lowers_to_aten_and_compile_keeps_the_custom_ops(strict, monkeypatch):
    """torch.export: aten batch_norm + add + activations, no tritonbn op, a dynamic batch; torch.compile: the ops."""
    net, x = _trained(), _input(3)
    ep = torch.export.export(net, (x,), dynamic_shapes={"x": {0: Dim("batch", min=2)}}, strict=strict)
    targets = _targets(ep.graph)
    assert not _tritonbn_ops(ep), targets
    assert targets.count("aten.batch_norm.default") == 4, targets
    for op in ("aten.add.Tensor", "aten.relu.default", "aten.leaky_relu.default", "aten.silu.default"):
        assert op in targets, (op, targets)
    core = ep.run_decompositions()  # the core ATen opset, as consumers such as ExecuTorch load it
    assert not _tritonbn_ops(core)
    x5 = _input(5, seed=2)
    _check(ep.module()(x5), net, x5, monkeypatch, "torch.export")
    _check(core.module()(x5), net, x5, monkeypatch, "torch.export core ATen")

    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(net, fullgraph=True, backend=capture)(x)
    code = "\n".join(m.code for m in graphs[0].modules() if isinstance(m, torch.fx.GraphModule))
    assert "tritonbn.batch_norm_forward" in code and "batch_norm(" not in code.replace("batch_norm_forward(", "")


@pytest.mark.compile_sweep  # a C++ build of 20-30 s here: CI runs it (scripts/compile_sweep.sh)
def test_aot_inductor_package_runs_on_cpu(monkeypatch, tmp_path):
    """torch.export, then AOTInductor (compile, package, load, run) on CPU: no tritonbn inside the package."""
    net, x = _trained(), _input(3)
    ep = torch.export.export(net, (x,), dynamic_shapes={"x": {0: Dim("batch", min=2)}})
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "net.pt2"))
    with zipfile.ZipFile(path) as package:  # a custom op would be called by name, through tritonbn's Python
        assert not [n for n in package.namelist() if b"tritonbn" in package.read(n)], "the package needs tritonbn"
    runner = torch._inductor.aoti_load_package(path)
    x5 = _input(5, seed=2)
    with torch.no_grad():
        _check(runner(x5), net, x5, monkeypatch, "AOTInductor")


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
def test_onnx_runs_in_onnxruntime(dynamo, monkeypatch, tmp_path):
    """Both ONNX exporters: the file has standard ops only, and onnxruntime (CPU) matches eager on another batch."""
    onnx = pytest.importorskip("onnx", reason="the test extra installs onnx")
    ort = pytest.importorskip("onnxruntime", reason="the test extra installs onnxruntime")
    net, x = _trained(), _input(3)
    path = str(tmp_path / "net.onnx")
    if dynamo:
        torch.onnx.export(net, (x,), path, dynamo=True, dynamic_shapes={"x": {0: Dim("batch", min=2)}}, verbose=False)
    else:
        torch.onnx.export(net, (x,), path, dynamo=False, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})  # fmt: skip
    model = onnx.load(path)
    assert {node.domain for node in model.graph.node} <= {"", "ai.onnx"}, "a custom op in the ONNX graph"
    ops = {node.op_type for node in model.graph.node}  # (the TorchScript exporter folds BN into Conv itself)
    assert {"Conv", "Add", "Relu", "LeakyRelu", "Sigmoid"} <= ops, ops
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    x5 = _input(5, seed=2)
    (got,) = session.run(None, {session.get_inputs()[0].name: x5.numpy()})
    _check(got, net, x5, monkeypatch, f"onnxruntime (dynamo={dynamo})")


def test_jit_trace_records_aten_batch_norm(monkeypatch):
    """jit.trace: the traced graph holds aten::batch_norm and runs without tritonbn's kernels on another batch."""
    net, x = _trained(), _input(3)
    with torch.no_grad():
        traced = torch.jit.trace(net, (x,))
    graph = str(traced.inlined_graph)
    assert graph.count("aten::batch_norm") == 4, graph
    x5 = _input(5, seed=2)
    _check(traced(x5), net, x5, monkeypatch, "jit.trace")


def _conv_bn_relu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5), nn.ReLU())
    with torch.no_grad():
        model(torch.randn(4, 3, 5, 7))  # running statistics that moved
    return model.eval()


class _Call(nn.Module):
    """A layer called with positional inputs (residual included): the root module of a TorchScript ONNX export
    gets every parameter of its forward positionally, keyword-only ones too."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, residual=None):
        return self.layer(x, residual)


@pytest.mark.parametrize("model", ["conv-bn-relu", "residual-and-activations"])
@pytest.mark.parametrize("tracer", ["jit.trace", "onnx-torchscript-exporter"])
def test_tracing_prints_no_tracer_warning(model, tracer, monkeypatch, tmp_path):
    """jit.trace and the TorchScript ONNX exporter (dynamo=False) of converted models in eval: no TracerWarning, as
    for the unconverted model. tritonbn's argument checks compare the example input's sizes as Python ints (the
    tracer paused: tritonbn._checks.check_traced_call), not traced values; and they still raise while tracing."""
    pytest.importorskip("onnx", reason="the test extra installs onnx")
    original = _conv_bn_relu()
    net = tritonbn.convert_sync_batchnorm(copy.deepcopy(original)) if model == "conv-bn-relu" else _trained()
    x = _input(3)

    def trace(m, *args):
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", torch.jit.TracerWarning)
            if tracer == "jit.trace":
                return torch.jit.trace(m, args)
            torch.onnx.export(m, args, str(tmp_path / "m.onnx"), dynamo=False)
            return None

    trace(original, x)  # the unconverted model prints none: what the converted one must match
    traced = trace(net, x)
    if traced is not None:
        x5 = _input(5, seed=2)
        if model == "conv-bn-relu":
            torch.testing.assert_close(traced(x5), original(x5), atol=ATOL, rtol=RTOL)
        else:
            _check(traced(x5), net, x5, monkeypatch, "jit.trace")
    layer = _Call(tritonbn.SyncBatchNorm(5, activation="relu").eval())
    with pytest.raises(ValueError, match=r"input has 4 channels \(dim 1\), but num_features=5"):
        trace(layer, torch.randn(2, 4, 3))  # the checks run while tracing
    with pytest.raises(ValueError, match="residual must have the input's shape"):
        trace(layer, torch.randn(2, 5, 3), torch.randn(2, 5, 1))  # (the add it records would broadcast)


def test_jit_script_error_names_tritonbn_and_the_way_out(monkeypatch):
    """jit.script refuses tritonbn layers with an error naming tritonbn; the folded model scripts and matches."""
    net = _trained()
    with pytest.raises(RuntimeError, match=r"tritonbn: torch\.jit\.script .*torch\.jit\.trace.*fold_batchnorm"):
        torch.jit.script(net)
    assert isinstance(net.bn1, tritonbn.SyncBatchNorm), "scripting must leave the model as it was"
    scripted = torch.jit.script(tritonbn.fold_batchnorm(net))
    x5 = _input(5, seed=2)
    _check(scripted(x5), net, x5, monkeypatch, "jit.script of the folded model")


@pytest.mark.parametrize("strict", [False, True])
def test_training_mode_export_normalizes_the_local_batch(strict, backend_name):
    """torch.export in train(): torch's batch_norm over the batch with a warning; running stats updated as eager."""
    net = _trained()
    net.bn4.momentum = 0.3
    eager = copy.deepcopy(net).train()
    x = _input(6, seed=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ep = torch.export.export(copy.deepcopy(net).train(), (x,), strict=strict)
    assert not _tritonbn_ops(ep)
    notes = [str(w.message) for w in record if str(w.message).startswith("tritonbn")]
    if not strict:  # strict export drops Python warnings while dynamo traces
        assert notes and all("local batch" in n and "does not synchronize" in n for n in notes), notes
    module = ep.module()
    with torch.no_grad():
        got, want = module(x), eager(x)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    state = dict(module.named_buffers())
    for name, value in eager.named_buffers():
        torch.testing.assert_close(state[name], value, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
    assert int(state["bn1.num_batches_tracked"]) == 2  # the training step in _trained, then this one
    # The oracle for bn1: batch statistics of conv1's output, in float64.
    x1 = net.conv1(x).double()
    rm, rv = net.bn1.running_mean.double().clone(), net.bn1.running_var.double().clone()
    F.batch_norm(x1, rm, rv, None, None, True, 0.1, 1e-5)
    torch.testing.assert_close(state["bn1.running_mean"].double(), rm, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state["bn1.running_var"].double(), rv, atol=ATOL, rtol=RTOL)


class _Exporting(nn.Module):
    """Doubles its input where :func:`tritonbn._compat.exporting` says export is tracing, triples it otherwise."""

    def forward(self, x):
        return x * 2 if _compat.exporting() else x * 3


def test_exporting_tells_export_from_compile():
    """The signal, as the tracers see it: false in eager and under torch.compile, true under every export.

    (torch.compiler.is_exporting() is true under torch.compile too on torch 2.8 to 2.11: dynamo folds it to True.)
    """
    x = torch.ones(2, 3)
    assert not _compat.exporting()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(_Exporting(), fullgraph=True, backend="eager")(x), x * 3)
    for strict in (False, True):
        assert torch.equal(torch.export.export(_Exporting(), (x,), strict=strict).module()(x), x * 2), strict
    if importlib.util.find_spec("onnxscript") is not None:  # the dynamo ONNX exporter goes through torch.export
        onnx_program = torch.onnx.export(_Exporting(), (x,), dynamo=True, verbose=False)
        assert torch.equal(onnx_program(x)[0], x * 2)
    assert not _compat.exporting()


def test_training_mode_compile_at_world_size_1_keeps_the_custom_ops_and_export_still_lowers(backend_name):
    """Issue 40: torch.compile(fullgraph=True) in train() with no process group is not taken for an export.

    The compiled graph holds tritonbn's ops and no torch batch_norm, nothing warns, and it computes what eager
    does; torch.export (strict and non-strict) of the same model in train() then still records torch's
    batch_norm, and a compile after them the custom ops again.
    """
    from torch._dynamo.backends.registry import lookup_backend

    net, x = _trained().train(), _input(6, seed=3)
    eager = copy.deepcopy(net)
    weights = torch.randn(6, 7, 5, 7, generator=torch.Generator().manual_seed(4))  # y.sum() has a ~0 gradient
    graphs = []

    def record(gm, example_inputs):
        graphs.append([t for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for t in _targets(m.graph)])
        return lookup_backend("aot_eager")(gm, example_inputs)

    def compile_and_step(model):
        torch._dynamo.reset()
        graphs.clear()
        with warnings.catch_warnings(record=True) as record_warnings:
            warnings.simplefilter("always")
            y = torch.compile(model, fullgraph=True, backend=record)(x)
            (y * weights).sum().backward()
        assert not [str(w.message) for w in record_warnings if str(w.message).startswith("tritonbn")]
        (targets,) = graphs
        assert targets.count("tritonbn.batch_norm_forward") == 4, targets
        assert not [t for t in targets if "batch_norm" in t and not t.startswith("tritonbn.")], targets
        return y

    got = compile_and_step(net)
    want = eager(x)
    (want * weights).sum().backward()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    for (name, a), b in zip(net.named_parameters(), eager.parameters(), strict=True):  # sums over the batch: 1e-4
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    for (name, a), b in zip(net.named_buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
    for strict in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the export's own warning: test_training_mode_export_normalizes...
            ep = torch.export.export(copy.deepcopy(net), (x,), strict=strict)
        assert not _tritonbn_ops(ep), strict
        assert _targets(ep.graph).count("aten.batch_norm.default") == 4, (strict, _targets(ep.graph))
    compile_and_step(copy.deepcopy(net))


class _Group:
    """Stands in for a process group of two ranks: what a synchronizing layer holds."""

    group_name = "two-ranks"

    def size(self):
        return 2


@pytest.mark.parametrize("tracer", ["torch.export", "torch.jit.trace"])
def test_training_mode_export_of_a_synchronizing_layer_raises(tracer, monkeypatch):
    """A layer that would all-reduce cannot be exported in train(): an error names tritonbn and the fix."""
    import tritonbn.modules

    net = _trained()
    monkeypatch.setattr(tritonbn.modules, "resolve_group", lambda group: _Group())
    net.train()
    export = {"torch.export": lambda: torch.export.export(net, (_input(3),)),
              "torch.jit.trace": lambda: torch.jit.trace(net, (_input(3),))}[tracer]  # fmt: skip
    with pytest.raises(RuntimeError, match=r"tritonbn: cannot export .* 2 ranks.*model\.eval\(\).*revert_sync_batch"):
        export()
    net.bn1.momentum = None
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"tritonbn: cannot export .*momentum=None"):
        torch.export.export(net, (_input(3),))


class FoldNet(nn.Module):
    """Every case fold_batchnorm meets: tritonbn layers with epilogues, torch's BatchNorm2d, a transposed
    convolution, a timm norm-act layer with an activation the kernels do not fuse, and two that cannot fold."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 5, 3, padding=1)
        self.bn1 = tritonbn.SyncBatchNorm(5, activation="leaky_relu", negative_slope=0.1)
        self.conv2 = nn.Conv2d(5, 5, 3, padding=1, bias=False)
        self.bn2 = tritonbn.SyncBatchNorm(5, activation="relu")
        self.conv3 = nn.ConvTranspose2d(5, 4, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(4)
        self.conv4 = nn.Conv2d(4, 4, 1)
        self.bn4 = BatchNormAct2d(
            4, act_layer=nn.GELU, inplace=False
        )  # becomes tritonbn's SyncBatchNormAct when converted
        self.pool = nn.AvgPool2d(1)
        self.bn5 = nn.BatchNorm2d(4)  # after a pooling: stays
        self.conv6 = nn.Conv2d(4, 4, 1)
        self.bn6 = tritonbn.SyncBatchNorm(4, activation="silu")  # its convolution's output is also used: stays

    def forward(self, x):
        y = self.bn1(self.conv1(x))
        y = self.bn2(self.conv2(y), residual=y)
        y = self.bn4(self.conv4(self.bn3(self.conv3(y))))
        y = self.bn5(self.pool(y))
        z = self.conv6(y)
        return self.bn6(z, z)


@pytest.mark.parametrize("convert", [True, False], ids=["tritonbn", "torch-and-tritonbn"])
def test_fold_batchnorm(convert, backend_name):
    """Folded convolutions, the epilogues as separate modules, the same outputs; unfoldable ones kept and named."""
    torch.manual_seed(0)
    net = FoldNet()
    if convert:
        net = tritonbn.convert_sync_batchnorm(net)
        assert type(net.bn4) is SyncBatchNormAct and type(net.bn3) is tritonbn.modules.SyncBatchNorm2d
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.5)
    net.eval()
    before = copy.deepcopy(net.state_dict())
    kept = ["bn5 (not after a convolution)", "bn6 (its convolution's output is used elsewhere)"]
    if not convert:
        kept.insert(0, "bn4 (own forward (BatchNormAct2d))")  # timm's layer, unconverted: it may compute more
    with pytest.warns(UserWarning) as record:
        folded = tritonbn.fold_batchnorm(net)
    assert [str(w.message) for w in record] == [f"fold_batchnorm left {len(kept)} BatchNorm layer(s) as they are: "
                                                + ", ".join(kept)]  # fmt: skip
    left = {name for name, m in folded.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    assert left == {k.split()[0] for k in kept}, left
    assert isinstance(folded.bn1, nn.LeakyReLU) and folded.bn1.negative_slope == 0.1
    assert isinstance(folded.bn2, nn.ReLU)
    assert not hasattr(folded, "bn3")
    if convert:
        assert isinstance(folded.bn4, nn.Sequential) and isinstance(folded.bn4[1], nn.GELU)
    assert folded.conv2.bias is not None and folded.conv3.bias is not None
    for name, value in net.state_dict().items():  # the model itself is unchanged
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    x = _input(3)
    with torch.no_grad():
        got, want = folded(x), net(x)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # The oracle: fold nothing, compute every BatchNorm in float64 with F.batch_norm.
    reference = copy.deepcopy(net).double()
    for name, m in list(reference.named_modules()):
        if isinstance(m, tritonbn.SyncBatchNorm):
            reference.set_submodule(name, _Float64Reference(m))
    with torch.no_grad():
        torch.testing.assert_close(got.double(), reference(x.double()), atol=ATOL, rtol=RTOL)


class _Float64Reference(nn.Module):
    """``act(F.batch_norm(x) + residual)`` in float64 for a tritonbn layer (``drop``/``act`` for SyncBatchNormAct)."""

    def __init__(self, bn):
        super().__init__()
        self.bn = bn

    def forward(self, x, residual=None):
        bn = self.bn
        y = F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
        if residual is not None:
            y = y + residual
        if isinstance(bn, SyncBatchNormAct):
            return bn.act(bn.drop(y))
        act = {None: lambda t: t, "relu": F.relu, "silu": F.silu}.get(bn.activation)
        return act(y) if act is not None else F.leaky_relu(y, bn.negative_slope)


def test_fold_batchnorm_leaves_training_layers_and_refuses_untraceable_models():
    """A BatchNorm in training mode or without running statistics is not folded (it normalizes with the batch);
    fx failures name fold_batchnorm."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 3, 1), tritonbn.SyncBatchNorm(3), nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3),
        nn.Conv2d(3, 3, 1), tritonbn.SyncBatchNorm(3, track_running_stats=False),
        nn.ConvTranspose2d(3, 3, 1, groups=3), nn.BatchNorm2d(3),  # torch's fold would broadcast a wrong weight
    ).eval()  # fmt: skip
    net[3].train()
    kept = (r"left 3 BatchNorm layer\(s\) as they are: 3 \(in training mode\), 5 \(no running statistics\), "
            r"7 \(after a grouped transposed convolution\)$")  # fmt: skip
    with pytest.warns(UserWarning, match=kept):
        folded = tritonbn.fold_batchnorm(net)
    assert not hasattr(folded, "1") and isinstance(folded.get_submodule("3"), nn.BatchNorm2d)

    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 3, 1), tritonbn.SyncBatchNorm(3)

        def forward(self, x):
            return self.bn(self.conv(x)) if x.sum() > 0 else x

    with pytest.raises(ValueError, match="fold_batchnorm: torch.fx cannot trace Untraceable"):
        tritonbn.fold_batchnorm(Untraceable().eval())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_export_rounds_once(dtype, backend_name):
    """fp16/bf16 in eval: the exported graph computes in fp32 and rounds once, as the kernels do: within half an
    ulp (plus fp32 rounding) of the float64 oracle, and within one ulp of eager."""
    torch.manual_seed(4)
    bn = tritonbn.SyncBatchNorm(5, activation="silu").eval()  # fp32 parameters and buffers, as under autocast
    bn.running_mean.normal_(0, 2)
    bn.running_var.uniform_(0.1, 0.5)
    bn.weight.data.uniform_(1, 3)
    x, r = (torch.randn(3, 5, 7, 11).mul(3).to(dtype) for _ in range(2))
    ep = torch.export.export(bn, (x, r))
    assert not _tritonbn_ops(ep)
    got = ep.module()(x, r)
    with torch.no_grad():
        want = bn(x, r)
    assert got.dtype == dtype
    z = F.batch_norm(x.double(), bn.running_mean.double(), bn.running_var.double(), bn.weight.detach().double(),
                     bn.bias.detach().double(), False, 0.0, bn.eps)  # fmt: skip
    oracle = F.silu(z + r.double())
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(oracle.abs().clamp_min(1e-3))))
    bound = ulp / 2 + 1e-6 * oracle.abs() + 1e-6
    assert ((got.double() - oracle).abs() <= bound).all(), (got.double() - oracle).abs().div(ulp).max()
    # Eager rounds once too (the Triton interpreter's float -> bf16 conversion may round differently): one ulp.
    assert ((got.double() - want.double()).abs() <= ulp * 1.01).all(), (got.double() - want.double()).div(ulp).max()
