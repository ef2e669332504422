"""A ResNet-50 builder without torchvision: the same topology, 53 BatchNorm layers.

Stem (7x7 conv, BN, ReLU, max-pool), then four stages of bottleneck blocks ``[3, 4, 6, 3]`` with
widths ``64, 128, 256, 512`` (expansion 4), a projection shortcut (1x1 conv + BN) at the first block
of each stage, global average pooling and a linear head, as in torchvision's ``resnet50``. It is
used by ``host_overhead.py`` to count the host cost of BatchNorm in a whole training step.
"""

from __future__ import annotations

from torch import nn

BLOCKS = (3, 4, 6, 3)
WIDTHS = (64, 128, 256, 512)
EXPANSION = 4


class Bottleneck(nn.Module):
    def __init__(self, in_ch: int, width: int, stride: int, norm_layer) -> None:
        super().__init__()
        out_ch = width * EXPANSION
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = norm_layer(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = norm_layer(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = norm_layer(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), norm_layer(out_ch))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def resnet50(norm_layer=nn.BatchNorm2d, num_classes: int = 10) -> nn.Module:
    """ResNet-50 with ``norm_layer(num_features)`` for every BatchNorm (53 of them)."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        norm_layer(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    in_ch = 64
    for stage, (blocks, width) in enumerate(zip(BLOCKS, WIDTHS, strict=True)):
        for i in range(blocks):
            layers.append(Bottleneck(in_ch, width, 2 if (i == 0 and stage > 0) else 1, norm_layer))
            in_ch = width * EXPANSION
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)]
    return nn.Sequential(*layers)
