"""Synchronized batch norm: the launchers plus one all-reduce per pass, in two plain functions.

``forward_pass`` and ``backward_pass`` hold the passes. Eager calls run them from an autograd
Function directly (``EagerBatchNormFunction``); ``torch.compile`` traces the ``torch.library``
custom ops ``tritonbn::batch_norm_forward/backward``, whose bodies call the same two functions.

Forward (training)::

    stats = batch_norm_stats(x)                 # local [sum_x | sum_x2 | count], (2C + 1,) fp64
    all_reduce(stats)                           # THE forward collective: 2C + 1 doubles, any world size
    y, mean, invstd = batch_norm_elemt(...)     # also updates the running stats on the device

Backward (training)::

    sums, dw, db = batch_norm_backward_reduce(dy, x, mean, invstd, w)   # local, (2, C) fp32
    all_reduce(sums)                            # THE backward collective: 2*C floats
    dx = batch_norm_backward_elemt(dy, x, mean, invstd, w, sums, stats[-1:])

Each launcher is one kernel launch. Float64 inputs compute in float64 throughout (saved invstd and
the backward sums too), so ``torch.autograd.gradcheck`` holds at its default tolerances.

Derivation. With ``xhat = (x - mean) * invstd`` over the global batch of ``n`` elements per
channel and ``y = xhat * w + b``, the gradient of any loss with respect to ``x`` is

    dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))

where the means run over the *global* batch: this is why backward needs the global
``sum(dy)`` and ``sum(dy * xhat)``, and nothing else, from the other ranks. ``dw = sum(dy * xhat)``
and ``db = sum(dy)`` stay local, as in ``torch.nn.SyncBatchNorm``: DDP averages them.

A fused epilogue ``y = act(z)``, ``z = xhat * w + b + residual``, changes only the upstream
gradient: every formula above takes ``dz = dy * act'(z)`` in place of ``dy``, and the residual's
gradient is ``dz``. The backward kernels compute ``dz`` on the fly, in the passes they make anyway.
What they need for ``act'(z)`` decides what is saved:

* no residual: nothing more; ``z`` is recomputed from the saved ``x`` and the statistics;
* a residual with relu, or leaky_relu with a slope >= 0: the output ``y`` (``z > 0`` exactly where
  ``y > 0``), which the next layer usually holds anyway;
* a residual with silu (or a negative slope): the residual itself, to recompute ``z``.

In eval (running statistics) mean and invstd are constants: ``dx = w * invstd * dz``, and nothing
communicates.

Gradients beyond first order go through :mod:`tritonbn.higher_order`: under ``create_graph=True``
(``torch.is_grad_enabled()`` inside backward) both Functions' backward recompute the gradients with
differentiable torch ops and a differentiable all-reduce instead of the launchers, and forward-mode
AD uses their ``jvp``. The first-order path does none of this.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad as _forward_ad

from tritonbn import higher_order
from tritonbn.activations import check_activation, output_gives_grad
from tritonbn.backend import ops_for
from tritonbn.distributed import all_reduce_sum, check_signature, debug_enabled, dtype_code, resolve_group

_FLOAT_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))


def _check_vector(name: str, t: torch.Tensor | None, C: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape ({C},) or None, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != C:
        raise ValueError(f"{name} must have shape ({C},) to match the {C} channels of input, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the input's device {device}, got {t.device}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def check_momentum(momentum: float | None) -> None:
    if momentum is not None and not (0.0 <= float(momentum) <= 1.0):
        raise ValueError(f"momentum must be in [0, 1] or None, got {momentum}")


def check_inputs(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    momentum: float | None,
    eps: float,
    num_batches_tracked: torch.Tensor | None = None,
    num_features: int | None = None,
    residual: torch.Tensor | None = None,
    training: bool = True,
) -> None:
    """Raise a ``ValueError``/``TypeError`` naming the argument for anything a rank can see alone.

    As in torch, ``eps`` must be positive in training and non-negative in eval, and ``momentum``
    (unused in eval) is only checked in training.
    """
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a tensor, got {type(input).__name__}")
    if not 2 <= input.dim() <= 5:
        raise ValueError(f"input must have 2 to 5 dimensions (N, C, *S), got shape {tuple(input.shape)}")
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"input must be float32, float16, bfloat16 or float64, got dtype {input.dtype}")
    C = input.shape[1]
    if num_features is not None and C != num_features:
        raise ValueError(f"input has {C} channels (dim 1), but num_features={num_features}")
    if C == 0:
        raise ValueError(f"input must have at least one channel (dim 1), got shape {tuple(input.shape)}")
    device = input.device
    _check_vector("running_mean", running_mean, C, device)
    _check_vector("running_var", running_var, C, device)
    _check_vector("weight", weight, C, device)
    _check_vector("bias", bias, C, device)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must both be tensors or both be None")
    if training:
        check_momentum(momentum)
        if not float(eps) > 0.0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    elif not float(eps) >= 0.0:
        raise ValueError(f"batch_norm eps must be non-negative, but got {eps}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a tensor shaped like input or None, got {type(residual).__name__}")
        if residual.shape != input.shape:
            raise ValueError(f"residual must have the input's shape {tuple(input.shape)}, got {tuple(residual.shape)}")
        if residual.device != input.device:
            raise ValueError(f"residual must be on the input's device {input.device}, got {residual.device}")
        if residual.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"residual must be a floating-point tensor, got dtype {residual.dtype}")
    if num_batches_tracked is not None:
        if num_batches_tracked.numel() != 1 or num_batches_tracked.dtype != torch.long:
            raise ValueError(
                "num_batches_tracked must be a one-element int64 tensor, got "
                f"shape {tuple(num_batches_tracked.shape)} dtype {num_batches_tracked.dtype}"
            )
        if num_batches_tracked.device != device:
            raise ValueError(
                f"num_batches_tracked must be on the input's device {device}, got {num_batches_tracked.device}"
            )


def _signature(input, training: bool, input_grad: bool) -> dict[str, float]:
    """What every rank must agree on before a collective (TRITONBN_DEBUG=1), besides the call and the layer."""
    ok = isinstance(input, torch.Tensor) and input.dim() >= 2
    return {
        "channels": input.shape[1] if ok else -1,
        "ndim": input.dim() if ok else -1,
        "dtype": dtype_code(input.dtype) if ok else 0,
        "training": int(training),
        "input_grad": int(input_grad),
    }


def in_backward() -> bool:
    """Whether this forward runs inside a backward pass: an activation-checkpointing recompute."""
    return torch._C._current_graph_task_id() != -1


def group_name(group) -> str:
    """The name a custom op takes for ``group`` (a resolved group or ``None``): ``""`` means no communication."""
    return "" if group is None else group.group_name


def _resolve_name(name: str):
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _stats_shape(C: int) -> tuple[int, ...]:
    """Shape of the packed forward statistics: ``[sum x (C) | sum x^2 (C) | count (1)]``."""
    return (2 * C + 1,)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the kernels compute in (and save invstd as) for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kept_for_backward(y, residual, layer):
    """``(residual, output)``: what backward reads act'(z) from (see the module docstring), or ``None``."""
    if layer.activation is None or residual is None:
        return None, None
    if output_gives_grad(layer.activation, layer.negative_slope):
        return None, y
    return residual, None


