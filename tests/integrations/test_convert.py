"""convert_sync_batchnorm and revert_sync_batchnorm: torch's BatchNorms, bias=False, subclasses, timm's layers."""

import copy
import io
import pickle
import warnings

import pytest
import torch
from timm_standin import BatchNormAct2d, DropBlockish, EfficientNetish, InvertedResidual, SyncBatchNormAct, timm_convert
from torch import nn

import tritonbn
from tritonbn.modules import SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4, momentum=None, eps=1e-3)
        self.inner = nn.Sequential(nn.BatchNorm3d(2, affine=False), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4))
        self.head = nn.BatchNorm1d(6, track_running_stats=False)
        self.synced = nn.SyncBatchNorm(5)
        self.ln = nn.LayerNorm(4)


def test_convert_and_revert_keep_everything():
    torch.manual_seed(0)
    model = Block().to(torch.float64)
    model.bn.weight.requires_grad_(False)
    model.bn.running_mean.normal_()
    model.bn.num_batches_tracked.fill_(7)
    model.inner.eval()
    originals = {name: type(m) for name, m in model.named_modules()}
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    group = object()  # any process group handle; conversion only stores it

    converted = tritonbn.convert_sync_batchnorm(model, process_group=group)
    bns = ["bn", "inner.0", "head", "synced"]
    modules = dict(converted.named_modules())
    kept = {
        "bn": SyncBatchNorm2d,
        "inner.0": SyncBatchNorm3d,
        "head": SyncBatchNorm1d,
        "synced": tritonbn.SyncBatchNorm,
    }
    for name in bns:
        assert type(modules[name]) is kept[name], name
        assert isinstance(modules[name], tritonbn.SyncBatchNorm), name
        assert isinstance(modules[name], originals[name]) == (name != "synced"), "an instance of the class it replaced"
        assert modules[name].process_group is group
    for name in ["conv", "inner.1", "inner.2", "ln"]:
        assert type(modules[name]) is originals[name], "other modules are left alone"
    assert modules["bn"].momentum is None and modules["bn"].eps == 1e-3
    assert not modules["inner.0"].affine and not modules["head"].track_running_stats
    assert not modules["inner.0"].training and modules["bn"].training
    # the very same parameter and buffer objects: device, dtype, requires_grad and optimizer state kept
    for name, p in converted.named_parameters():
        assert p is params[name], name
    for name, b in converted.named_buffers():
        assert b is buffers[name], name
    assert not converted.bn.weight.requires_grad
    assert converted.bn.running_mean.dtype == torch.float64
    assert {k: v for k, v in converted.state_dict().items()}.keys() == state.keys()

    assert type(tritonbn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3))) is SyncBatchNorm1d

    reverted = tritonbn.revert_sync_batchnorm(converted)
    modules = dict(reverted.named_modules())
    for name in bns:
        assert type(modules[name]) is originals[name], name
    assert modules["synced"].process_group is group
    for name, p in reverted.named_parameters():
        assert p is params[name], name
    for key, value in reverted.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert not modules["inner.0"].training


def test_convert_a_bare_batchnorm_and_revert_a_direct_module():
    bn = nn.BatchNorm3d(4)
    converted = tritonbn.convert_sync_batchnorm(bn)
    assert type(converted) is SyncBatchNorm3d and converted.weight is bn.weight
    assert type(tritonbn.revert_sync_batchnorm(converted)) is nn.BatchNorm3d
    direct = tritonbn.SyncBatchNorm(4)
    assert type(tritonbn.revert_sync_batchnorm(direct)) is nn.BatchNorm2d
    assert type(tritonbn.revert_sync_batchnorm(direct, default=nn.BatchNorm1d)) is nn.BatchNorm1d


