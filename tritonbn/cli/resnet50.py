"""ResNet-50 without torchvision: the same layers, shapes and initialization as ``torchvision.models.resnet50``.

torchvision's v1.5 layout: the stride of a bottleneck sits on its 3x3 conv, and every block's BatchNorm
is a ``norm_layer`` (53 in all, at 12 distinct input shapes). ``width`` scales every channel count, so
a tiny copy (``width=4``) runs on CPU in the smoke tests. ``tritonbn bench --model resnet50`` builds it.

    model = resnet50()                            # 25,557,032 parameters, as torchvision's
    shapes = bn_input_shapes(model, (32, 3, 224, 224))  # [(N, C, H, W)] of all 53 BatchNorms, in order
"""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: nn.Module | None, norm_layer) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = norm_layer(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = norm_layer(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = norm_layer(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet50(nn.Module):
    """torchvision's ResNet-50; ``norm_layer(num_features)`` builds every BatchNorm."""

    def __init__(self, num_classes: int = 1000, width: int = 64, norm_layer=nn.BatchNorm2d) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._layer(width, 3, 1, norm_layer)
        self.layer2 = self._layer(width * 2, 4, 2, norm_layer)
        self.layer3 = self._layer(width * 4, 6, 2, norm_layer)
        self.layer4 = self._layer(width * 8, 3, 2, norm_layer)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)
        for m in self.modules():  # torchvision's initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _layer(self, planes: int, blocks: int, stride: int, norm_layer) -> nn.Sequential:
        out = planes * Bottleneck.expansion
        downsample = None
        if stride != 1 or self.inplanes != out:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, out, 1, stride=stride, bias=False), norm_layer(out))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample, norm_layer)]
        self.inplanes = out
        layers += [Bottleneck(out, planes, 1, None, norm_layer) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000, width: int = 64, norm_layer=nn.BatchNorm2d) -> ResNet50:
    return ResNet50(num_classes, width, norm_layer)


def bn_input_shapes(model: nn.Module | None = None, input_shape=(32, 3, 224, 224)) -> list[tuple[int, ...]]:
    """The input shape of every BatchNorm of ``model`` (default: ResNet-50) in call order, from a meta forward."""
    model = resnet50() if model is None else model
    with torch.device("meta"):
        meta = resnet50(width=model.conv1.out_channels) if isinstance(model, ResNet50) else model.to("meta")
    shapes: list[tuple[int, ...]] = []
    hooks = [
        m.register_forward_hook(lambda _m, inputs, _out: shapes.append(tuple(inputs[0].shape)))
        for m in meta.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    try:
        with torch.no_grad():
            meta(torch.empty(input_shape, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return shapes


def distinct_bn_shapes(batch: int = 32, image: int = 224) -> list[tuple[tuple[int, ...], int]]:
    """``[(shape, how many of ResNet-50's BatchNorms have it)]``, in order of first use."""
    counts: dict[tuple[int, ...], int] = {}
    for shape in bn_input_shapes(None, (batch, 3, image, image)):
        counts[shape] = counts.get(shape, 0) + 1
    return list(counts.items())