class Layer:
    """A layer's settings and process groups: what its calls need besides their tensors.

    The module builds one when it is first called and keeps it until a setting changes (see
    :class:`tritonbn.SyncBatchNorm`); the functional form and the custom ops build one per call.
    ``group`` is what training synchronizes over (``None``: this rank alone; always ``None`` in eval),
    ``debug_group`` what ``TRITONBN_DEBUG=1`` checks signatures over, and ``name`` the layer's
    identity in those checks. ``world`` is the default process group the groups were resolved
    against, so that a module built before ``init_process_group`` resolves them again.
    """

    __slots__ = ("training", "momentum", "eps", "activation", "negative_slope", "group", "debug_group", "name",
                 "world")  # fmt: skip

    def __init__(self, training, momentum, eps, activation=None, negative_slope=0.01, group=None, debug_group=None,
                 name="", world=None):  # fmt: skip
        self.training = training
        self.momentum = momentum
        self.eps = eps
        self.activation = activation
        self.negative_slope = negative_slope
        self.group = group
        self.debug_group = group if debug_group is None else debug_group
        self.name = name
        self.world = world


# --- The two passes as plain functions of tensors: the eager Function and the custom ops both call them.


def forward_pass(ops, layer, x, weight, bias, running_mean, running_var, num_batches_tracked, residual,
                 save_stats=True, stats_sink=None):  # fmt: skip
    """The forward pass over the launchers in ``ops``: ``(y, mean, invstd, stats)``, ``stats`` ``None`` in eval.

    Training: local stats, the one all-reduce over ``layer.group`` (``None``: no communication),
    then ``y = act(bn(x) + residual)`` and the in-place running-stat update. ``stats`` is the global
    packed ``[sum x | sum x^2 | count]``. A forward that runs inside a backward pass (an
    activation-checkpointing recompute) leaves the running statistics alone. ``save_stats=False``
    (nothing will run backward) skips ``mean`` and ``invstd``.

    ``stats_sink`` (:func:`tritonbn.accumulate_stats`): a ``(2C + 1,)`` fp64 buffer that ``stats``
    is added into, on the device, in place of the running-stat update.
    """
    if not layer.training:
        y, mean, invstd = ops.batch_norm_elemt(
            x, weight, bias, running_mean=running_mean, running_var=running_var, eps=layer.eps, residual=residual,
            activation=layer.activation, negative_slope=layer.negative_slope, save_stats=save_stats,
        )  # fmt: skip
        return y, mean, invstd, None
    if torch._C._current_graph_task_id() != -1:  # in_backward()
        running_mean = running_var = num_batches_tracked = None
    stats = ops.batch_norm_stats(x)
    if layer.group is not None:
        all_reduce_sum(stats, layer.group)
    if stats_sink is not None:  # tritonbn.accumulate_stats: pool the global sums, update nothing now
        stats_sink.add_(stats)
        running_mean = running_var = num_batches_tracked = None
    y, mean, invstd = ops.batch_norm_elemt(
        x, weight, bias, stats=stats, running_mean=running_mean, running_var=running_var,
        num_batches_tracked=num_batches_tracked, momentum=layer.momentum, eps=layer.eps, residual=residual,
        activation=layer.activation, negative_slope=layer.negative_slope, save_stats=save_stats,
    )  # fmt: skip
    return y, mean, invstd, stats


