"""``tritonbn.SyncBatchNorm``, and the conversions beside it (as torch keeps its ``convert_sync_batchnorm``).

:func:`convert_sync_batchnorm` replaces ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm``, sharing their
parameters and buffers, and never changes what a layer computes. timm's ``BatchNormAct2d`` is recognized by
structure (:mod:`tritonbn._norm_layers`; timm is not imported) and keeps its activation, fused into the kernels
where they can compute it. :func:`revert_sync_batchnorm` gives every converted layer its original class back.
"""

from __future__ import annotations

import itertools
import warnings

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from tritonbn._core.call import LayerSettings, in_backward, settings_for
from tritonbn._core.checks import check_inputs, check_momentum, mask_from_lengths
from tritonbn._core.dispatch import run
from tritonbn._core.lowering import exported_keywords, script_error
from tritonbn._norm_layers import (
    PLAIN,
    bias_kwargs,
    fused_activation,
    is_timm_norm_act,
    is_tritonbn,
    move_state,
    why_not_converted,
)
from tritonbn.activations import check_activation
from tritonbn.backends.launchers import Operands
from tritonbn.distributed import resolve_group, world
from tritonbn.groups import syncbn_group

NAME = "_tritonbn_name"  # the layer's identity in TRITONBN_DEBUG=1 checks (see SyncBatchNorm)
ACCUMULATOR = "_tritonbn_accumulator"  # set by tritonbn.accumulate_stats (tritonbn/running_stats.py)
_CACHED = "_tritonbn_settings"  # the module's LayerSettings, dropped when one of _SETTING_NAMES changes
_SETTING_NAMES = frozenset(
    ("training", "momentum", "eps", "activation", "negative_slope", "process_group", "track_running_stats", NAME)
)
_ORIGINAL = "_tritonbn_original_class"
_TEMPLATE = "_tritonbn_original_module"  # a converted subclass instance, given back by revert
_built = itertools.count()


