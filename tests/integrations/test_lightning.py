"""tritonbn.lightning: a LayerSync plugin for whichever Lightning namespace is installed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch
from torch import nn

NAMESPACES = ["lightning.pytorch", "pytorch_lightning"]


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_plugin_is_a_layer_sync_of_each_namespace(namespace):
    import importlib

    import tritonbn
    import tritonbn.lightning

    layer_sync = importlib.import_module(f"{namespace}.plugins.layer_sync").LayerSync
    plugin = tritonbn.lightning.TritonSyncBatchNorm()
    assert isinstance(plugin, layer_sync)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    weight = model[1].weight
    converted = plugin.apply(model)
    assert type(converted[1]) is tritonbn.modules.SyncBatchNorm2d and converted[1].weight is weight
    assert type(plugin.revert(converted)[1]) is nn.BatchNorm2d
    trainer_cls = importlib.import_module(namespace).Trainer  # Lightning accepts it as its layer sync
    trainer = trainer_cls(accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_progress_bar=False)
    assert trainer._accelerator_connector._layer_sync is plugin


def _one_process() -> dict:
    """The unconverted network trained in one process on each step's global batch (float64)."""
    import lightning_ddp

    net, data = lightning_ddp.network(), lightning_ddp.data()
    opt = torch.optim.SGD(net.parameters(), lr=lightning_ddp.LR)
    for step in range(lightning_ddp.STEPS):
        x, y = data[[12 * rank + lightning_ddp.PER_RANK * step + i for rank in (0, 1) for i in range(4)]]
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()  # DDP averages the ranks' means: the global mean
        opt.step()
    return net.state_dict()


@pytest.mark.distributed
@pytest.mark.parametrize(
    "namespace, mode",
    [(NAMESPACES[0], "plugin"), (NAMESPACES[0], "switch")],  # the other namespace's Trainer: see above
    ids=["plugin", "sync_batchnorm=True-patched"],
)
def test_two_process_ddp_trainer(namespace, mode):
    """tritonbn's plugin, and Lightning's own switch after tritonbn.patch_sync_batchnorm(), train with tritonbn's
    layers on 2 CPU ranks (where torch's SyncBatchNorm is refused) and match one process on the global batch."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "lightning_ddp.py")
    # The plugin's conversion and the ranks' sync live above the backend: the PyTorch backend runs them.
    env = {**os.environ, "TRITONBN_BACKEND": "torch", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run([sys.executable, script, out, namespace, mode], env=env, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    want = _one_process()
    for r in ranks:
        assert r["world"] == 2
        assert r["seen"] == ["SyncBatchNorm1d"] * 3, "converted to tritonbn before training"
        # the plugin reverts after fitting; Lightning's switch reverts torch's SyncBatchNorm only, and keeps tritonbn's
        assert r["after"] == ("BatchNorm1d" if mode == "plugin" else "SyncBatchNorm1d")
        assert int(r["num_batches_tracked"]) == 3
        for key, value in want.items():
            torch.testing.assert_close(r["state"][key], value, atol=1e-12, rtol=1e-10, msg=lambda m, k=key: f"{k}: {m}")
    for key in ("running_mean", "running_var"):
        assert torch.equal(ranks[0][key], ranks[1][key]), f"{key} differs across ranks"
    assert not torch.equal(ranks[0]["running_mean"], torch.zeros(4, dtype=torch.float64)), "statistics were tracked"