def backward_pass(ops, layer, grad_out, x, weight, bias, mean, invstd, stats, residual, output, input_grad,
                  weight_grad, bias_grad, residual_grad):  # fmt: skip
    """The backward pass over the launchers in ``ops``: ``(dx, dweight, dbias, dresidual)``, ``None`` if not asked for.

    Training: local reductions of ``dz``, the one all-reduce of ``[sum dz | sum dz*xhat]`` (only
    when the input needs a gradient), then dx and the residual's gradient in one pass. Eval:
    dx = dz * invstd * weight. ``residual`` / ``output`` are what the fused activation's gradient
    is read from (see the module docstring).
    """
    training, group, activation, slope = layer.training, layer.group, layer.activation, layer.negative_slope
    if training and group is not None and debug_enabled():
        check_signature(group, "backward", _signature(x, True, input_grad), layer=layer.name)
    sums = dx = dw = db = dr = None
    if weight_grad or bias_grad or (input_grad and training):
        sums, dw, db = ops.batch_norm_backward_reduce(
            grad_out, x, mean, invstd, weight, weight_grad=weight_grad, bias_grad=bias_grad, bias=bias,
            activation=activation, negative_slope=slope, residual=residual, output=output,
        )  # fmt: skip
    if input_grad or residual_grad:
        if input_grad and training and group is not None:
            all_reduce_sum(sums, group)
        if residual_grad:
            dr = torch.empty_like(x)
        dx = ops.batch_norm_backward_elemt(
            grad_out, x, mean, invstd, weight, sums if training else None, stats[-1:] if training else None,
            bias=bias, activation=activation, negative_slope=slope, residual=residual, output=output,
            input_grad=input_grad, out_grad_residual=dr,
        )  # fmt: skip
    return dx, dw, db, dr


