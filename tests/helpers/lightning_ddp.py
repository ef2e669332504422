"""A 2-process CPU DDP Lightning run with tritonbn's plugin; each rank saves its BatchNorm state.

Run as a script (Lightning's "ddp" strategy starts the other rank by running it again):
``python tests/helpers/lightning_ddp.py OUT_DIR [lightning.pytorch|pytorch_lightning]``.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
from torch import nn

import tritonbn.lightning


def main(out_dir: str, namespace: str) -> None:
    L = importlib.import_module(namespace)

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2))
            self.seen = []

        def training_step(self, batch, _):
            self.seen.append(type(self.net[1]).__name__)
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    x = torch.randn(24, 3, 5) * torch.linspace(0.5, 3, 24).view(-1, 1, 1)  # ranks' halves differ
    data = torch.utils.data.TensorDataset(x, torch.randint(0, 2, (24,)))
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", plugins=[tritonbn.lightning.TritonSyncBatchNorm()],
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
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
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "lightning.pytorch")