def test_converted_model_runs_and_matches_plain_bn():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    reference.load_state_dict(model.state_dict())
    converted = tritonbn.convert_sync_batchnorm(model)
    x = torch.randn(5, 3, 7, 6)
    torch.testing.assert_close(converted(x), reference(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(converted[1].running_var, reference[1].running_var, atol=1e-6, rtol=1e-6)


# --- bias=False, BatchNorm subclasses and timm's BatchNormAct layers ---------------------------------


@pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm])
def test_bias_false_as_torch(cls):
    torch.manual_seed(2)
    ours = tritonbn.SyncBatchNorm(3, bias=False)
    theirs = cls(3, bias=False)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()] == ["weight"]
    assert ours.bias is None and list(ours.state_dict()) == list(theirs.state_dict())
    assert ours.extra_repr() == theirs.extra_repr()
    with pytest.raises(TypeError):
        tritonbn.SyncBatchNorm(3, 1e-5, 0.1, True, True, None, None, None, False)  # keyword-only, as in torch
    theirs.weight.data.uniform_(0.5, 1.5)
    ours.load_state_dict(theirs.state_dict())
    shapes = {nn.BatchNorm1d: (4, 3, 5), nn.BatchNorm2d: (4, 3, 5, 3), nn.BatchNorm3d: (4, 3, 2, 3, 3)}
    x = torch.randn(shapes.get(cls, (4, 3, 5)))
    x64 = x.double().requires_grad_()
    ref = torch.nn.functional.batch_norm(x64, None, None, theirs.weight.double(), None, True)
    xo = x.clone().requires_grad_()
    y = ours(xo)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xo.grad.double(), x64.grad, atol=1e-4, rtol=1e-4)

    model = nn.Sequential(cls(3, bias=False), nn.BatchNorm2d(3))
    weight = model[0].weight
    converted = tritonbn.convert_sync_batchnorm(model)
    assert converted[0].bias is None and converted[0].weight is weight and converted[1].bias is not None
    assert list(converted.state_dict()) == list(nn.Sequential(cls(3, bias=False), nn.BatchNorm2d(3)).state_dict())
    reverted = tritonbn.revert_sync_batchnorm(converted)
    assert type(reverted[0]) is cls and reverted[0].bias is None and reverted[0].weight is weight
    assert reverted[1].bias is not None


def _efficientnet(blocks=None, seed=0):
    torch.manual_seed(seed)
    model = EfficientNetish(blocks)
    for m in model.modules():  # non-trivial statistics and affine parameters
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.3)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.normal_(0, 0.5)
            m.num_batches_tracked.fill_(3)
    return model


def _mixed_blocks():
    """Every kind of timm norm-act layer: fused ReLU/LeakyReLU/SiLU/Identity, and kept GELU and a drop layer."""
    return [
        InvertedResidual(act_layer=nn.ReLU),
        InvertedResidual(act_layer=lambda inplace=False: nn.LeakyReLU(0.3, inplace=inplace)),
        InvertedResidual(act_layer=lambda inplace=False: nn.GELU()),  # timm GELU takes inplace
        InvertedResidual(act_layer=nn.SiLU, drop_layer=DropBlockish),
    ]