# --- The compiled path: custom ops that torch.compile traces (and keeps whole, collectives inside). ---


@torch.library.custom_op(
    "tritonbn::batch_norm_forward", mutates_args=("running_mean", "running_var", "num_batches_tracked")
)
def batch_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    residual: torch.Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
    activation: str | None,
    negative_slope: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`forward_pass` as one op, over the group named ``group_name`` ("" for none): ``(y, mean, invstd, stats)``.

    In eval ``stats`` is left uninitialized (an op returns tensors).
    """
    layer = Layer(training, momentum, eps, activation, negative_slope, _resolve_name(group_name))
    y, mean, invstd, stats = forward_pass(
        ops_for(x), layer, x, weight, bias, running_mean, running_var, num_batches_tracked, residual
    )
    if stats is None:
        stats = x.new_empty(_stats_shape(x.shape[1]), dtype=torch.float64)
    return y, mean, invstd, stats


@batch_norm_forward.register_fake
def _(x, weight, bias, running_mean, running_var, num_batches_tracked, residual, training, momentum, eps, *_):
    C = x.shape[1]
    return (
        torch.empty_like(x),
        x.new_empty(C, dtype=torch.float64),
        x.new_empty(C, dtype=compute_dtype(x.dtype)),
        x.new_empty(_stats_shape(C), dtype=torch.float64),
    )


@torch.library.custom_op("tritonbn::batch_norm_backward", mutates_args=())
def batch_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    stats: torch.Tensor,
    residual: torch.Tensor | None,
    output: torch.Tensor | None,
    training: bool,
    activation: str | None,
    negative_slope: float,
    input_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
    residual_grad: bool,
    group_name: str,
    layer: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward_pass` as one op: ``(dx, dweight, dbias, dresidual)``; a gradient not asked for is empty."""
    spec = Layer(training, None, 0.0, activation, negative_slope, _resolve_name(group_name), name=layer)
    grads = backward_pass(
        ops_for(x), spec, grad_out, x, weight, bias, mean, invstd, stats, residual, output, input_grad, weight_grad,
        bias_grad, residual_grad,
    )  # fmt: skip
    return tuple(g if g is not None else x.new_empty(0) for g in grads)  # distinct: op outputs may not alias


@batch_norm_backward.register_fake
def _(grad_out, x, weight, bias, mean, invstd, stats, residual, output, training, activation, negative_slope,
      input_grad, weight_grad, bias_grad, residual_grad, group_name, layer=""):  # fmt: skip
    C = x.shape[1]
    gdtype = weight.dtype if weight is not None else compute_dtype(x.dtype)
    return (
        torch.empty_like(x) if input_grad else x.new_empty(0),
        x.new_empty(C, dtype=gdtype) if weight_grad else x.new_empty(0),
        x.new_empty(C, dtype=gdtype) if bias_grad else x.new_empty(0),
        torch.empty_like(x) if residual_grad else x.new_empty(0),
    )


