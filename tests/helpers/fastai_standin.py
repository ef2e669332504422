"""A stand-in for what fastai 2.8 does with BatchNorms, found by class, and for its distributed switch.

fastai cannot be installed next to the CPU torch here: it requires torchvision (whose wheel is a CUDA build),
spacy, scikit-learn and pandas, and its ``distrib_ctx`` needs accelerate. What it checks is small, and is written
again here from reading fastai 2.8.12 (the names in brackets are fastai's):

- ``NORM_TYPES`` [``fastai.torch_core.norm_types``]: ``nn.BatchNorm1d/2d/3d``, ``nn.InstanceNorm1d/2d/3d`` and
  ``nn.LayerNorm``. [``norm_bias_params(m, with_bias)``] returns all parameters of a module that is an instance of
  one of them, and otherwise recurses into the children and, with ``with_bias``, adds the module's own ``bias``.
- [``Learner.create_opt``], defaults ``wd_bn_bias=False`` and ``train_bn=True``: the parameters of
  ``norm_bias_params(model, True)`` get no weight decay (``do_wd=False``); those of ``norm_bias_params(model,
  False)`` keep training in frozen groups (``force_train=True``).
- [``_BaseOptimizer.freeze_to``] (``Learner.freeze`` freezes all groups but the last): a parameter of a frozen
  group gets ``requires_grad`` only if ``force_train``. [``weight_decay``] (fastai's Adam and SGD decouple it by
  default): ``p *= 1 - lr * wd`` where ``do_wd``.
- ``BN_TYPES`` [``fastai.callback.training.bn_types``]: ``nn.BatchNorm1d/2d/3d``. [``set_bn_eval``], which the
  ``BnFreeze`` callback calls before each training epoch, after the model's ``train()``: every descendant that is
  an instance of one of them and whose first parameter does not require grad goes to eval mode.
- [``DistributedTrainer.before_fit``], which ``distrib_ctx()`` installs with ``sync_bn=True``: the model becomes
  ``nn.SyncBatchNorm.convert_sync_batchnorm(model)``, wrapped in DDP (by accelerate).
"""

from __future__ import annotations

import torch
from torch import nn

NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d,
              nn.InstanceNorm3d, nn.LayerNorm)  # fmt: skip
BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def norm_bias_params(module: nn.Module, with_bias: bool = True) -> list[nn.Parameter]:
    if isinstance(module, NORM_TYPES):
        return list(module.parameters())
    found = [p for child in module.children() for p in norm_bias_params(child, with_bias)]
    if with_bias and getattr(module, "bias", None) is not None:
        found.append(module.bias)
    return found


def set_bn_eval(module: nn.Module) -> None:
    for child in module.children():
        if isinstance(child, BN_TYPES) and not next(child.parameters()).requires_grad:
            child.eval()
        set_bn_eval(child)


class Learner:
    """Parameter groups (the splitter's), SGD with decoupled weight decay, ``freeze`` and ``BnFreeze``."""

    def __init__(self, model: nn.Module, groups: list[list[nn.Parameter]], lr: float, wd: float,
                 wd_bn_bias: bool = False, train_bn: bool = True, bn_freeze: bool = False) -> None:  # fmt: skip
        self.model, self.groups, self.lr, self.wd, self.bn_freeze = model, groups, lr, wd, bn_freeze
        no_wd = set() if wd_bn_bias else {id(p) for p in norm_bias_params(model, True)}
        force = {id(p) for p in norm_bias_params(model, False)} if train_bn else set()
        self.state = {id(p): {"do_wd": id(p) not in no_wd, "force_train": id(p) in force} for g in groups for p in g}

    def freeze(self) -> None:
        for group in self.groups[:-1]:
            for p in group:
                p.requires_grad_(self.state[id(p)]["force_train"])

    def fit(self, batches, loss_fn) -> None:
        for x, y in batches:  # one batch per epoch: the callbacks' order each time
            self.model.train()
            if self.bn_freeze:
                set_bn_eval(self.model)
            for p in self.model.parameters():
                p.grad = None
            loss_fn(self.model(x), y).backward()
            with torch.no_grad():
                for p in (p for g in self.groups for p in g):
                    if p.grad is None:
                        continue
                    if self.state[id(p)]["do_wd"]:
                        p.mul_(1 - self.lr * self.wd)
                    p.sub_(self.lr * p.grad)


def distributed_model(model: nn.Module) -> nn.Module:
    """What ``distrib_ctx()`` (``sync_bn=True``) makes of the model before fitting, accelerate's DDP included."""
    return nn.parallel.DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model))