def _outputs(model, x, steps=1):
    """Training steps (outputs, input grads, running stats), then eval."""
    model.train()
    got = []
    for _ in range(steps):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(torch.ones_like(y))
        got += [y.detach(), xi.grad]
    model.eval()
    got.append(model(x).detach())
    return got, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "blocks, timm_synced",
    [(None, False), (_mixed_blocks, True)],
    ids=["efficientnet-BatchNormAct2d", "mixed_acts-SyncBatchNormAct"],
)
def test_timm_norm_act_conversion_computes_the_same(blocks, timm_synced):
    model = _efficientnet(blocks() if blocks else None)
    if timm_synced:
        model = timm_convert(model)  # timm's own converter: SyncBatchNormAct (runs as BN at world size 1)
    reference = copy.deepcopy(model)
    originals = {name: (type(m), m) for name, m in model.named_modules()}
    keys = list(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left alone
        converted = tritonbn.convert_sync_batchnorm(model)
    modules = dict(converted.named_modules())
    bn_names = [n for n, (cls, _) in originals.items() if issubclass(cls, nn.modules.batchnorm._BatchNorm)]
    assert len(bn_names) == (8 if blocks is None else 14)
    for name in bn_names:
        m, (cls, original) = modules[name], originals[name]
        assert isinstance(m, tritonbn.SyncBatchNorm), name
        act, drop = original.act, original.drop
        fusable = type(drop) is nn.Identity and type(act) in (nn.ReLU, nn.LeakyReLU, nn.SiLU, nn.Identity)
        if fusable:
            want = {nn.ReLU: "relu", nn.LeakyReLU: "leaky_relu", nn.SiLU: "silu", nn.Identity: None}[type(act)]
            # without an activation it computes what its class computes, and an nn.BatchNorm2d stays one (timm's
            # SyncBatchNormAct, an nn.SyncBatchNorm, becomes a plain SyncBatchNorm); with one it is no BatchNorm2d
            plain = want is None and issubclass(cls, nn.BatchNorm2d)
            assert type(m) is (SyncBatchNorm2d if plain else tritonbn.SyncBatchNorm), name
            assert m.activation == want, name
            if want == "leaky_relu":
                assert m.negative_slope == act.negative_slope == 0.3
        else:
            assert type(m) is tritonbn.modules.SyncBatchNormAct and m.act is act and m.drop is drop, name
    assert list(converted.state_dict()) == keys

    x = torch.randn(3, 3, 5, 7)
    want, want_state = _outputs(reference, x)
    got, got_state = _outputs(converted, x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert got_state.keys() == want_state.keys()
    for k in want_state:
        torch.testing.assert_close(got_state[k], want_state[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")

    reverted = tritonbn.revert_sync_batchnorm(converted)
    for name, (cls, original) in originals.items():
        m = reverted.get_submodule(name)
        assert type(m) is cls, name
        if name in bn_names:
            assert m is original and type(m.act) is type(original.act) and m.drop is original.drop, name
    assert list(reverted.state_dict()) == keys
    reverted.eval()
    torch.testing.assert_close(reverted(x), got[-1], atol=1e-5, rtol=1e-5)


def test_subclasses_that_compute_something_else_are_left_alone_with_one_warning():
    class Doubled(nn.BatchNorm2d):
        def forward(self, x):
            return 2 * super().forward(x)

    class WithChild(nn.BatchNorm2d):
        def __init__(self, c):
            super().__init__(c)
            self.post = nn.Tanh()

    class Renamed(nn.BatchNorm2d):  # torch's forward, no children: converts like BatchNorm2d
        def __init__(self, c):
            super().__init__(c, eps=1e-3)

    class Custom(nn.modules.batchnorm._BatchNorm):
        def _check_input_dim(self, input):
            pass

    def build():
        return nn.Sequential(Doubled(3), nn.Sequential(WithChild(3)), Renamed(3), Custom(3), nn.BatchNorm2d(3))

    model = build()
    renamed = model[2]
    with pytest.warns(UserWarning) as record:
        converted = tritonbn.convert_sync_batchnorm(model)
    assert len(record) == 1
    message = str(record[0].message)
    for name in ("0 (Doubled", "1.0 (WithChild", "3 (Custom"):
        assert name in message, message
    assert "2 (Renamed" not in message and "4 (" not in message
    kinds = [type(m).__name__ for m in converted]
    assert kinds == ["Doubled", "Sequential", "SyncBatchNorm2d", "Custom", "SyncBatchNorm2d"]
    assert isinstance(converted[2], nn.BatchNorm2d) and not isinstance(converted[2], Renamed), "its torch class"
    assert converted[2].eps == 1e-3
    assert tritonbn.revert_sync_batchnorm(converted)[2] is renamed

    strict_model = build()
    before = [type(m) for m in strict_model.modules()]
    with pytest.raises(ValueError, match="Doubled"):
        tritonbn.convert_sync_batchnorm(strict_model, strict=True)
    assert [type(m) for m in strict_model.modules()] == before, "strict refuses before changing anything"
    with pytest.raises(ValueError, match="WithChild"):
        tritonbn.SyncBatchNorm.convert_sync_batchnorm(WithChild(3), strict=True)


def test_unconverted_timm_layer_is_recognised_by_structure_only():
    odd = BatchNormAct2d(3)
    del odd.drop  # not timm's structure any more: left alone, with the warning
    with pytest.warns(UserWarning, match="BatchNormAct2d"):
        assert tritonbn.convert_sync_batchnorm(odd) is odd
    with pytest.warns(UserWarning, match="SyncBatchNormAct"):  # no act or drop: not timm's structure either
        assert type(tritonbn.convert_sync_batchnorm(SyncBatchNormAct(3))) is SyncBatchNormAct


def test_kept_classes_survive_deepcopy_pickle_and_torch_save(monkeypatch):
    """A converted layer that has run keeps its class (an nn.BatchNorm1d/2d/3d), its outputs and its way back
    through deepcopy, pickle and torch.save of the whole model: the classes are importable, module-level."""
    # The PyTorch backend: a layer that has run the Triton kernels under TRITON_INTERPRET=1 does not pickle
    # whatever its class (its cached settings hold the interpreted kernel), a matter of its own.
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    torch.manual_seed(4)
    model = tritonbn.convert_sync_batchnorm(nn.ModuleList([nn.BatchNorm1d(4), nn.BatchNorm2d(4), nn.BatchNorm3d(4)]))
    inputs = [torch.randn(5, 4, 3), torch.randn(5, 4, 3, 2), torch.randn(5, 4, 2, 2, 2)]
    for layer, x in zip(model, inputs, strict=True):
        layer(x)  # has run: its settings are cached
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)]
    kinds = [(SyncBatchNorm1d, nn.BatchNorm1d), (SyncBatchNorm2d, nn.BatchNorm2d), (SyncBatchNorm3d, nn.BatchNorm3d)]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for copied in copies:
        model.load_state_dict(state)  # the running statistics the copies were taken with
        for layer, twin, x, (kept, torch_class) in zip(model, copied, inputs, kinds, strict=True):
            assert type(twin) is kept and isinstance(twin, torch_class)
            for mode in (True, False):
                torch.testing.assert_close(twin.train(mode)(x), layer.train(mode)(x), atol=0, rtol=0)
        assert [type(m) for m in tritonbn.revert_sync_batchnorm(copied)] == [c for _, c in kinds]
