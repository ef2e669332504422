"""torch.fx: tritonbn.SyncBatchNorm is a leaf under any tracer; fuse_batchnorm_activations keeps every BatchNorm."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from timm_standin import BatchNormAct2d, EfficientNetish, InvertedResidual
from torch import fx, nn

import tritonbn


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet structure (stem, layers of BasicBlocks, pooled head), tiny."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(4, 4))
        self.layer2 = nn.Sequential(BasicBlock(4, 6, stride=2))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _randomize(model, seed=0):
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.normal_(0, 0.3)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.normal_(0, 0.5)
    return model


def _same_outputs(got_model, want_model, x, modes=("train", "eval")):
    for mode in modes:
        got_model.train(mode == "train")
        want_model.train(mode == "train")
        got, want = got_model(x), want_model(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, mode=mode: f"{mode}: {m}")


def _bn_nodes(graph: fx.Graph, root: nn.Module) -> list[str]:
    modules = dict(root.named_modules())
    return [
        n.target
        for n in graph.nodes
        if n.op == "call_module" and isinstance(modules[n.target], nn.modules.batchnorm._BatchNorm)
    ]


def test_converted_resnet_traces_with_symbolic_trace():
    model = _randomize(ResNet())
    reference = copy.deepcopy(model)
    converted = tritonbn.convert_sync_batchnorm(model)
    gm = fx.symbolic_trace(converted)
    bns = [name for name, m in converted.named_modules() if isinstance(m, tritonbn.SyncBatchNorm)]
    assert len(bns) == 6 and _bn_nodes(gm.graph, gm) == bns, "one call_module node per BatchNorm"
    assert not any(n.op == "call_function" and "batch_norm" in str(n.target) for n in gm.graph.nodes)
    assert gm.state_dict().keys() == reference.state_dict().keys()
    _same_outputs(gm, reference, torch.randn(2, 3, 9, 9))


def test_fused_residual_call_traces_as_one_node():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = tritonbn.SyncBatchNorm(3, activation="relu")

        def forward(self, x, r):
            return self.bn(x, r) * 2

    block = Block()
    gm = fx.symbolic_trace(block)
    (node,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert node.target == "bn" and len(node.args) == 2
    x, r = torch.randn(4, 3, 5), torch.randn(4, 3, 5)
    block.train()
    torch.testing.assert_close(gm(x, r), block(x, r))


class LeafModuleAwareTracer(fx.Tracer):
    """torchvision.models.feature_extraction's tracers: user leaf modules, node names by module path."""

    def __init__(self, *args, leaf_modules=(), **kwargs):
        self.leaf_modules = tuple(leaf_modules)
        super().__init__(*args, **kwargs)
        self.current_module_qualname = ""
        self.node_to_qualname = {}

    def is_leaf_module(self, m, module_qualname):
        if isinstance(m, self.leaf_modules):
            return True
        return super().is_leaf_module(m, module_qualname)

    def call_module(self, m, forward, args, kwargs):
        old = self.current_module_qualname
        try:
            qualname = self.path_of_module(m)
            self.current_module_qualname = qualname
            if not self.is_leaf_module(m, qualname):
                return forward(*args, **kwargs)
            return self.create_proxy("call_module", qualname, args, kwargs)
        finally:
            self.current_module_qualname = old

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, *_):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr)
        qualname = self.current_module_qualname
        if proxy.node.op != "call_module":
            qualname = (qualname + "." if qualname else "") + re.sub(r"_[0-9]+$", "", str(proxy.node))
        self.node_to_qualname[proxy.node] = qualname
        return proxy


def _feature_extractor(model, return_nodes):
    """What torchvision's create_feature_extractor does: trace (train and eval), keep the nodes asked for."""
    graphs = {}
    for mode in (True, False):
        model.train(mode)
        tracer = LeafModuleAwareTracer()
        graph = tracer.trace(model)
        graphs[mode] = (graph, tracer)
        assert sorted(tracer.node_to_qualname.values()) == sorted(graphs[True][1].node_to_qualname.values())
    graph, tracer = graphs[False]
    by_name = {q: n for n, q in tracer.node_to_qualname.items()}
    for node in [n for n in graph.nodes if n.op == "output"]:
        graph.erase_node(node)
    graph.output({name: by_name[name] for name in return_nodes})
    extractor = fx.GraphModule(tracer.root, graph, "Extractor")
    extractor.graph.eliminate_dead_code()
    extractor.recompile()
    return extractor