def name_layers(root: nn.Module) -> None:
    """Record the qualified name in ``root`` of each :class:`SyncBatchNorm` in it, as its debug-mode identity.

    :func:`convert_sync_batchnorm` calls this; a later call (a conversion of an enclosing model)
    renames the layers relative to the new root. ``root`` itself, having no name in itself, keeps
    its construction index.
    """
    for name, module in root.named_modules():
        if name and isinstance(module, SyncBatchNorm):
            setattr(module, NAME, name)


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
    # Set on the instance inside tritonbn.join (tritonbn/uneven.py): the settings of its training calls there.
    _tritonbn_join = None

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
        setattr(self, NAME, f"SyncBatchNorm#{next(_built)}")

    def _check_input_dim(self, input: torch.Tensor) -> None:
        """torch's BatchNorm hook; forward runs the same checks (and more) itself."""
        check_inputs(Operands(input), self.momentum, self.eps, self.training, self.num_features)

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
            return (
                params["weight"],
                params["bias"],
                buffers["running_mean"],
                buffers["running_var"],
                buffers["num_batches_tracked"],
            )
        except KeyError:
            return self.weight, self.bias, self.running_mean, self.running_var, self.num_batches_tracked

    def forward(
        self,
        input: torch.Tensor,
        residual: torch.Tensor | None = None,
        *exported,
        mask: torch.Tensor | None = None,
        lengths=None,
    ) -> torch.Tensor:
        if exported:  # the legacy ONNX exporter's defaults, passed positionally (see exported_keywords)
            mask, lengths = exported_keywords(self, exported, mask, lengths)
        if type(input) is not torch.Tensor or (residual is not None and type(residual) is not torch.Tensor):
            traced = trace_as_leaf(self, input, residual, mask=mask, lengths=lengths)  # a Proxy: under torch.fx
            if traced is not None:
                return traced
        if lengths is not None:
            mask = mask_from_lengths(input, lengths, mask)
        return self._normalize(input, residual) if mask is None else self._normalize(input, residual, mask)

    def __prepare_scriptable__(self):  # torch.jit.script's hook: a clear error (tritonbn/_core/lowering.py)
        raise script_error(self)

    def _normalize(
        self, input: torch.Tensor, residual: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The batch norm with its fused epilogue (what subclasses and recalibration build on): the layer's settings
        and tensors for this call, then the dispatch (:func:`tritonbn._core.dispatch.run`)."""
        settings = self.__dict__.get(_CACHED)
        if settings is None or settings.world is not world():
            settings = self._settings()
        weight, bias, running_mean, running_var, num_batches_tracked = self._state()
        counted = None  # a count of batches torch keeps without running statistics (see below)
        if settings.batch_stats:
            if not self.track_running_stats:
                running_mean = running_var = num_batches_tracked = None
            elif running_mean is None and running_var is None:
                counted, num_batches_tracked = num_batches_tracked, None
            elif settings.momentum is None and num_batches_tracked is None:  # torch: a factor of 0, nothing moves
                settings = self._settings(momentum=0.0)
            joining = self._tritonbn_join
            if joining is not None and settings.group is not None:  # inside tritonbn.join: its group, its message
                settings = joining(settings)
        elif running_mean is None and running_var is None:
            # Eval without running statistics normalizes with this rank's own batch, as torch does.
            settings = self._settings(batch_stats=True)
            num_batches_tracked = None
        else:
            num_batches_tracked = None
        # Inside tritonbn.accumulate_stats: where this call's global sums go instead of the running stats.
        accumulator = self._tritonbn_accumulator
        sink = accumulator(input) if accumulator is not None and self.training else None
        operands = Operands(input, weight, bias, running_mean, running_var, num_batches_tracked, residual, mask, sink)
        y = run(settings, operands, self.num_features)
        if counted is not None and not in_backward():  # torch counts the batches of a layer whose buffers are None
            counted.add_(1)
        return y

    def _settings(self, batch_stats: bool = False, **changed) -> LayerSettings:
        """This layer's settings, kept until one of ``_SETTING_NAMES`` changes.

        ``batch_stats``: the settings of an eval call that normalizes with the batch's statistics (no running
        statistics), made for that call; ``changed``: one call's other ``momentum``, made for that call.
        """
        group = resolve_group(self.process_group)
        settings = settings_for(
            self.training,
            changed.get("momentum", self.momentum),
            self.eps,
            self.activation,
            self.negative_slope,
            group,
            debug_group=group,
            name=getattr(self, NAME, ""),
            batch_stats=batch_stats,
        )
        if not (batch_stats or changed or torch.compiler.is_compiling()):  # dynamo refuses the write in a checkpoint
            self.__dict__[_CACHED] = settings
        return settings

    def __getstate__(self) -> dict:
        """The module's state for pickle, ``torch.save`` and ``copy.deepcopy``: its ``__dict__`` without the settings
        it keeps between calls (and, in them, the record of its last call and its routes), which a copy builds anew
        at its first call, as a fresh layer does."""
        state = self.__dict__.copy()
        state.pop(_CACHED, None)
        return state

    def _apply(self, fn, *args, **kwargs):
        """torch's ``.to()``, ``.cuda()``, ``.half()``: the parameters keep their identity and change device or dtype,
        so the settings (and the checks they remember, :func:`tritonbn._core.checks.check_eager_call`) go."""
        self.__dict__.pop(_CACHED, None)
        return super()._apply(fn, *args, **kwargs)

    def __setattr__(self, name: str, value) -> None:
        if name in _SETTING_NAMES:
            self.__dict__.pop(_CACHED, None)
        super().__setattr__(name, value)

    @classmethod
    def convert_sync_batchnorm(
        cls, module: nn.Module, process_group=None, *, group_size: int | None = None, strict: bool = False
    ) -> nn.Module:
        """Same as :func:`tritonbn.convert_sync_batchnorm`."""
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

    def forward(self, input: torch.Tensor, *exported, mask: torch.Tensor | None = None, lengths=None) -> torch.Tensor:
        if exported:
            mask, lengths = exported_keywords(self, exported, mask, lengths)
        traced = trace_as_leaf(self, input, mask=mask, lengths=lengths)
        if traced is not None:
            return traced
        if lengths is not None:
            mask = mask_from_lengths(input, lengths, mask)
        y = self.act(self.drop(self._normalize(input) if mask is None else self._normalize(input, None, mask)))
        return y if mask is None else y.masked_fill(~mask.unsqueeze(1), 0)  # 0 after any activation too


class SyncBatchNorm1d(SyncBatchNorm, nn.BatchNorm1d):
    """A converted ``nn.BatchNorm1d``: a :class:`SyncBatchNorm` (its forward and checks first) that is still an
    ``nn.BatchNorm1d``, for the code that finds BatchNorms by class (weight decay, freezing). No state of its own."""


class SyncBatchNorm2d(SyncBatchNorm, nn.BatchNorm2d):
    """A converted ``nn.BatchNorm2d``, still an ``nn.BatchNorm2d`` (see :class:`SyncBatchNorm1d`)."""


class SyncBatchNorm3d(SyncBatchNorm, nn.BatchNorm3d):
    """A converted ``nn.BatchNorm3d``, still an ``nn.BatchNorm3d`` (see :class:`SyncBatchNorm1d`)."""


# A converted layer's class, by the torch class it is an instance of (not nn.SyncBatchNorm's: see docs/limits.md).
KEPT_CLASSES = {nn.BatchNorm1d: SyncBatchNorm1d, nn.BatchNorm2d: SyncBatchNorm2d, nn.BatchNorm3d: SyncBatchNorm3d}
PLAIN_SYNCED = (SyncBatchNorm, *KEPT_CLASSES.values())  # plain batch norm, no epilogue module (not SyncBatchNormAct)


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


# --- conversion of torch's and timm's batch norms, and back ----------------------------------------------


def _rebuilt(cls: type[_BatchNorm], module: _BatchNorm, **kwargs) -> _BatchNorm:
    """A ``cls`` with ``module``'s settings, parameters, buffers and mode."""
    args = (module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
    return move_state(module, cls(*args, device="meta", **bias_kwargs(module), **kwargs))


def _synced(module: _BatchNorm, process_group, cls: type[SyncBatchNorm] = SyncBatchNorm, **kwargs) -> SyncBatchNorm:
    out = _rebuilt(cls, module, process_group=process_group, **kwargs)
    setattr(out, _ORIGINAL, type(module))
    if type(module) not in PLAIN:  # a subclass: revert gives this very module back, with the current state
        object.__setattr__(out, _TEMPLATE, module)
    return out


def _converted(module: _BatchNorm, process_group) -> SyncBatchNorm:
    """The tritonbn module computing what ``module`` computes (see :func:`_why_not_converted`).

    A plain BatchNorm, and a timm norm-act layer without activation, stays an instance of its torch class
    (:data:`KEPT_CLASSES`); one with an activation does not, as code that rebuilds an ``nn.BatchNorm2d`` from it
    (timm's ``freeze_batch_norm_2d``) would drop that.
    """
    kept = [ours for theirs, ours in KEPT_CLASSES.items() if isinstance(module, theirs)][:1]
    if not is_timm_norm_act(module):
        return _synced(module, process_group, *kept)
    if (fused := fused_activation(module)) is not None:
        return _synced(module, process_group, *kept * (fused[0] is None), activation=fused[0], negative_slope=fused[1])
    return _synced(module, process_group, SyncBatchNormAct, drop=module.drop, act=module.act)


def unconverted_batchnorms(module: nn.Module) -> list[str]:
    """``"name (Class: reason)"`` for every BatchNorm that :func:`convert_sync_batchnorm` leaves alone."""
    return [
        f"{name or '<root>'} ({type(m).__name__}: {why})"
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) and not is_tritonbn(m) and (why := why_not_converted(m))
    ]