class SyncBatchNormFunction(torch.autograd.Function):
    """Autograd for the two custom ops: the path ``torch.compile`` traces.

    torch.library cannot register autograd on an op that mutates its inputs, hence this Function.
    ``torch.compile`` traces it and keeps both ops whole, with the collectives inside.
    """

    @staticmethod
    def forward(
        ctx, x, weight, bias, residual, running_mean, running_var, num_batches_tracked, training, momentum, eps,
        activation, negative_slope, name, layer,
    ):  # fmt: skip
        y, mean, invstd, stats = torch.ops.tritonbn.batch_norm_forward(
            x, weight, bias, running_mean, running_var, num_batches_tracked, residual, training, momentum, eps,
            activation, negative_slope, name,
        )  # fmt: skip
        keep_residual, keep_output = _kept_for_backward(y, residual, Layer(training, momentum, eps, activation,
                                                                           negative_slope))  # fmt: skip
        ctx.save_for_backward(x, weight, bias, mean, invstd, stats, keep_residual, keep_output)
        ctx.training, ctx.activation, ctx.negative_slope, ctx.group_name = training, activation, negative_slope, name
        ctx.has_residual, ctx.layer, ctx.eps = residual is not None, layer, eps
        if _forward_ad._current_level >= 0:  # forward-mode AD is on: what jvp needs (inputs and statistics only)
            ctx.for_jvp = (x, weight, bias, mean, invstd, stats, residual)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, invstd, stats, residual, output = ctx.saved_tensors
        need_x, need_w, need_b, need_r = ctx.needs_input_grad[:4]
        need_r = need_r and ctx.has_residual
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True: see higher_order
            grads = higher_order.backward(_ctx_layer(ctx), ctx.eps, grad_out, x, weight, bias, mean, invstd, residual,
                                          output, (need_x, need_w, need_b, need_r))  # fmt: skip
            return grads + (None,) * 10
        dx, dw, db, dr = torch.ops.tritonbn.batch_norm_backward(
            grad_out, x, weight, bias, mean, invstd, stats, residual, output, ctx.training, ctx.activation,
            ctx.negative_slope, need_x, need_w, need_b, need_r, ctx.group_name, ctx.layer,
        )  # fmt: skip
        grads = (dx if need_x else None, dw if need_w else None, db if need_b else None, dr if need_r else None)
        return grads + (None,) * 10


class SyncBatchNormFunctionForwardAD(SyncBatchNormFunction):
    """:class:`SyncBatchNormFunction` with a ``jvp``, for forward-mode AD outside ``torch.compile``.

    Dynamo refuses to trace a Function that defines ``jvp``, so only uncompiled calls made while a
    forward-AD level is active (tensor subclasses, dispatch modes) take this one.
    """

    @staticmethod
    def jvp(ctx, tx, tw, tb, tr, *_):
        return higher_order.jvp(_ctx_layer(ctx), ctx.eps, *ctx.for_jvp, None, tx, tw, tb, tr)


def _ctx_layer(ctx) -> Layer:
    """The :class:`Layer` that :mod:`tritonbn.higher_order` needs, from what the custom-op Function saved."""
    return Layer(ctx.training, None, ctx.eps, ctx.activation, ctx.negative_slope, _resolve_name(ctx.group_name))


# --- The eager path: an autograd Function straight over the launchers, no custom-op dispatch. ---------


