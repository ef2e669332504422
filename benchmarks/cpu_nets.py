"""Small CNNs for the CPU training-step benchmark, built from ``torch.nn`` alone (no torchvision, no timm).

Three layouts, each standing in for one kind of network that uses BatchNorm a different way:

* ``resnet``: ResNet-18's layout (basic blocks of two 3x3 convolutions, BN and ReLU, identity or
  1x1-projection shortcuts), at a chosen width. Few, large BN layers.
* ``mobilenet``: MobileNetV3-small's layout (inverted residuals: a 1x1 expansion, a depthwise 3x3
  and a 1x1 projection, each followed by BN; ReLU or Hardswish). Many small BN layers, where each
  layer's fixed cost counts.
* ``efficientnet``: EfficientNet-B0's layout (MBConv blocks with SiLU and squeeze-excitation).

In those three every BN layer is a plain ``nn.BatchNorm2d`` followed by separate activation modules, as in the
torchvision models, so that ``tritonbn.convert_sync_batchnorm`` converts each to a layer without an epilogue.
Two other forms put the epilogue in the tritonbn layers, as the networks users convert do:

* ``mobilenet_timm``, ``efficientnet_timm``: the same layouts built, as timm builds them, from norm-act
  layers (:class:`BatchNormAct2d`, timm's ``BatchNormAct2d`` in structure: BN, then its ``drop`` and
  in-place ``act`` children), which conversion turns into ``SyncBatchNorm(activation=...)`` (ReLU, SiLU) or
  ``SyncBatchNormAct`` (Hardswish, which the kernels do not fuse);
* ``resnet_fx``: ``resnet`` after ``tritonbn.fuse_batchnorm_activations`` (BN + ReLU, and BN + add + ReLU in
  each basic block, fused), then conversion.

:func:`converted` makes each network's tritonbn form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NETS = ("resnet", "mobilenet", "efficientnet", "resnet_fx", "mobilenet_timm", "efficientnet_timm")


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d`` as conversion sees it: a ``BatchNorm2d`` whose forward is timm's,
    ``act(drop(batch_norm(x)))``, with exactly the children ``drop`` and ``act`` (timm makes ``act`` in place)."""

    def __init__(self, num_features: int, act_layer: type | None = nn.ReLU) -> None:
        super().__init__(num_features)
        self.drop = nn.Identity()
        self.act = act_layer(inplace=True) if act_layer is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum,
                         self.eps)  # fmt: skip
        return self.act(self.drop(x))


def conv_bn(
    cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act: type | None = nn.ReLU, norm_act=False
):
    """conv (no bias) -> BatchNorm2d -> act (none if ``act`` is None); ``norm_act``: conv -> BatchNormAct2d."""
    conv = nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False)
    if norm_act:
        return nn.Sequential(conv, BatchNormAct2d(cout, act))
    layers = [conv, nn.BatchNorm2d(cout)]
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

    def __init__(
        self, cin, cout, k, stride, expand, act, se_ratio=0.0, se_act=nn.SiLU, se_gate=nn.Sigmoid, norm_act=False
    ):
        super().__init__()
        mid = cin * expand
        layers = [conv_bn(cin, mid, 1, act=act, norm_act=norm_act)] if expand != 1 else []
        layers.append(conv_bn(mid, mid, k, stride, groups=mid, act=act, norm_act=norm_act))
        if se_ratio > 0:
            layers.append(SqueezeExcite(mid, max(1, int(cin * se_ratio)), se_act, se_gate))
        layers.append(conv_bn(mid, cout, 1, act=None, norm_act=norm_act))
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


def _head(cin: int, width: int, act: type, classes: int, norm_act: bool) -> list[nn.Module]:
    head = conv_bn(cin, width, 1, act=act, norm_act=norm_act)
    return [head, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)]


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


