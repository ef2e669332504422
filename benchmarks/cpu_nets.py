"""Three small CNNs for the CPU training-step benchmark, built from ``torch.nn`` alone (no torchvision, no timm).

Each stands in for one kind of network that uses BatchNorm a different way:

* ``resnet``: ResNet-18's layout (basic blocks of two 3x3 convolutions, BN and ReLU, identity or
  1x1-projection shortcuts), at a chosen width. Few, large BN layers.
* ``mobilenet``: MobileNetV3-small's layout (inverted residuals: a 1x1 expansion, a depthwise 3x3
  and a 1x1 projection, each followed by BN; ReLU or Hardswish). Many small BN layers, where each
  layer's fixed cost counts.
* ``efficientnet``: EfficientNet-B0's layout (MBConv blocks with SiLU and squeeze-excitation).

All BN layers are plain ``nn.BatchNorm2d``, as in the torchvision and timm models, so that
``tritonbn.convert_sync_batchnorm`` converts them as it would those.
"""

from __future__ import annotations

import torch
from torch import nn

NETS = ("resnet", "mobilenet", "efficientnet")


def conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act: type | None = nn.ReLU):
    """conv (no bias) -> BatchNorm2d -> act (none if ``act`` is None)."""
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(conv_bn(cin, cout, 3, stride), conv_bn(cout, cout, 3, 1, act=None))
        self.shortcut = conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.body(x) + self.shortcut(x))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduced: int, act: type = nn.SiLU, gate: type = nn.Sigmoid) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.act = act()
        self.expand = nn.Conv2d(reduced, channels, 1)
        self.gate = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3), keepdim=True)
        return x * self.gate(self.expand(self.act(self.reduce(s))))


class InvertedResidual(nn.Module):
    """1x1 expansion (skipped at ratio 1), depthwise kxk, optional squeeze-excitation, 1x1 projection."""

    def __init__(self, cin, cout, k, stride, expand, act, se_ratio=0.0, se_act=nn.SiLU, se_gate=nn.Sigmoid):
        super().__init__()
        mid = cin * expand
        layers = [conv_bn(cin, mid, 1, act=act)] if expand != 1 else []
        layers.append(conv_bn(mid, mid, k, stride, groups=mid, act=act))
        if se_ratio > 0:
            layers.append(SqueezeExcite(mid, max(1, int(cin * se_ratio)), se_act, se_gate))
        layers.append(conv_bn(mid, cout, 1, act=None))
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


def _head(cin: int, width: int, act: type, classes: int) -> list[nn.Module]:
    return [conv_bn(cin, width, 1, act=act), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)]


def resnet(width: int = 64, classes: int = 10) -> nn.Module:
    """ResNet-18's layout: stem, 4 stages of 2 basic blocks (widths w, 2w, 4w, 8w), pool, linear. 20 BN layers."""
    layers: list[nn.Module] = [conv_bn(3, width, 3, 1)]
    cin = width
    for stage, stride in enumerate((1, 2, 2, 2)):
        cout = width * 2**stage
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def mobilenet(scale: float = 1.0, classes: int = 10) -> nn.Module:
    """MobileNetV3-small's layout: (kernel, expansion, out, SE, hardswish, stride) per block. 34 BN layers."""

    def c(n: int) -> int:
        return max(8, int(n * scale + 4) // 8 * 8)

    blocks = [
        (3, 1, 16, True, False, 2), (3, 4, 24, False, False, 2), (3, 4, 24, False, False, 1),
        (5, 4, 40, True, True, 2), (5, 6, 40, True, True, 1), (5, 6, 40, True, True, 1),
        (5, 3, 48, True, True, 1), (5, 3, 48, True, True, 1), (5, 6, 96, True, True, 2),
        (5, 6, 96, True, True, 1), (5, 6, 96, True, True, 1),
    ]  # fmt: skip
    layers: list[nn.Module] = [conv_bn(3, c(16), 3, 2, act=nn.Hardswish)]
    cin = c(16)
    for k, expand, out, se, hs, stride in blocks:
        act = nn.Hardswish if hs else nn.ReLU
        layers.append(
            InvertedResidual(cin, c(out), k, stride, expand, act, 0.25 if se else 0.0, nn.ReLU, nn.Hardsigmoid)
        )
        cin = c(out)
    return nn.Sequential(*layers, *_head(cin, c(576), nn.Hardswish, classes))


def efficientnet(scale: float = 1.0, classes: int = 10) -> nn.Module:
    """EfficientNet-B0's layout: MBConv blocks with SiLU and squeeze-excitation (ratio 0.25). 49 BN layers."""

    def c(n: int) -> int:
        return max(8, int(n * scale + 4) // 8 * 8)

    stages = [(1, 3, 16, 1, 1), (6, 3, 24, 2, 2), (6, 5, 40, 2, 2), (6, 3, 80, 2, 3), (6, 5, 112, 1, 3),
              (6, 5, 192, 2, 4), (6, 3, 320, 1, 1)]  # (expansion, kernel, out, stride, repeats)  # fmt: skip
    layers: list[nn.Module] = [conv_bn(3, c(32), 3, 2, act=nn.SiLU)]
    cin = c(32)
    for expand, k, out, stride, repeats in stages:
        for i in range(repeats):
            layers.append(InvertedResidual(cin, c(out), k, stride if i == 0 else 1, expand, nn.SiLU, 0.25))
            cin = c(out)
    return nn.Sequential(*layers, *_head(cin, c(1280), nn.SiLU, classes))


def build(name: str, small: bool = False) -> nn.Module:
    """The network ``name`` (one of :data:`NETS`); ``small``: the CI size (ResNet at half width)."""
    if name == "resnet":
        return resnet(32 if small else 64)
    if name == "mobilenet":
        return mobilenet()
    if name == "efficientnet":
        return efficientnet()
    raise ValueError(f"cpu_nets.build: name must be one of {', '.join(NETS)}, got {name!r}")


def input_size(name: str, small: bool = False) -> int:
    """The image side each network is timed at: ResNet and EfficientNet 64, MobileNet 96 (``small``: 32, 64, 32)."""
    if name == "mobilenet":
        return 64 if small else 96
    return 32 if small else 64