class EagerBatchNormFunction(torch.autograd.Function):
    """Autograd over :func:`forward_pass` / :func:`backward_pass` for eager calls.

    ``spec`` is ``(ops, layer, running_mean, running_var, num_batches_tracked, stats_sink)``: what the
    passes need besides the differentiable tensors.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, residual, spec):
        ops, layer, running_mean, running_var, num_batches_tracked, sink = spec
        y, mean, invstd, stats = forward_pass(
            ops, layer, x, weight, bias, running_mean, running_var, num_batches_tracked, residual, stats_sink=sink
        )
        if residual is None or layer.activation is None:
            ctx.save_for_backward(x, weight, bias, mean, invstd, stats)
        else:
            ctx.save_for_backward(x, weight, bias, mean, invstd, stats, *_kept_for_backward(y, residual, layer))
        ctx.spec = spec
        if _forward_ad._current_level >= 0:  # forward-mode AD is on: what jvp needs (inputs and statistics only)
            ctx.for_jvp = (x, weight, bias, mean, invstd, stats, residual)
        return y

    @staticmethod
    def jvp(ctx, tx, tw, tb, tr, _):
        layer = ctx.spec[1]
        return higher_order.jvp(layer, layer.eps, *ctx.for_jvp, None, tx, tw, tb, tr)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, invstd, stats, *kept = ctx.saved_tensors
        residual, output = kept or (None, None)
        ops, layer = ctx.spec[:2]
        need_x, need_w, need_b, need_r, _ = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: differentiable recompute (see higher_order)
            grads = higher_order.backward(layer, layer.eps, grad_out, x, weight, bias, mean, invstd, residual, output,
                                          (need_x, need_w, need_b, need_r))  # fmt: skip
            return (*grads, None)
        dx, dw, db, dr = backward_pass(
            ops, layer, grad_out, x, weight, bias, mean, invstd, stats, residual, output, need_x, need_w, need_b,
            need_r,
        )  # fmt: skip
        return dx, dw, db, dr, None


def _eager(x: torch.Tensor) -> bool:
    """Whether a call may skip the custom ops: a plain tensor, no functorch transform or dispatch mode active.

    Anything else (a tensor subclass such as a FakeTensor, ``make_fx``, ``vmap``) takes the custom
    ops, which those know how to trace. The caller has checked ``torch.compiler.is_compiling()``.
    """
    return (
        type(x) is torch.Tensor
        and not torch._C._are_functorch_transforms_active()
        and torch._C._len_torch_dispatch_stack() == 0
    )


# ``Function.apply`` without its Python wrapper, which only adds what functorch transforms and
# ``setup_context`` need: ``_eager`` has ruled out the transforms, and the Function has no setup_context.
_apply_eager = super(torch.autograd.Function, EagerBatchNormFunction).apply


def _params_need_grad(weight, bias, residual) -> bool:
    """Whether a differentiable input other than ``input`` requires grad (the caller checks grad mode)."""
    return (
        (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    )


def batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
    group,
    num_batches_tracked: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    negative_slope: float = 0.01,
    num_features: int | None = None,
    debug_group=None,
    layer: str = "",
    stats_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Checked entry point of :func:`sync_batch_norm`: :func:`run` with a :class:`Layer` made for this call.

    ``group`` (resolved) is what the statistics are synchronized over, ``None`` for this rank alone.
    ``debug_group`` (default ``group``) is what ``TRITONBN_DEBUG=1`` checks signatures over.
    ``layer`` is the layer's identity in those checks. ``stats_sink``: see :func:`forward_pass`.
    """
    spec = Layer(training, momentum, eps, activation, negative_slope, group, debug_group, layer)
    return run(spec, input, weight, bias, running_mean, running_var, num_batches_tracked, residual, num_features,
               stats_sink)  # fmt: skip


