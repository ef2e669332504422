"""Stand-ins for timm 1.0's BatchNorm + activation layers and an EfficientNet block built from them.

timm cannot be installed next to the CPU torch here (it imports torchvision, whose wheel is a CUDA
build), so these mirror ``timm/layers/norm_act.py`` in structure and behaviour: ``BatchNormAct2d``
is a ``BatchNorm2d`` subclass with children ``drop`` and ``act`` applied after ``F.batch_norm``,
``SyncBatchNormAct`` an ``nn.SyncBatchNorm`` subclass that does the same, and ``timm_convert``
what ``timm.layers.convert_sync_batchnorm`` does (also under that name, which timm's train script imports).
tritonbn must recognise them by structure alone. ``freeze_batch_norm_2d`` is timm's, by the classes it tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _create_act(act_layer, act_kwargs=None, inplace=False, apply_act=True):
    act_kwargs = dict(act_kwargs or {})
    if act_layer is not None and apply_act:
        if inplace:
            act_kwargs["inplace"] = inplace
        return act_layer(**act_kwargs)
    return nn.Identity()


class BatchNormAct2d(nn.BatchNorm2d):
    """timm 1.0's ``BatchNormAct2d``: ``act(drop(batch_norm(x)))``, weights compatible with a plain BN."""

    def __init__(
        self,
        num_features,
        eps=1e-5,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
        apply_act=True,
        act_layer=nn.ReLU,
        act_kwargs=None,
        inplace=True,
        drop_layer=None,
        device=None,
        dtype=None,
    ):
        super().__init__(
            num_features,
            eps=eps,
            momentum=momentum,
            affine=affine,
            track_running_stats=track_running_stats,
            device=device,
            dtype=dtype,
        )
        self.drop = drop_layer() if drop_layer is not None else nn.Identity()
        self.act = _create_act(act_layer, act_kwargs=act_kwargs, inplace=inplace, apply_act=apply_act)

    def forward(self, x):
        # timm's copy of BatchNorm2d.forward, then drop and act
        torch._assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")
        if self.momentum is None:
            exponential_average_factor = 0.0
        else:
            exponential_average_factor = self.momentum
        if self.training and self.track_running_stats:
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:
                    exponential_average_factor = 1.0 / float(self.num_batches_tracked)
                else:
                    exponential_average_factor = self.momentum
        if self.training:
            bn_training = True
        else:
            bn_training = (self.running_mean is None) and (self.running_var is None)
        x = F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            bn_training,
            exponential_average_factor,
            self.eps,
        )
        x = self.drop(x)
        x = self.act(x)
        return x


class SyncBatchNormAct(nn.SyncBatchNorm):
    """timm 1.0's ``SyncBatchNormAct``: made only by ``timm_convert``, which sets ``drop`` and ``act``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        if hasattr(self, "drop"):
            x = self.drop(x)
        if hasattr(self, "act"):
            x = self.act(x)
        return x


def timm_convert(module, process_group=None):
    """timm's ``convert_sync_batchnorm``: BatchNormAct2d -> SyncBatchNormAct, BatchNorm -> nn.SyncBatchNorm."""
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        if isinstance(module, BatchNormAct2d):
            out = SyncBatchNormAct(module.num_features, module.eps, module.momentum, module.affine,
                                   module.track_running_stats, process_group=process_group)  # fmt: skip
            out.act = module.act
            out.drop = module.drop
        else:
            out = nn.SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                   module.track_running_stats, process_group)  # fmt: skip
        if module.affine:
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
    for name, child in module.named_children():
        out.add_module(name, timm_convert(child, process_group))
    return out


class DropBlockish(nn.Module):
    """A ``drop`` layer tritonbn does not fuse: scales the channels (deterministic, so outputs compare)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        return x * self.scale[: x.shape[1]].view(1, -1, 1, 1)


class SqueezeExcite(nn.Module):
    """timm's efficientnet ``SqueezeExcite``."""

    def __init__(self, in_chs, rd_chs):
        super().__init__()
        self.conv_reduce = nn.Conv2d(in_chs, rd_chs, 1, bias=True)
        self.act1 = nn.SiLU(inplace=True)
        self.conv_expand = nn.Conv2d(rd_chs, in_chs, 1, bias=True)
        self.gate = nn.Sigmoid()

    def forward(self, x):
        x_se = x.mean((2, 3), keepdim=True)
        x_se = self.conv_reduce(x_se)
        x_se = self.act1(x_se)
        x_se = self.conv_expand(x_se)
        return x * self.gate(x_se)


