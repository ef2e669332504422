"""A 2-process CPU DDP Lightning run in float64 with tritonbn's layers; each rank saves its state.

Run as a script (Lightning's "ddp" strategy starts the other rank by running it again):
``python tests/helpers/lightning_ddp.py OUT_DIR [lightning.pytorch|pytorch_lightning] [plugin|switch]``.
``plugin``: tritonbn's ``TritonSyncBatchNorm`` plugin; ``switch``: Lightning's own ``sync_batchnorm=True`` after
``tritonbn.patch_sync_batchnorm()``. :func:`data` and :func:`network` are what the test's one-process run uses too.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
from torch import nn

import tritonbn
import tritonbn.lightning

LR, STEPS, PER_RANK = 0.1, 3, 4


def data() -> torch.utils.data.TensorDataset:
    """24 samples; rank r trains on its half, 12r to 12r + 11 (see ``train_dataloader``)."""
    g = torch.Generator().manual_seed(0)
    second = (torch.arange(24, dtype=torch.float64) >= 12).view(-1, 1, 1)
    x = torch.randn(24, 3, 5, generator=g, dtype=torch.float64) * (1 + 2 * second) + second  # the ranks' halves differ
    return torch.utils.data.TensorDataset(x, torch.randint(0, 2, (24,), generator=g))


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2)).double()


def main(out_dir: str, namespace: str, mode: str) -> None:
    L = importlib.import_module(namespace)

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()
            self.seen = []

        def training_step(self, batch, _):
            self.seen.append(type(self.net[1]).__name__)
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def train_dataloader(self):  # each rank its half, in order (Lightning's own sampler would shuffle)
            rank = self.trainer.global_rank
            half = torch.utils.data.Subset(data(), range(12 * rank, 12 * rank + 12))
            return torch.utils.data.DataLoader(half, batch_size=PER_RANK)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    model = Net()
    if mode == "switch":
        tritonbn.patch_sync_batchnorm()  # Lightning's sync_batchnorm=True now converts to tritonbn
        switch = {"sync_batchnorm": True}
    else:
        switch = {"plugins": [tritonbn.lightning.TritonSyncBatchNorm()]}
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, **switch,
    )  # fmt: skip
    trainer.fit(model)
    bn = model.net[1]
    rank = trainer.global_rank
    torch.save(
        {
            "seen": model.seen,
            "after": type(bn).__name__,
            "running_mean": bn.running_mean,
            "running_var": bn.running_var,
            "num_batches_tracked": bn.num_batches_tracked,
            "world": trainer.world_size,
            "state": model.net.state_dict(),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1] if len(args) > 1 else "lightning.pytorch", args[2] if len(args) > 2 else "plugin")