def run(
    layer: Layer,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    num_features: int | None = None,
    stats_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """One call of ``layer`` on these tensors: the checks, then the eager Function, the custom ops, or no autograd.

    Every argument a rank can get wrong alone is checked first; with ``TRITONBN_DEBUG=1`` the ranks
    of ``layer.debug_group`` then compare signatures, so that a rank whose input was rejected makes
    every rank raise instead of leaving them waiting in the next collective. ``stats_sink``: see
    :func:`forward_pass` (eager calls only).
    """
    training = layer.training
    debug_group = layer.debug_group
    compiling = torch.compiler.is_compiling()
    checking = debug_group is not None and not compiling and debug_enabled()
    grad_mode = torch.is_grad_enabled()
    input_grad = grad_mode and isinstance(input, torch.Tensor) and input.requires_grad
    try:
        check_inputs(input, running_mean, running_var, weight, bias, layer.momentum, layer.eps, num_batches_tracked,
                     num_features, residual, training=training)  # fmt: skip
        check_activation(layer.activation, layer.negative_slope)
        if not training and running_mean is None:
            raise ValueError("running_mean and running_var are required when training=False")
        if training and layer.group is None and input.numel() // input.shape[1] == 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {tuple(input.shape)}"
            )
        if training and layer.momentum is None and running_mean is not None and num_batches_tracked is None:
            raise ValueError("momentum=None (cumulative average) needs num_batches_tracked")
    except (ValueError, TypeError) as error:
        if checking:  # every rank stops here, instead of the others waiting in the next collective
            check_signature(debug_group, "forward", _signature(input, training, input_grad), local_error=error,
                            layer=layer.name)  # fmt: skip
        raise
    if checking:
        check_signature(debug_group, "forward", _signature(input, training, input_grad), layer=layer.name)
    if compiling or not _eager(input):
        if stats_sink is not None:
            raise RuntimeError(
                "tritonbn.accumulate_stats needs eager calls: it does not work under torch.compile, functorch "
                "transforms (vmap) or dispatch modes (make_fx)"
            )
        if not compiling and torch._C._are_functorch_transforms_active():
            raise RuntimeError(
                "tritonbn does not support torch.func transforms (vmap, grad, jvp, jacrev, jacfwd, hessian): use "
                "torch.autograd.grad (create_graph=True for higher orders) and torch.autograd.forward_ad instead, "
                "or torch.func.functional_call, which runs without a transform"
            )
        function = SyncBatchNormFunction
        if _forward_ad._current_level >= 0:
            if compiling:
                raise RuntimeError(
                    "tritonbn does not support forward-mode AD (torch.autograd.forward_ad) under torch.compile: "
                    "call the layer uncompiled"
                )
            function = SyncBatchNormFunctionForwardAD
        return function.apply(
            input, weight, bias, residual, running_mean, running_var, num_batches_tracked, training, layer.momentum,
            layer.eps, layer.activation, float(layer.negative_slope), group_name(layer.group), layer.name,
        )  # fmt: skip
    ops = ops_for(input)
    if input_grad or (grad_mode and _params_need_grad(weight, bias, residual)) or _forward_ad._current_level >= 0:
        spec = (ops, layer, running_mean, running_var, num_batches_tracked, stats_sink)
        return _apply_eager(input, weight, bias, residual, spec)
    return forward_pass(
        ops, layer, input, weight, bias, running_mean, running_var, num_batches_tracked, residual, save_stats=False,
        stats_sink=stats_sink,
    )[0]  # fmt: skip


def sync_batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    process_group=None,
    *,
    num_batches_tracked: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    negative_slope: float = 0.01,
) -> torch.Tensor:
    """Batch norm whose training statistics cover the global batch of ``process_group``.

    Arguments follow :func:`torch.nn.functional.batch_norm`. In training the batch statistics are
    summed over ``process_group`` (default: the world group) with one all-reduce, and the
    running statistics, when given, are updated in place on the device. ``momentum=None`` is a
    cumulative average and needs ``num_batches_tracked`` (``() int64``, incremented in place).
    Without an initialized process group, or at world size 1, this is plain batch norm.

    The fused epilogue computes ``act(batch_norm(input) + residual)`` inside the kernels:
    ``residual`` is a tensor shaped like ``input`` (it gets its gradient), ``activation`` one of
    ``None``, ``"relu"``, ``"leaky_relu"`` (with ``negative_slope``) or ``"silu"``.
    """
    group = resolve_group(process_group) if training else None
    return batch_norm(
        input, running_mean, running_var, weight, bias, training, momentum, eps, group, num_batches_tracked,
        residual=residual, activation=activation, negative_slope=negative_slope,
    )  # fmt: skip
