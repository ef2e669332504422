"""tritonbn.mmengine: "TritonSyncBN" in OpenMMLab configs, through mmengine's registry and mmcv's build_norm_layer.

The 2-rank test builds a small model from a config file (mmcv ``ConvModule`` blocks, ``norm_cfg`` from
the config) and trains it under DDP without buffer broadcasts: with tritonbn the ranks' running
statistics stay identical and equal those of the same model trained in one process on the global
batch; with plain ``BN`` (the control) they drift apart.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F
from dist import load_ranks, save_rank, spawn
from torch import nn

pytest.importorskip("mmengine", reason="mmengine is a test extra: pip install -e '.[test]'")
pytest.importorskip("mmcv.cnn", reason="mmcv-lite is a test extra: pip install -e '.[test]'")

from mmcv.cnn import ConvModule, build_norm_layer  # noqa: E402
from mmengine.config import Config  # noqa: E402
from mmengine.model import BaseModule, convert_sync_batchnorm, revert_sync_batchnorm  # noqa: E402
from mmengine.registry import MODELS, Registry  # noqa: E402

import tritonbn  # noqa: E402, F401

CONFIG = """
custom_imports = dict(imports=["tritonbn.mmengine"], allow_failed_imports=False)
norm_cfg = dict(type="{norm}", requires_grad=True)
model = dict(type="TritonBNTinyNet", norm_cfg=norm_cfg)
"""


@MODELS.register_module(name="TritonBNTinyNet", force=True)
class TinyNet(BaseModule):
    """Two conv-norm-relu blocks (mmcv's ConvModule, the building block of OpenMMLab backbones), then a head."""

    def __init__(self, norm_cfg: dict, init_cfg=None) -> None:
        super().__init__(init_cfg)
        self.stem = ConvModule(3, 6, 3, padding=1, norm_cfg=norm_cfg)
        self.block = ConvModule(6, 5, 3, stride=2, padding=1, norm_cfg=norm_cfg)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def test_build_norm_layer_gives_tritonbn():
    import tritonbn.mmengine

    name, layer = build_norm_layer(dict(type="TritonSyncBN", requires_grad=True), 7)
    assert name == "bn" and type(layer) is tritonbn.SyncBatchNorm and layer.num_features == 7
    assert all(p.requires_grad for p in layer.parameters())
    name, layer = build_norm_layer(dict(type="TritonSyncBN", requires_grad=False, momentum=0.03, eps=1e-3), 5, 2)
    assert name == "bn2" and type(layer) is tritonbn.SyncBatchNorm
    assert (layer.momentum, layer.eps) == (0.03, 1e-3)
    assert [p.requires_grad for p in layer.parameters()] == [False, False]
    # Downstream codebases (mmdet, mmseg) build from child registries, which find the name in mmengine's.
    child = Registry("model", parent=MODELS, scope="tritonbn_test")
    assert child.get("TritonSyncBN") is tritonbn.SyncBatchNorm
    assert tritonbn.mmengine.NAME == "TritonSyncBN"


def test_missing_mmengine_names_tritonbn(monkeypatch):
    monkeypatch.setitem(sys.modules, "mmengine", None)  # import mmengine now raises ImportError
    monkeypatch.setitem(sys.modules, "mmengine.registry", None)
    monkeypatch.delitem(sys.modules, "tritonbn.mmengine", raising=False)
    monkeypatch.delitem(sys.modules, "tritonbn.integrations.mmengine", raising=False)  # what the kept path imports
    with pytest.raises(ImportError, match="tritonbn.mmengine needs mmengine: pip install mmengine"):
        importlib.import_module("tritonbn.mmengine")


def test_what_mmengine_runner_helpers_do_with_tritonbn_layers():
    """What the docs say: revert_sync_batchnorm (the Runner, not distributed) keeps tritonbn layers;
    convert_sync_batchnorm (the Runner's and its strategies' sync_bn="torch") turns them into torch.nn.SyncBatchNorm,
    unless tritonbn.patch_sync_batchnorm() was called: then it converts BatchNorms to tritonbn's, keeping tritonbn's."""
    import mmengine._strategy.distributed
    import mmengine.runner.runner

    import tritonbn.mmengine  # noqa: F401

    model = MODELS.build(dict(type="TritonBNTinyNet", norm_cfg=dict(type="TritonSyncBN")))
    kept = revert_sync_batchnorm(model)
    assert type(kept.stem.bn) is tritonbn.SyncBatchNorm and type(kept.block.bn) is tritonbn.SyncBatchNorm
    replaced = convert_sync_batchnorm(model, "torch")
    assert type(replaced.stem.bn) is nn.SyncBatchNorm and type(replaced.block.bn) is nn.SyncBatchNorm

    tritonbn.patch_sync_batchnorm()
    try:
        for switch in (mmengine.runner.runner.convert_sync_batchnorm,  # the names the Runner and its strategy call
                       mmengine._strategy.distributed.convert_sync_batchnorm):  # fmt: skip
            model = MODELS.build(dict(type="TritonBNTinyNet", norm_cfg=dict(type="TritonSyncBN")))
            ours = model.stem.bn
            assert switch(model, "torch").stem.bn is ours
            plain = switch(MODELS.build(dict(type="TritonBNTinyNet", norm_cfg=dict(type="BN"))), "torch")
            assert type(plain.stem.bn) is type(plain.block.bn) is tritonbn.modules.SyncBatchNorm2d
    finally:
        tritonbn.unpatch_sync_batchnorm()
    assert type(mmengine.runner.runner.convert_sync_batchnorm(model, "torch").stem.bn) is nn.SyncBatchNorm


PER_RANK, STEPS, LR = 3, 3, 0.1


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(PER_RANK, 3, 6, 5, generator=g, dtype=torch.float64) * (1.0 + rank) + 2.0 * rank
    return x, torch.randint(0, 3, (PER_RANK,), generator=g)


def _build(config_path: str) -> nn.Module:
    cfg = Config.fromfile(config_path)  # imports tritonbn.mmengine through custom_imports
    torch.manual_seed(0)
    return MODELS.build(cfg.model).double()


def _train_rank(rank, world, out_dir, configs):
    assert "tritonbn.mmengine" not in sys.modules  # the config's custom_imports brings it in
    saved = {}
    for norm, path in configs.items():
        model = _build(path)
        ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        for step in range(STEPS):
            x, t = _batch(step, rank)
            opt.zero_grad()
            F.cross_entropy(ddp(x), t).backward()  # DDP averages: the global mean loss, equal ranks
            opt.step()
        saved[norm] = {k: v.clone() for k, v in model.state_dict().items()}
        saved[norm + "_types"] = [type(m).__name__ for m in model.modules()]
    save_rank(out_dir, rank, saved)


def _write_configs(tmp: str) -> dict[str, str]:
    paths = {}
    for norm in ("TritonSyncBN", "BN"):
        paths[norm] = os.path.join(tmp, f"tiny_{norm}.py")
        with open(paths[norm], "w") as f:
            f.write(CONFIG.format(norm=norm))
    return paths


@pytest.mark.distributed
@pytest.mark.interpreter
def test_config_model_trains_in_sync_over_two_ranks():
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        configs = _write_configs(tmp)
        spawn(world, _train_rank, tmp, configs)
        ranks = load_ranks(tmp, world)
        # The reference: the same config with plain BN, trained in one process on the global batch.
        reference = _build(configs["BN"])
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(STEPS):
        parts = [_batch(step, r) for r in range(world)]
        opt.zero_grad()
        F.cross_entropy(reference(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
        opt.step()
    assert ranks[0]["TritonSyncBN_types"].count("SyncBatchNorm") == 2
    stats = [k for k in ranks[0]["TritonSyncBN"] if k.endswith(("running_mean", "running_var"))]
    assert len(stats) == 4
    for key, value in ranks[0]["TritonSyncBN"].items():
        assert torch.equal(value, ranks[1]["TritonSyncBN"][key]), f"{key} differs between the ranks"
        torch.testing.assert_close(value, reference.state_dict()[key], atol=1e-10, rtol=1e-10)
    # The control: plain BN under the same DDP drifts apart, so the comparison above can fail.
    assert any(not torch.allclose(ranks[0]["BN"][k], ranks[1]["BN"][k]) for k in stats)