def _convert(module: nn.Module, process_group) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not is_tritonbn(module) and why_not_converted(module) is None:
        out = _converted(module, process_group)
    for name, child in module.named_children():
        out.add_module(name, _convert(child, process_group))
    return out


def convert_sync_batchnorm(
    module: nn.Module, process_group=None, *, group_size: int | None = None, strict: bool = False
) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` in ``module`` by :class:`SyncBatchNorm`.

    The new modules synchronize over ``process_group`` (default: the world), or, with
    ``group_size``, within groups of ``group_size`` consecutive ranks (:func:`tritonbn.syncbn_group`,
    a collective: every rank must convert with the same ``group_size``); ``group_size=1`` is local
    BatchNorm with tritonbn's kernels. Passing both is an error.

    The new modules share the original parameters and buffers (so device, dtype,
    ``requires_grad`` and optimizer references are kept) and the training mode, and remember the
    original class for :func:`revert_sync_batchnorm`. Other norms, and tritonbn's own layers, are left
    alone. Returns the converted module (``module`` itself, changed in place, unless ``module`` is a batch norm).

    A converted ``nn.BatchNorm1d/2d/3d`` (or subclass) stays an instance of that class (:class:`SyncBatchNorm2d` and
    its kin); a converted ``nn.SyncBatchNorm`` is a plain :class:`SyncBatchNorm` (DDP refuses CPU modules of torch's).

    Conversion never changes what a layer computes. A subclass that keeps torch's forward and has
    no children converts like its base class. timm's ``BatchNormAct2d`` and ``SyncBatchNormAct``
    (recognised by structure) become a :class:`SyncBatchNorm` with the fused activation when their
    ``act`` is ReLU, LeakyReLU, SiLU or Identity and their ``drop`` is Identity, and a
    :class:`SyncBatchNormAct` (the same ``drop`` and ``act`` children, applied after the kernels)
    otherwise. Any other BatchNorm (its own forward, child modules, another base class) is left
    alone, with one warning naming those layers, or a ``ValueError`` before anything changes when
    ``strict=True``.
    """
    if group_size is not None:
        if process_group is not None:
            raise ValueError(
                "convert_sync_batchnorm: pass process_group or group_size, not both "
                f"(got process_group={process_group!r} and group_size={group_size!r})"
            )
        process_group = syncbn_group(group_size)
    left = unconverted_batchnorms(module)
    if left:
        message = (
            f"convert_sync_batchnorm left {len(left)} BatchNorm layer(s) unconverted, since tritonbn cannot "
            f"compute what they compute; they will not synchronize across ranks: {', '.join(left)}"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message, UserWarning, stacklevel=2)
    out = _convert(module, process_group)
    name_layers(out)
    return out


def _reverted(module: SyncBatchNorm, default: type[_BatchNorm]) -> _BatchNorm:
    template = module.__dict__.get(_TEMPLATE)
    if template is not None:  # a converted subclass: the very original module, with the current state
        template.eps, template.momentum = module.eps, module.momentum
        if isinstance(template, nn.SyncBatchNorm):
            template.process_group = module.process_group
        return move_state(module, template)
    if module.activation is not None:
        raise ValueError(
            f"cannot revert a SyncBatchNorm with a fused activation ({module.activation!r}) to a plain BatchNorm; "
            "rebuild the model without fusion first"
        )
    cls = getattr(module, _ORIGINAL, default)
    kwargs = {"process_group": module.process_group} if issubclass(cls, nn.SyncBatchNorm) else {}
    return _rebuilt(cls, module, **kwargs)


def revert_sync_batchnorm(module: nn.Module, default: type[_BatchNorm] = nn.BatchNorm2d) -> nn.Module:
    """Replace every :class:`SyncBatchNorm` in ``module`` by the class it was converted from.

    A module built directly as ``tritonbn.SyncBatchNorm`` (no original class recorded) becomes
    ``default``. Parameters, buffers and training mode are shared, as in the conversion. A converted
    subclass (such as timm's ``BatchNormAct2d``, with its ``drop`` and ``act``) becomes its original
    module again. A module with a fused activation that was not converted from such a layer has no
    plain equivalent: reverting it raises a ``ValueError``.
    """
    out = _reverted(module, default) if isinstance(module, SyncBatchNorm) else module
    for name, child in module.named_children():
        out.add_module(name, revert_sync_batchnorm(child, default))
    return out