def mobilenet(scale: float = 1.0, classes: int = 10, norm_act: bool = False) -> nn.Module:
    """MobileNetV3-small's layout: (kernel, expansion, out, SE, hardswish, stride) per block. 34 BN layers
    (``norm_act``: :class:`BatchNormAct2d` layers, as timm builds it)."""

    def c(n: int) -> int:
        return max(8, int(n * scale + 4) // 8 * 8)

    blocks = [
        (3, 1, 16, True, False, 2), (3, 4, 24, False, False, 2), (3, 4, 24, False, False, 1),
        (5, 4, 40, True, True, 2), (5, 6, 40, True, True, 1), (5, 6, 40, True, True, 1),
        (5, 3, 48, True, True, 1), (5, 3, 48, True, True, 1), (5, 6, 96, True, True, 2),
        (5, 6, 96, True, True, 1), (5, 6, 96, True, True, 1),
    ]  # fmt: skip
    layers: list[nn.Module] = [conv_bn(3, c(16), 3, 2, act=nn.Hardswish, norm_act=norm_act)]
    cin = c(16)
    for k, expand, out, se, hs, stride in blocks:
        act = nn.Hardswish if hs else nn.ReLU
        se_ratio = 0.25 if se else 0.0
        layers.append(
            InvertedResidual(cin, c(out), k, stride, expand, act, se_ratio, nn.ReLU, nn.Hardsigmoid, norm_act)
        )
        cin = c(out)
    return nn.Sequential(*layers, *_head(cin, c(576), nn.Hardswish, classes, norm_act))


def efficientnet(scale: float = 1.0, classes: int = 10, norm_act: bool = False) -> nn.Module:
    """EfficientNet-B0's layout: MBConv blocks with SiLU and squeeze-excitation (ratio 0.25). 49 BN layers
    (``norm_act``: :class:`BatchNormAct2d` layers, as timm builds it)."""

    def c(n: int) -> int:
        return max(8, int(n * scale + 4) // 8 * 8)

    stages = [(1, 3, 16, 1, 1), (6, 3, 24, 2, 2), (6, 5, 40, 2, 2), (6, 3, 80, 2, 3), (6, 5, 112, 1, 3),
              (6, 5, 192, 2, 4), (6, 3, 320, 1, 1)]  # (expansion, kernel, out, stride, repeats)  # fmt: skip
    layers: list[nn.Module] = [conv_bn(3, c(32), 3, 2, act=nn.SiLU, norm_act=norm_act)]
    cin = c(32)
    for expand, k, out, stride, repeats in stages:
        for i in range(repeats):
            block = InvertedResidual(cin, c(out), k, stride if i == 0 else 1, expand, nn.SiLU, 0.25, norm_act=norm_act)
            layers.append(block)
            cin = c(out)
    return nn.Sequential(*layers, *_head(cin, c(1280), nn.SiLU, classes, norm_act))


def build(name: str, small: bool = False) -> nn.Module:
    """The network ``name`` (one of :data:`NETS`), with plain BatchNorm layers; ``small``: the CI size (ResNet at
    half width)."""
    if name not in NETS:
        raise ValueError(f"cpu_nets.build: name must be one of {', '.join(NETS)}, got {name!r}")
    layout, _, form = name.partition("_")
    if layout == "resnet":
        return resnet(32 if small else 64)
    return (mobilenet if layout == "mobilenet" else efficientnet)(norm_act=form == "timm")


def converted(name: str, model: nn.Module) -> nn.Module:
    """``model`` (network ``name``) with tritonbn layers: ``tritonbn.convert_sync_batchnorm``, after
    ``tritonbn.fuse_batchnorm_activations`` for the ``_fx`` networks. ``model`` itself is left as it is only by the
    fuser: pass a copy."""
    import tritonbn

    if name.endswith("_fx"):
        model, _ = tritonbn.fuse_batchnorm_activations(model)
    return tritonbn.convert_sync_batchnorm(model)


def input_size(name: str, small: bool = False) -> int:
    """The image side each network is timed at: ResNet and EfficientNet 64, MobileNet 96 (``small``: 32, 64, 32)."""
    if name.startswith("mobilenet"):
        return 64 if small else 96
    return 32 if small else 64
