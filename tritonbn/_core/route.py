"""How a call runs: :func:`route_for` is the one place that chooses, and :class:`~tritonbn._core.call.Route` what it
chose (the table of routes, and what selects each, is in docs/design.md, "Routes").

A call that runs eagerly and passed the checks has a :class:`~tritonbn._core.call.CallRecord`; the route chosen for
it is kept there, under the call's :func:`context` (what can change between calls that repeat the record), and a
call that repeats the record in the same context takes it without choosing again (:func:`tritonbn._core.dispatch.run`).
Everything a route depends on is either in the record (the input's shape, strides, dtype and device, the residual's,
the very parameter and buffer tensors with their shapes, dtypes and devices), in the layer's settings (which the
record belongs to), or in the context (``TRITONBN_BACKEND``, whether autograd records the call, forward-mode AD,
whether the call runs inside a backward pass).

Calls that are compiled, exported, traced or transformed, and calls with a mask or an ``accumulate_stats`` sink, have
no record: :func:`route_for` chooses at each of them.
"""

from __future__ import annotations

import functools

import torch

from tritonbn._compat import dispatch_stack_len, forward_ad_active, functorch_transforms_active
from tritonbn._core.call import LayerSettings, Route, in_backward, synchronizes_with_nobody
from tritonbn._core.checks import ACCUMULATE_EAGER_ONLY
from tritonbn._core.custom_ops import SyncBatchNormFunction, SyncBatchNormFunctionForwardAD, compiled_output
from tritonbn._core.eager import eager_output
from tritonbn._core.lowering import lowered, under_transform
from tritonbn._core.passes import forward_output
from tritonbn.backend import backend_variable, ops_for

COMPILED = Route(
    "custom ops",
    "triton or torch",
    "compiled, traced by a dispatch mode, or a tensor subclass: the torch.library "
    "custom ops, which those trace and keep whole",
    functools.partial(compiled_output, SyncBatchNormFunction),
)
COMPILED_FORWARD_AD = Route(
    "custom ops with jvp",
    "triton or torch",
    "forward-mode AD on a traced call: the custom ops' Function with a jvp",
    functools.partial(compiled_output, SyncBatchNormFunctionForwardAD),
)
TRANSFORMED = Route(
    "torch.func lowering",
    "torch ops",
    "under a torch.func transform (vmap, grad, ...): torch's own ops, which functorch batches and differentiates",
    under_transform,
)


def is_eager(x: torch.Tensor) -> bool:
    """Whether a call may skip the custom ops: a plain tensor, no functorch transform or dispatch mode active.

    Anything else (a tensor subclass such as a FakeTensor, ``make_fx``, ``vmap``) takes the custom
    ops, which those know how to trace. The caller has checked ``torch.compiler.is_compiling()``.
    """
    return type(x) is torch.Tensor and not functorch_transforms_active() and dispatch_stack_len() == 0


def context(operands) -> tuple:
    """What can change between eager calls that repeat one record and changes their route: ``TRITONBN_BACKEND``,
    whether autograd records the call, whether forward-mode AD is on, and whether a call that autograd records runs
    inside a backward pass (a checkpoint's recompute; the forward pass of a call that nothing records finds that out
    itself)."""
    t = operands
    recording = torch.is_grad_enabled() and (
        t.input.requires_grad
        or (t.weight is not None and t.weight.requires_grad)
        or (t.bias is not None and t.bias.requires_grad)
        or (t.residual is not None and t.residual.requires_grad)
    )
    return backend_variable(), recording, forward_ad_active(), recording and in_backward()


def route_for(settings: LayerSettings, operands, record=None, how: str | None = None, compiling=False) -> Route:
    """The route of a call that passed its checks: ``record`` its :class:`~tritonbn._core.call.CallRecord` (``None``
    for a call with a mask or a sink, or one that is not eager), ``how`` the exporting tracer recording it
    (:func:`tritonbn._core.lowering.exporter`), ``compiling`` whether ``torch.compile`` traces it."""
    t = operands
    if how is not None:
        return Route(
            "export lowering",
            "torch ops",
            f"under {how}: torch's own batch_norm and epilogue ops, which any consumer loads",
            functools.partial(lowered, how),
        )
    if compiling or not is_eager(t.input):
        if t.sink is not None:
            raise RuntimeError(ACCUMULATE_EAGER_ONLY)
        if not compiling and functorch_transforms_active():
            return TRANSFORMED
        if forward_ad_active():
            if compiling:
                raise RuntimeError(
                    "tritonbn does not support forward-mode AD (torch.autograd.forward_ad) under torch.compile: "
                    "call the layer uncompiled"
                )
            return COMPILED_FORWARD_AD
        return COMPILED
    key = context(t)
    if record is None:
        return eager_route(settings, t, None, key)
    route = record.routes.get(key)
    if route is None:  # chosen once for the calls that repeat the record in this context
        route = record.routes[key] = eager_route(settings, t, record, key)
    return route


def eager_route(settings: LayerSettings, operands, record, key: tuple) -> Route:
    """The route of an eager call in the context ``key`` (:func:`context`): on the PyTorch backend, torch's own ops
    where they compute the call (its local path: a layer that synchronizes with nobody, and eval); otherwise the
    passes over the backend's launchers (prepared for ``record``'s calls on the Triton backend), in the eager
    autograd Function where autograd records the call."""
    t = operands
    _, recording, forward_ad, backward = key
    x = t.input
    backend = ops_for(x)
    name = backend.name
    launchers = backend if record is None or backend.prepare is None else backend.prepare(record)
    local = backend.local  # the PyTorch backend's local path; None for the kernels
    evaluating = not settings.batch_stats and t.mask is None
    if not (recording or forward_ad):
        if evaluating and local is not None:
            if local.evaluates_natively(x, t.weight, t.bias, t.running_mean, t.running_var, t.residual):
                return Route(
                    "native eval", name, "eval without autograd: torch's eval kernel, one pass", local.evaluate
                )
        return Route(
            "forward pass",
            name,
            "nothing records autograd: the forward pass over the launchers alone",
            functools.partial(forward_output, launchers),
        )
    if local is not None and not forward_ad:  # forward-mode AD keeps the Function (see tritonbn._core.eager)
        if synchronizes_with_nobody(settings, t.mask):
            if local.takes_recorded(settings, x, t.running_mean, t.sink, t.residual):
                if backward:  # a checkpoint's recompute inside backward leaves the buffers alone
                    run = functools.partial(local.recorded, update=False)
                    return Route("local training", name, "a recompute inside backward: torch's own training ops", run)
                return Route(
                    "local training",
                    name,
                    "synchronizes with nobody: torch's own training ops, which autograd records",
                    local.recorded,
                )
        elif evaluating and local.takes_recorded_eval(x, t.weight, t.bias, t.running_mean, t.running_var, t.residual):
            return Route(
                "local eval", name, "eval: torch's own eval kernel, which autograd records", local.recorded_eval
            )
    why = "forward-mode AD" if forward_ad else "autograd records the call"
    return Route(
        "eager function",
        name,
        f"{why}: the passes over the launchers, in tritonbn's autograd Function",
        functools.partial(eager_output, launchers),
    )