def test_converted_resnet_works_with_a_feature_extractor_tracer():
    model = _randomize(ResNet())
    reference = copy.deepcopy(model)
    converted = tritonbn.convert_sync_batchnorm(model)
    nodes = ["bn1", "layer1.0.bn2", "layer2.0.downsample.1", "layer2.0.bn2"]
    extractor = _feature_extractor(converted, nodes)
    want = _feature_extractor(reference, nodes)  # torch's BatchNorm2d: a leaf by fx's default rule
    assert _bn_nodes(extractor.graph, extractor) == _bn_nodes(want.graph, want)
    x = torch.randn(2, 3, 9, 9)
    for mode in (True, False):
        extractor.train(mode)
        want.train(mode)
        got, expected = extractor(x), want(x)
        assert got.keys() == expected.keys() == set(nodes)
        for k in nodes:
            torch.testing.assert_close(got[k], expected[k], atol=1e-5, rtol=1e-5)


def test_fuse_after_convert():
    model = _randomize(ResNet())
    reference = copy.deepcopy(model)
    fused, report = tritonbn.fuse_batchnorm_activations(tritonbn.convert_sync_batchnorm(model))
    assert report == ["bn1 + relu", "layer1.0.bn1 + relu", "layer1.0.bn2 + add + relu", "layer2.0.bn1 + relu",
                      "layer2.0.bn2 + add + relu"]  # fmt: skip
    _same_outputs(fused, reference, torch.randn(2, 3, 9, 9))


# --- fuse_batchnorm_activations on timm's BatchNormAct layers ----------------------------------------


class Doubled(nn.BatchNorm2d):
    """A BatchNorm subclass with its own forward."""

    def forward(self, x):
        return 2 * super().forward(x)


def _timm_model():
    blocks = [InvertedResidual(), InvertedResidual(act_layer=lambda inplace=False: nn.GELU())]
    model = EfficientNetish(blocks)
    model.bn2 = Doubled(6)
    return _randomize(model)


def test_fusion_keeps_every_batchnorm_buffer_and_eval_behaviour():
    model = _timm_model()
    reference = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=r"kept 3 BatchNorm.*blocks\.1\.bn1 \(BatchNormAct2d\).*bn2 \(Doubled\)"):
        fused, report = tritonbn.fuse_batchnorm_activations(model)
    assert report == [
        "bn1 (BatchNormAct2d) + silu",
        "blocks.0.bn1 (BatchNormAct2d) + silu",
        "blocks.0.bn2 (BatchNormAct2d) + silu",
        "blocks.0.bn3 (BatchNormAct2d)",
        "blocks.1.bn3 (BatchNormAct2d)",
    ]
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"tracing changed {k} of the input model"
    bns = lambda m: [n for n, mod in m.named_modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
    assert bns(fused) == bns(reference), "every BatchNorm is still a module (convert and DDP see them)"
    assert list(fused.state_dict()) == list(reference.state_dict()), "num_batches_tracked keys included"
    assert isinstance(fused.get_submodule("blocks.1.bn1"), BatchNormAct2d)
    x = torch.randn(3, 3, 5, 7)
    _same_outputs(fused, reference, x, modes=("eval", "train", "eval"))
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[k], v, atol=1e-6, rtol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_fusion_looks_through_identity_and_dropout():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d, self.e = (nn.BatchNorm1d(3) for _ in range(5))
            self.drop_block = nn.Identity()
            self.dropout = nn.Dropout(0.5)
            self.dropout2 = nn.Dropout(0.5)
            self.act = nn.ReLU()

        def forward(self, x, r):
            u = self.act(self.drop_block(self.a(x)))  # timm ResNet: bn -> drop_block (Identity) -> act
            v = F.leaky_relu(self.dropout(self.b(x)), 0.1)  # dropout commutes with (leaky) relu
            w = self.act(self.drop_block(self.c(x)) + r)  # Identity before the add
            s = F.silu(self.dropout2(self.d(x)))  # silu does not commute with dropout: not fused
            t = self.act(self.dropout(self.e(x) + r))  # dropout after the add, before relu
            return u + v + w + s + t

    net = _randomize(Net())
    reference = copy.deepcopy(net)
    fused, report = tritonbn.fuse_batchnorm_activations(net)
    assert report == ["a + relu", "b + leaky_relu", "c + add + relu", "e + add + relu"]
    assert type(fused.d) is nn.BatchNorm1d
    x, r = torch.randn(6, 3, 5), torch.randn(6, 3, 5)
    for mode in (True, False):
        fused.train(mode)
        reference.train(mode)
        torch.manual_seed(5)
        got = fused(x, r)
        torch.manual_seed(5)
        want = reference(x, r)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fusion_refuses_functional_batch_norm():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(3))
            self.register_buffer("var", torch.ones(3))

        def forward(self, x):
            return F.relu(F.batch_norm(x, self.mean, self.var, training=self.training))

    with pytest.raises(ValueError, match="calls batch_norm as a function.*bake its training flag"):
        tritonbn.fuse_batchnorm_activations(Functional())