class InvertedResidual(nn.Module):
    """timm's efficientnet ``InvertedResidual`` (MBConv): BatchNormAct2d layers with SiLU, and without act."""

    def __init__(self, chs=5, mid=6, act_layer=nn.SiLU, drop_layer=None):
        super().__init__()
        self.conv_pw = nn.Conv2d(chs, mid, 1, bias=False)
        self.bn1 = BatchNormAct2d(mid, act_layer=act_layer, drop_layer=drop_layer)
        self.conv_dw = nn.Conv2d(mid, mid, 3, padding=1, groups=mid, bias=False)
        self.bn2 = BatchNormAct2d(mid, act_layer=act_layer)
        self.aa = nn.Identity()
        self.se = SqueezeExcite(mid, 2)
        self.conv_pwl = nn.Conv2d(mid, chs, 1, bias=False)
        self.bn3 = BatchNormAct2d(chs, apply_act=False)
        self.drop_path = nn.Identity()

    def forward(self, x):
        shortcut = x
        x = self.conv_pw(x)
        x = self.bn1(x)
        x = self.conv_dw(x)
        x = self.bn2(x)
        x = self.aa(x)
        x = self.se(x)
        x = self.conv_pwl(x)
        x = self.bn3(x)
        x = self.drop_path(x) + shortcut
        return x


class EfficientNetish(nn.Module):
    """A timm-structured EfficientNet: stem conv + BatchNormAct2d(SiLU), MBConv blocks, head, pooling."""

    def __init__(self, blocks=None):
        super().__init__()
        self.conv_stem = nn.Conv2d(3, 5, 3, stride=2, padding=1, bias=False)
        self.bn1 = BatchNormAct2d(5, act_layer=nn.SiLU)
        self.blocks = nn.Sequential(*(blocks if blocks is not None else [InvertedResidual(), InvertedResidual()]))
        self.conv_head = nn.Conv2d(5, 6, 1, bias=False)
        self.bn2 = BatchNormAct2d(6, act_layer=nn.SiLU)
        self.classifier = nn.Linear(6, 3)

    def forward(self, x):
        x = self.bn1(self.conv_stem(x))
        x = self.blocks(x)
        x = self.bn2(self.conv_head(x))
        return self.classifier(x.mean((2, 3)))


class FrozenBatchNorm2d(nn.Module):
    """torchvision's ``FrozenBatchNorm2d`` (what timm freezes into): buffers only, ``x * scale + shift``."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        for name, fill in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((num_features,), fill))

    def forward(self, x):
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)


class FrozenBatchNormAct2d(FrozenBatchNorm2d):
    """timm's ``FrozenBatchNormAct2d``: the frozen normalization, then ``drop`` and ``act``."""

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


def freeze_batch_norm_2d(module):
    """timm 1.0's ``timm.layers.freeze_batch_norm_2d``, by the classes it tests with ``isinstance``: timm's
    ``(BatchNormAct2d, SyncBatchNormAct)`` become a ``FrozenBatchNormAct2d`` with their ``drop`` and ``act``, then
    ``(torch.nn.BatchNorm2d, torch.nn.SyncBatchNorm)`` a ``FrozenBatchNorm2d``; any other module is searched."""
    if isinstance(module, (BatchNormAct2d, SyncBatchNormAct, nn.BatchNorm2d, nn.SyncBatchNorm)):
        act = isinstance(module, (BatchNormAct2d, SyncBatchNormAct))
        frozen = (FrozenBatchNormAct2d if act else FrozenBatchNorm2d)(module.num_features, module.eps)
        frozen = frozen.to(module.running_mean.dtype)
        if module.affine:
            frozen.weight.copy_(module.weight.detach())
            frozen.bias.copy_(module.bias.detach())
        frozen.running_mean, frozen.running_var = module.running_mean, module.running_var
        if act:
            frozen.drop, frozen.act = module.drop, module.act
        return frozen
    for name, child in module.named_children():
        new = freeze_batch_norm_2d(child)
        if new is not child:
            module.add_module(name, new)
    return module


convert_sync_batchnorm = timm_convert  # the name timm's train script imports from timm.layers
