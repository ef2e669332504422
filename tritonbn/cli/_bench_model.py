"""The models ``tritonbn bench`` times (built in, or ``MODULE:CALLABLE``) and the BatchNorm inputs they produce:
one :class:`Shape` per distinct input, with its layout, recorded by forward hooks (:mod:`tritonbn.cli.bench`)."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _demo_cnn() -> nn.Module:
    from tritonbn.cli.demo import make_model

    return make_model()


def _resnet50() -> nn.Module:
    from tritonbn.cli.resnet50 import resnet50

    return resnet50()


# name -> (builder, default input on a GPU, default input on CPU)
BUILTIN = {
    "resnet50": (_resnet50, (32, 3, 224, 224), (2, 3, 32, 32)),
    "demo": (_demo_cnn, (8, 3, 12, 12), (8, 3, 12, 12)),
}


def build_model(spec: str) -> tuple[nn.Module, tuple[int, ...] | None, tuple[int, ...] | None]:
    """``(model, default GPU input, default CPU input)`` for a built-in name or ``MODULE:CALLABLE``."""
    if spec in BUILTIN:
        builder, gpu_input, cpu_input = BUILTIN[spec]
        return builder(), gpu_input, cpu_input
    if ":" not in spec:
        raise ValueError(f"--model must be MODULE:CALLABLE or one of {', '.join(BUILTIN)}, got {spec!r}")
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model {spec}: cannot import module {module_name!r} ({e})") from e
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--model {spec}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    model = target() if callable(target) and not isinstance(target, nn.Module) else target
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec}: calling {attr} gave {type(model).__name__}, expected a torch.nn.Module")
    return model, None, None


def parse_input(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.replace("x", ",").split(",") if v.strip())
    except ValueError:
        shape = ()
    if len(shape) < 2 or any(d < 1 for d in shape):
        raise ValueError(f"--input must be a positive shape such as 32,3,224,224, got {text!r}")
    return shape


def layout_name(shape, stride) -> str:
    t = torch.empty_strided(shape, stride, device="meta")
    if t.is_contiguous():
        return "contiguous"
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "strided"


@dataclass
class Shape:
    """One distinct BatchNorm input of the model, and where it occurs."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    layers: set = field(default_factory=set)
    calls: int = 0

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape))

    @property
    def layout(self) -> str:
        return layout_name(self.shape, self.stride)


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def record_shapes(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> list[Shape]:
    """Every BatchNorm input of one training forward of ``model(x)``, grouped by (shape, strides, dtype)."""
    found: dict[tuple, Shape] = {}

    def hook(name):
        def record(_module, inputs):
            t = inputs[0]
            key = (tuple(t.shape), tuple(t.stride()), t.dtype)
            entry = found.setdefault(key, Shape(*key))
            entry.layers.add(name)
            entry.calls += 1

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if not handles:
        raise ValueError("the model has no BatchNorm layer (nn.BatchNorm*d, nn.SyncBatchNorm or tritonbn's)")
    model.train()
    try:
        with torch.no_grad(), _autocast(x.device, dtype):
            model(x)
    finally:
        for h in handles:
            h.remove()
    return list(found.values())
