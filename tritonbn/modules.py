"""``tritonbn.SyncBatchNorm``: the module, about its call (the conversions are in :mod:`tritonbn.convert`)."""

from __future__ import annotations

import itertools

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from tritonbn._checks import check_inputs, check_momentum, mask_from_lengths
from tritonbn._export import script_error
from tritonbn._passes import Layer
from tritonbn.activations import check_activation
from tritonbn.distributed import resolve_group, world
from tritonbn.functional import run

_LAYER = "_tritonbn_layer"  # the layer's identity in TRITONBN_DEBUG=1 checks
ACCUMULATOR = "_tritonbn_accumulator"  # set by tritonbn.accumulate_stats (tritonbn/running_stats.py)
_CALL = "_tritonbn_call"  # the module's _passes.Layer, dropped when one of _SETTINGS changes
_SETTINGS = frozenset(
    ("training", "momentum", "eps", "activation", "negative_slope", "process_group", "track_running_stats", _LAYER)
)
_built = itertools.count()


def name_layers(root: nn.Module) -> None:
    """Record the qualified name in ``root`` of each :class:`SyncBatchNorm` in it, as its debug-mode identity.

    :func:`convert_sync_batchnorm` calls this; a later call (a conversion of an enclosing model)
    renames the layers relative to the new root. ``root`` itself, having no name in itself, keeps
    its construction index.
    """
    for name, module in root.named_modules():
        if name and isinstance(module, SyncBatchNorm):
            setattr(module, _LAYER, name)


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the global batch of ``process_group``, for inputs ``(N, C, *S)`` of rank 2 to 5.

    Same constructor, parameters, buffers and ``state_dict`` keys as ``torch.nn.SyncBatchNorm``
    (``bias=False`` with ``affine=True``: a weight without a bias).
    Training synchronizes the statistics with one all-reduce per pass; eval uses the running
    statistics (or, with ``track_running_stats=False``, this rank's batch) and communicates nothing.

    ``activation`` (``None``, ``"relu"``, ``"leaky_relu"`` with ``negative_slope``, ``"silu"``) and
    ``forward(input, residual)`` fuse ``act(bn(input) + residual)`` into the kernels.

    ``forward(input, mask=mask)`` is masked batch norm, for padded batches: ``mask``, a bool tensor of
    shape ``(N, *S)``, marks the real positions; statistics and running statistics cover those only, and
    the output and its gradients are 0 at the others. ``lengths=`` (``(N,)`` integers) builds the mask of
    an ``(N, C, L)`` input. See :func:`tritonbn.sync_batch_norm`.

    With ``TRITONBN_DEBUG=1`` each call is identified across ranks by a per-group call counter and
    the layer's identity: its qualified name, such as ``"layer1.0.bn1"``, recorded by
    :func:`convert_sync_batchnorm` (which also names modules built directly inside the model it
    converts), or else its construction index in this process, such as ``"SyncBatchNorm#3"``. Both
    are the same on every rank when every rank runs the same code; names also survive a rank
    building extra modules (an EMA copy, a second model), which shifts construction indices.

    Under ``torch.fx`` (any tracer) the module is a leaf: one ``call_module`` node.
    """

    # Set on the instance inside tritonbn.accumulate_stats. A plain attribute read, which dynamo guards.
    _tritonbn_accumulator = None

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
        *,
        bias: bool = True,
        activation: str | None = None,
        negative_slope: float = 0.01,
    ) -> None:
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        check_momentum(momentum)
        check_activation(activation, negative_slope)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        if affine and not bias:  # torch's bias=False: a weight without a bias (any torch version)
            self.register_parameter("bias", None)
        self.process_group = process_group
        self.activation = activation
        self.negative_slope = negative_slope
        setattr(self, _LAYER, f"SyncBatchNorm#{next(_built)}")

    def _check_input_dim(self, input: torch.Tensor) -> None:
        """torch's BatchNorm hook; forward runs the same checks (and more) itself."""
        check_inputs(input, None, None, None, None, self.momentum, self.eps, training=self.training,
                     num_features=self.num_features)  # fmt: skip

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

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                lengths=None) -> torch.Tensor:  # fmt: skip
        if type(input) is not torch.Tensor or (residual is not None and type(residual) is not torch.Tensor):
            traced = trace_as_leaf(self, input, residual, mask=mask, lengths=lengths)  # a Proxy: under torch.fx
            if traced is not None:
                return traced
        if lengths is not None:
            mask = mask_from_lengths(input, lengths, mask)
        return self._normalize(input, residual) if mask is None else self._normalize(input, residual, mask)

    def __prepare_scriptable__(self):  # torch.jit.script's hook: a clear error (tritonbn/_export.py)
        raise script_error(self)

    def _normalize(self, input: torch.Tensor, residual: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The batch norm with its fused epilogue (what subclasses and recalibration build on)."""
        layer = self.__dict__.get(_CALL)
        if layer is None or layer.world is not world():
            layer = self._layer()
        weight, bias, running_mean, running_var, num_batches_tracked = self._state()
        if layer.training:
            if not self.track_running_stats:
                running_mean = running_var = num_batches_tracked = None
        elif running_mean is None and running_var is None:
            # Eval without running statistics normalizes with this rank's own batch, as torch does.
            layer = self._layer(batch_stats=True)
            num_batches_tracked = None
        else:
            num_batches_tracked = None
        # Inside tritonbn.accumulate_stats: where this call's global sums go instead of the running stats.
        accumulator = self._tritonbn_accumulator
        sink = accumulator(input) if accumulator is not None and self.training else None
        return run(layer, input, weight, bias, running_mean, running_var, num_batches_tracked, residual,
                   self.num_features, sink, mask)  # fmt: skip

    def _layer(self, batch_stats: bool = False) -> Layer:
        """This layer's :class:`~tritonbn._passes.Layer`, kept until a setting in ``_SETTINGS`` changes.

        ``batch_stats``: the layer of an eval call that normalizes with the batch's statistics
        (no running statistics), made for that call.
        """
        group = resolve_group(self.process_group)
        layer = Layer(self.training or batch_stats, self.momentum, self.eps, self.activation, self.negative_slope,
                      group if self.training else None, group, getattr(self, _LAYER, ""), world())  # fmt: skip
        if not batch_stats:
            self.__dict__[_CALL] = layer
        return layer

    def __setattr__(self, name: str, value) -> None:
        if name in _SETTINGS:
            self.__dict__.pop(_CALL, None)
        super().__setattr__(name, value)

    @classmethod
    def convert_sync_batchnorm(
        cls, module: nn.Module, process_group=None, *, group_size: int | None = None, strict: bool = False
    ) -> nn.Module:
        """Same as :func:`tritonbn.convert_sync_batchnorm`."""
        from tritonbn.convert import convert_sync_batchnorm

        return convert_sync_batchnorm(module, process_group, group_size=group_size, strict=strict)


class SyncBatchNormAct(SyncBatchNorm):
    """:class:`SyncBatchNorm` followed by its children ``drop`` and ``act``: ``act(drop(bn(x)))``.

    What timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` become when their ``act`` or ``drop`` is
    not one the kernels fuse (the same children, so the same ``state_dict``).
    """

    def __init__(self, *args, drop: nn.Module | None = None, act: nn.Module | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()

    def forward(self, input: torch.Tensor, *, mask: torch.Tensor | None = None, lengths=None) -> torch.Tensor:
        traced = trace_as_leaf(self, input, mask=mask, lengths=lengths)
        if traced is not None:
            return traced
        if lengths is not None:
            mask = mask_from_lengths(input, lengths, mask)
        y = self.act(self.drop(self._normalize(input) if mask is None else self._normalize(input, None, mask)))
        return y if mask is None else y.masked_fill(~mask.unsqueeze(1), 0)  # 0 after any activation too


def trace_as_leaf(module: nn.Module, *args, **kwargs) -> fx.Proxy | None:
    """Under ``torch.fx``, record ``module(*args, **kwargs)`` as one ``call_module`` node and return its proxy.

    fx's default tracer only keeps ``torch.nn`` modules whole; any other tracer (a subclass with its
    own ``is_leaf_module``, such as torchvision's feature extractor) calls ``forward`` with proxies.
    Returns ``None`` outside tracing. Trailing ``None`` arguments and ``None`` keywords are left out of the node.
    """
    for proxy in args:  # a plain loop, not next(<genexpr>): torch 2.8's compiler cannot trace ``next``
        if isinstance(proxy, fx.Proxy):
            break
    else:
        return None
    while args and args[-1] is None:
        args = args[:-1]
    tracer = proxy.tracer
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return tracer.create_proxy("call_module", tracer.path_of_module(module), args, kwargs)
