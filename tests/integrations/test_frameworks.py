"""The frameworks' own code around the model, with tritonbn's layers in it.

A converted layer is an instance of the class it replaced, so code that finds BatchNorms by class (fastai's weight
decay, ``freeze`` and ``BnFreeze``; timm's ``freeze_batch_norm_2d``) treats a converted model as the unconverted
one. ``tritonbn.patch_sync_batchnorm()`` routes the frameworks' sync-BN switches to tritonbn: torch's classmethod
(Ignite, fastai, Lightning: its test is in test_lightning.py) and mmengine's and timm's own converters.
fastai and timm cannot be installed here (both need torchvision): tests/helpers/fastai_standin.py and
tests/helpers/timm_standin.py stand in for the checks they make.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import types

import fastai_standin as fastai
import pytest
import timm_standin as timm
import torch
import torch.nn.functional as F
from dist import load_ranks, save_rank, spawn
from timm_standin import convert_sync_batchnorm as timm_train_script_converter  # as timm's train.py imports it
from torch import nn

import tritonbn
from tritonbn import patching
from tritonbn.modules import SyncBatchNorm1d, SyncBatchNorm2d


def _randomize(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.5)
                m.running_mean.normal_(0, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    return model


# --- patch_sync_batchnorm ----------------------------------------------------------------------------------------


@pytest.fixture
def unpatched():
    yield
    tritonbn.unpatch_sync_batchnorm()


def _layers():
    return nn.ModuleList([nn.BatchNorm2d(4), timm.BatchNormAct2d(4), nn.SyncBatchNorm(4), tritonbn.SyncBatchNorm(4)])


def test_patch_routes_each_switch_to_tritonbn_and_unpatch_restores_exactly(monkeypatch, unpatched):
    import mmengine.model
    import mmengine.model.utils

    monkeypatch.setitem(patching.FRAMEWORKS, "timm_standin", "timm_standin")  # timm's converter, by its stand-in
    torch_before = nn.SyncBatchNorm.__dict__["convert_sync_batchnorm"]
    mmengine_before, timm_before = mmengine.model.utils.convert_sync_batchnorm, timm.convert_sync_batchnorm
    assert mmengine.model.convert_sync_batchnorm is mmengine_before and timm_train_script_converter is timm_before

    patched = tritonbn.patch_sync_batchnorm()
    assert patched[0] == "torch.nn.modules.batchnorm.SyncBatchNorm.convert_sync_batchnorm"
    for name in ("mmengine.model.utils", "mmengine.model", "timm_standin", __name__):
        assert f"{name}.{patching.NAME}" in patched or f"{name}.timm_train_script_converter" in patched, name
    assert tritonbn.patch_sync_batchnorm() == [], "a second call does nothing"
    late = types.ModuleType("imported_while_patched")  # a module that imports mmengine's converter by name now
    late.convert_sync_batchnorm = mmengine.model.convert_sync_batchnorm
    monkeypatch.setitem(sys.modules, late.__name__, late)

    switches = {
        "torch": lambda m: nn.SyncBatchNorm.convert_sync_batchnorm(m, process_group=None),  # Ignite, fastai, Lightning
        "mmengine": lambda m: late.convert_sync_batchnorm(m, "torch"),  # the Runner's sync_bn="torch"
        "timm": lambda m: timm_train_script_converter(m),  # train.py --sync-bn
    }
    for switch, convert in switches.items():
        layers = _layers()
        ours = layers[3]
        out = convert(layers)
        assert type(out[0]) is SyncBatchNorm2d and out[0].weight is layers[0].weight, switch
        assert isinstance(out[1], tritonbn.SyncBatchNorm) and out[1].activation == "relu", switch  # keeps its act
        assert type(out[2]) is tritonbn.SyncBatchNorm, switch
        assert out[3] is ours, f"{switch}: tritonbn's layers are left alone"

    tritonbn.unpatch_sync_batchnorm()
    tritonbn.unpatch_sync_batchnorm()  # a second call does nothing
    assert nn.SyncBatchNorm.__dict__["convert_sync_batchnorm"] is torch_before
    assert mmengine.model.utils.convert_sync_batchnorm is mmengine_before
    assert mmengine.model.convert_sync_batchnorm is mmengine_before and late.convert_sync_batchnorm is mmengine_before
    assert timm.convert_sync_batchnorm is timm_before and timm_train_script_converter is timm_before
    assert type(nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(2))) is nn.SyncBatchNorm, "torch's again"


def test_a_framework_that_does_not_import_is_named_in_a_warning(monkeypatch, unpatched):
    monkeypatch.setitem(patching.FRAMEWORKS, "timm_standin", "timm_standin.missing")  # as timm without torchvision
    with pytest.warns(UserWarning, match="patch_sync_batchnorm: timm_standin is installed but timm_standin.missing"):
        patched = tritonbn.patch_sync_batchnorm()
    assert patched[0].endswith("SyncBatchNorm.convert_sync_batchnorm") and not any("timm" in p for p in patched)


# --- fastai and timm: code that finds BatchNorms by class --------------------------------------------------------


def _fastai_net() -> nn.Module:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 1),
                         nn.BatchNorm2d(5), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())  # fmt: skip
    head = nn.Sequential(nn.BatchNorm1d(5), nn.Linear(5, 3))
    return _randomize(nn.Sequential(body, head).double())


@pytest.mark.parametrize(
    "train_bn, bn_freeze", [(True, False), (False, True)], ids=["defaults-train_bn", "train_bn=False-BnFreeze"]
)
def test_fastai_weight_decay_freeze_and_bn_freeze_treat_a_converted_model_as_the_unconverted_one(train_bn, bn_freeze):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 3, 5, 5, generator=g, dtype=torch.float64) * 2 + 1,
                torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]  # fmt: skip
    runs = []
    for convert in (False, True):
        model = _fastai_net()
        if convert:
            model = tritonbn.convert_sync_batchnorm(model)
        groups = [list(model[0].parameters()), list(model[1].parameters())]  # a splitter: body, head
        learn = fastai.Learner(model, groups, lr=0.1, wd=0.1, train_bn=train_bn, bn_freeze=bn_freeze)
        learn.freeze()  # the body's group is frozen: its BatchNorms train only with train_bn
        learn.fit(batches, F.cross_entropy)
        runs.append((learn, model))
    (plain_learn, plain), (learn, converted) = runs
    assert isinstance(converted[0][1], tritonbn.SyncBatchNorm)
    assert list(learn.state.values()) == list(plain_learn.state.values()), "the same do_wd and force_train"
    assert [p.requires_grad for p in converted.parameters()] == [p.requires_grad for p in plain.parameters()]
    assert [m.training for m in converted.modules()] == [m.training for m in plain.modules()]
    assert [s["do_wd"] for s in learn.state.values()].count(False) == 8, "BatchNorm parameters and biases"
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[key], value, atol=1e-12, rtol=1e-12, msg=key)
    initial = _fastai_net().state_dict()
    frozen = torch.equal(converted.state_dict()["0.1.running_mean"], initial["0.1.running_mean"])
    assert frozen == bn_freeze, "BnFreeze keeps the frozen BatchNorms' running statistics, and only it"
    assert torch.equal(converted[0][1].weight, initial["0.1.weight"]) != train_bn, "train_bn trains frozen BNs"


def test_timm_freeze_batch_norm_2d_freezes_a_converted_models_batchnorms():
    torch.manual_seed(3)
    layers = [nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)]
    acts = [timm.BatchNormAct2d(4, act_layer=nn.SiLU), timm.BatchNormAct2d(4, apply_act=False)]
    model = _randomize(nn.Sequential(*layers, *acts).double())
    reference = copy.deepcopy(model)
    frozen = timm.freeze_batch_norm_2d(tritonbn.convert_sync_batchnorm(model))
    frozen_reference = timm.freeze_batch_norm_2d(reference)
    assert [type(m) for m in frozen[:5]] == [type(m) for m in frozen_reference[:5]]
    assert type(frozen[1]) is type(frozen[4]) is timm.FrozenBatchNorm2d
    # timm's norm-act layer converts to a tritonbn layer with its activation, not an nn.BatchNorm2d, so timm's freeze
    # leaves it as it is rather than freeze it into a FrozenBatchNorm2d without the SiLU (docs/limits.md: freeze
    # before converting); as the tritonbn layer it is, it still computes the same in eval.
    assert isinstance(frozen[5], tritonbn.SyncBatchNorm) and frozen[5].activation == "silu"
    assert not isinstance(frozen[5], nn.BatchNorm2d)
    # without an activation it converts to a SyncBatchNorm2d, which timm freezes (as a FrozenBatchNorm2d, where
    # the unconverted one becomes a FrozenBatchNormAct2d with an Identity act: the same computation)
    assert type(frozen[6]) is timm.FrozenBatchNorm2d and type(frozen_reference[6]) is timm.FrozenBatchNormAct2d
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(frozen.eval()(x), frozen_reference.eval()(x), atol=1e-12, rtol=1e-12)
    # frozen first, then converted: every layer frozen as in the unconverted model
    refrozen = tritonbn.convert_sync_batchnorm(timm.freeze_batch_norm_2d(copy.deepcopy(reference)))
    assert [type(m) for m in refrozen] == [type(m) for m in frozen_reference]


# --- the switches on 2 gloo ranks: Ignite's auto_model and fastai's distrib_ctx ----------------------------------

PER_RANK, STEPS, LR = 3, 3, 0.1


def _ddp_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.BatchNorm1d(4), nn.Linear(4, 3)).double()  # fmt: skip


def _global_batch(step: int, world: int):
    g = torch.Generator().manual_seed(10 + step)
    scale = torch.arange(1, world + 1, dtype=torch.float64).repeat_interleave(PER_RANK).view(-1, 1, 1, 1)
    x = torch.randn(world * PER_RANK, 3, 5, 5, generator=g, dtype=torch.float64) * scale + scale  # ranks differ
    return x, torch.randint(0, 3, (world * PER_RANK,), generator=g)


def _train(model: nn.Module, rank: int | None, world: int) -> None:
    """SGD steps on this rank's slice of each global batch (the whole batch when ``rank`` is None)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _global_batch(step, world)
        if rank is not None:
            x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()  # DDP averages the ranks' means: the global batch's mean
        opt.step()


