"""``tritonbn.SyncBatchNorm`` and the one-call conversions to and from it."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from tritonbn.activations import check_activation
from tritonbn.distributed import resolve_group
from tritonbn.functional import batch_norm, check_inputs, check_momentum

_ORIGINAL = "_tritonbn_original_class"
_PLAIN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the global batch of ``process_group``, for inputs ``(N, C, *S)`` of rank 2 to 5.

    Same constructor, parameters, buffers and ``state_dict`` keys as ``torch.nn.SyncBatchNorm``.
    Training synchronizes the statistics with one all-reduce per pass; eval uses the running
    statistics (or, with ``track_running_stats=False``, this rank's batch) and communicates nothing.

    ``activation`` (``None``, ``"relu"``, ``"leaky_relu"`` with ``negative_slope``, ``"silu"``) and
    ``forward(input, residual)`` fuse ``act(bn(input) + residual)`` into the kernels.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        device=None,
        dtype=None,
        activation: str | None = None,
        negative_slope: float = 0.01,
    ) -> None:
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        check_momentum(momentum)
        check_activation(activation, negative_slope)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group
        self.activation = activation
        self.negative_slope = negative_slope

    def _check_input_dim(self, input: torch.Tensor) -> None:
        """torch's BatchNorm hook; forward runs the same checks (and more) itself."""
        check_inputs(input, None, None, None, None, self.momentum, self.eps, num_features=self.num_features)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.activation is not None:
            text += f", activation={self.activation!r}"
            if self.activation == "leaky_relu":
                text += f", negative_slope={self.negative_slope}"
        return text

    def _state(self):
        """``(weight, bias, running_mean, running_var, num_batches_tracked)``.

        Read from the parameter and buffer dicts, without a ``Module.__getattr__`` call each (a per-call
        host cost, see ``benchmarks/host_overhead.py``), unless something (a parametrization, weight
        norm) has moved one of them out.
        """
        params, buffers = self._parameters, self._buffers
        try:
            return (params["weight"], params["bias"], buffers["running_mean"], buffers["running_var"],
                    buffers["num_batches_tracked"])  # fmt: skip
        except KeyError:
            return self.weight, self.bias, self.running_mean, self.running_var, self.num_batches_tracked

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        training = self.training
        weight, bias, running_mean, running_var, num_batches_tracked = self._state()
        bn_training = training or (running_mean is None and running_var is None)
        tracking = not training or self.track_running_stats
        # Eval communicates nothing (with track_running_stats=False it uses this rank's own batch).
        group = resolve_group(self.process_group)
        return batch_norm(
            input,
            running_mean if tracking else None,
            running_var if tracking else None,
            weight,
            bias,
            bn_training,
            self.momentum,
            self.eps,
            group if training else None,
            num_batches_tracked if (training and self.track_running_stats) else None,
            residual=residual,
            activation=self.activation,
            negative_slope=self.negative_slope,
            num_features=self.num_features,
            debug_group=group,
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """Same as :func:`tritonbn.convert_sync_batchnorm`."""
        return convert_sync_batchnorm(module, process_group)


def _move_state(src: _BatchNorm, dst: _BatchNorm) -> _BatchNorm:
    """Give ``dst`` the very parameters and buffers of ``src``, and its mode."""
    if src.affine:
        dst.weight = src.weight
        dst.bias = src.bias
    if src.track_running_stats:
        dst.running_mean = src.running_mean
        dst.running_var = src.running_var
        dst.num_batches_tracked = src.num_batches_tracked
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig
    return dst


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` in ``module`` by :class:`SyncBatchNorm`.

    The new modules share the original parameters and buffers (so device, dtype,
    ``requires_grad`` and optimizer references are kept) and the training mode, and remember the
    original class for :func:`revert_sync_batchnorm`. Other norms are left alone. Returns the
    converted module (``module`` itself, changed in place, unless ``module`` is a batch norm).
    """
    out = module
    if isinstance(module, _PLAIN) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            device="meta",
        )
        _move_state(module, out)
        setattr(out, _ORIGINAL, type(module))
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out


def revert_sync_batchnorm(module: nn.Module, default: type[_BatchNorm] = nn.BatchNorm2d) -> nn.Module:
    """Replace every :class:`SyncBatchNorm` in ``module`` by the class it was converted from.

    A module built directly as ``tritonbn.SyncBatchNorm`` (no original class recorded) becomes
    ``default``. Parameters, buffers and training mode are shared, as in the conversion. A module
    with a fused activation has no plain equivalent: reverting it raises a ``ValueError``.
    """
    out = module
    if isinstance(module, SyncBatchNorm):
        if module.activation is not None:
            raise ValueError(
                f"cannot revert a SyncBatchNorm with a fused activation ({module.activation!r}) to a plain BatchNorm; "
                "rebuild the model without fusion first"
            )
        cls = getattr(module, _ORIGINAL, default)
        kwargs = {"process_group": module.process_group} if issubclass(cls, nn.SyncBatchNorm) else {}
        out = cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            device="meta",
            **kwargs,
        )
        _move_state(module, out)
    for name, child in module.named_children():
        out.add_module(name, revert_sync_batchnorm(child, default))
    return out