def _switches_rank(rank: int, world: int, out: str) -> None:
    import ignite.distributed as idist

    saved = {}
    with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
        idist.auto_model(_ddp_net(), sync_bn=True)  # unpatched: torch's SyncBatchNorm, which DDP refuses on CPU
    tritonbn.patch_sync_batchnorm()
    try:
        for name, prepare in (("ignite", lambda m: idist.auto_model(m, sync_bn=True)),
                              ("fastai", fastai.distributed_model)):  # fmt: skip
            model = _ddp_net()
            ddp = prepare(model)
            assert isinstance(ddp, nn.parallel.DistributedDataParallel), name
            saved[name + "_types"] = [
                type(m) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            ]
            _train(ddp, rank, world)
            saved[name] = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        tritonbn.unpatch_sync_batchnorm()
    save_rank(out, rank, saved)


@pytest.mark.distributed
def test_ignite_auto_model_and_fastai_distrib_ctx_sync_with_tritonbn_after_the_patch():
    """``idist.auto_model(model, sync_bn=True)`` and fastai's ``distrib_ctx()`` (its conversion and DDP, by the
    stand-in) train with tritonbn's layers on 2 CPU ranks and match one process on the global batch."""
    world = 2
    with tempfile.TemporaryDirectory() as out:
        spawn(world, _switches_rank, out)
        ranks = load_ranks(out, world)
    reference = _ddp_net()
    _train(reference, None, world)
    for rank, saved in enumerate(ranks):
        for name in ("ignite", "fastai"):
            assert saved[name + "_types"] == [SyncBatchNorm2d, SyncBatchNorm1d], (rank, name)
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(saved[name][key], value, atol=1e-12, rtol=1e-10, msg=f"{rank} {name} {key}")
    for name in ("ignite", "fastai"):
        for key, value in ranks[0][name].items():
            assert torch.equal(ranks[1][name][key], value), f"{name} {key} differs across ranks"
