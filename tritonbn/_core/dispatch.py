"""The one dispatch: every call of the module and of the functional form goes through :func:`run`.

A call is checked (:mod:`tritonbn._core.checks`, and with ``TRITONBN_DEBUG=1`` the signature check across ranks,
:mod:`tritonbn._signature`), then runs one of five ways, each over the same two passes
(:mod:`tritonbn._core.passes`, where the data path and the gradient derivation are written out):

* under an exporting tracer (``torch.export``, ONNX, ``jit.trace``): torch's own ops (:mod:`tritonbn._core.lowering`);
* under a ``torch.func`` transform (``vmap``, ``grad``, ...): torch's own ops, which functorch batches
  (:func:`tritonbn._core.lowering.under_transform`; a layer that would synchronize raises an error naming the way out);
* compiled, traced, or under a dispatch mode: the custom ops (:mod:`tritonbn._core.custom_ops`);
* eager, with autograd: :class:`tritonbn._core.eager.EagerBatchNormFunction`, straight over the launchers (on the
  PyTorch backend, a layer that synchronizes with nobody, and every eval call without a mask, runs torch's own ops
  instead, which autograd records itself: :func:`tritonbn.backends.torch.local.recorded` and
  :func:`~tritonbn.backends.torch.local.recorded_eval`); the module's training call that repeats its last checked
  one goes there without :func:`run` (:func:`trained_again`);
* without autograd (inference, or nothing needs a gradient): :func:`~tritonbn._core.passes.forward_pass` alone;
  the module's eval call that repeats its last checked one goes there without :func:`run`
  (:func:`evaluated_again`).

A call is a :class:`~tritonbn._core.call.LayerSettings` (built by :func:`~tritonbn._core.call.settings_for`,
once per module) and its :class:`~tritonbn._core.call.Operands`.
"""

from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function

from tritonbn._compat import (
    dispatch_stack_len,
    forward_ad_active,
    functorch_transforms_active,
    jit_tracing,
    torch_function_subclass,
)
from tritonbn._core.call import LayerSettings, Operands, in_backward, synchronizes_with_nobody
from tritonbn._core.checks import ACCUMULATE_EAGER_ONLY, check_call, check_eager_call, check_traced_call, matches
from tritonbn._core.custom_ops import SyncBatchNormFunction, SyncBatchNormFunctionForwardAD
from tritonbn._core.eager import apply_eager
from tritonbn._core.lowering import exporter, lowered, under_transform
from tritonbn._core.passes import forward_pass
from tritonbn._signature import check_signature, debug_enabled, signature
from tritonbn.backend import backend_variable, ops_for


def is_eager(x: torch.Tensor) -> bool:
    """Whether a call may skip the custom ops: a plain tensor, no functorch transform or dispatch mode active.

    Anything else (a tensor subclass such as a FakeTensor, ``make_fx``, ``vmap``) takes the custom
    ops, which those know how to trace. The caller has checked ``torch.compiler.is_compiling()``.
    """
    return type(x) is torch.Tensor and not functorch_transforms_active() and dispatch_stack_len() == 0


def params_need_grad(weight, bias, residual) -> bool:
    """Whether a differentiable input other than ``input`` requires grad (the caller checks grad mode)."""
    return (
        (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    )


def run(settings: LayerSettings, operands, num_features: int | None = None) -> torch.Tensor:
    """One call: the checks, then the export lowering, the custom ops, the eager Function, or no autograd.

    Every argument a rank can get wrong alone is checked first; with ``TRITONBN_DEBUG=1`` the ranks of
    ``settings.debug_group`` then compare signatures, so that a rank whose input was rejected makes every rank
    raise instead of leaving them waiting in the next collective.
    """
    t = operands
    input = t.input
    if type(input) is not torch.Tensor:  # the one test the ordinary path pays for tensor subclasses
        tensors = t.tensors()
        if has_torch_function(tensors):  # an input with __torch_function__: torch's protocol, as F.batch_norm
            from tritonbn._core.uncompiled import uncompiled  # imported here, at the first subclass call: see there

            return uncompiled(handle_torch_function, normalize, tensors, *tensors, settings=settings,
                              num_features=num_features)  # fmt: skip
        t = _plain(t)
        input = t.input
    compiling = torch.compiler.is_compiling()
    how = exporter(compiling)  # THE export hook: the tracer recording this call, if any (it also picks the checks)
    eager = how is None and not compiling
    if eager and settings.debug_group is None:  # the ordinary eager call (no signature to compare across ranks)
        record = check_eager_call(settings, t, num_features)  # what it was checked against (None: a mask or sink)
    else:
        record = _check(settings, t, num_features, compiling, how)
    if how is not None:  # torch.export, ONNX, jit.trace record torch's own ops
        return lowered(how, settings, t)
    if not eager or not is_eager(input):
        if t.sink is not None:
            raise RuntimeError(ACCUMULATE_EAGER_ONLY)
        if not compiling and functorch_transforms_active():  # torch's own ops, which the transform batches
            return under_transform(settings, t)
        function = SyncBatchNormFunction
        if forward_ad_active():
            if compiling:
                raise RuntimeError(
                    "tritonbn does not support forward-mode AD (torch.autograd.forward_ad) under torch.compile: "
                    "call the layer uncompiled"
                )
            function = SyncBatchNormFunctionForwardAD
        return function.apply(*SyncBatchNormFunction.args(settings, t))
    backend = ops_for(input)
    if record is not None and backend.prepare is not None:  # its launches, found once for calls like this one
        backend = backend.prepare(record[2])
    grad_mode = torch.is_grad_enabled()
    records = (grad_mode and (input.requires_grad or params_need_grad(t.weight, t.bias, t.residual))) or (
        forward_ad_active()
    )
    declined = False
    if not records and not settings.training and t.mask is None and backend.local is not None:
        # eval without autograd (inference, validation): the backend's one native pass, straight (as forward_pass)
        out = backend.local.evaluated(settings, input, t.weight, t.bias, t.running_mean, t.running_var, t.residual)
        if out is not None:
            return out
        declined = True
    if records:
        # The PyTorch backend's local path, recorded by autograd itself (None for the kernels). Forward-mode AD
        # keeps the Function: an outer torch.compile resumed after its graph break would trace these ops.
        local = backend.local
        if local is not None and synchronizes_with_nobody(settings, t.mask) and not forward_ad_active():
            if in_backward():  # a recompute inside backward (checkpointing) leaves the buffers alone
                t = t.without_running_stats()
            y = local.recorded(
                settings, input, t.weight, t.bias, t.running_mean, t.running_var, t.num_batches_tracked, t.sink,
                t.residual,
            )  # fmt: skip
            if y is not None:
                return y
        elif local is not None and not settings.training and t.mask is None and not forward_ad_active():
            # eval never synchronizes: torch's own eval kernel, recorded by autograd itself (None: the Function)
            y = local.recorded_eval(settings, input, t.weight, t.bias, t.running_mean, t.running_var, t.residual)
            if y is not None:
                return y
        return apply_eager(input, t.weight, t.bias, t.residual, backend, settings, t)
    return forward_pass(backend, settings, t, save_stats=False, enclosing=True, declined=declined)[0]


EVALUATED = "evaluated"  # a checked record's entry: an eval call like it takes the backend's one native pass
TRAINED = "trained"  # and a training call like it, under autograd: the eager path run takes for it


def _repeats(record, input, weight, bias, running_mean, running_var, num_batches_tracked, residual, num_features):
    """Whether an eager call repeats the checked one of ``record`` (:func:`~tritonbn._core.checks.check_eager_call`),
    as :func:`run` would find it: the same parameter and buffer tensors (of the same shapes, dtypes and devices), an
    input and residual of the same shapes, strides, dtypes and devices, and nothing that takes another path there:
    a tensor subclass, a tracer (``jit.trace``), a ``torch.func`` transform or dispatch mode, forward-mode AD. The
    caller has checked ``torch.compiler.is_compiling()`` and the signature check across ranks."""
    if not is_eager(input) or jit_tracing() or forward_ad_active():
        return False
    return matches(record, input, residual, weight, bias, running_mean, running_var, num_batches_tracked, num_features)


_UNKNOWN = object()  # nothing kept yet for calls like a record's


def _kept(kept: dict, key: str):
    """What the backend runs for calls like a record's (``kept[key]``, for the current ``TRITONBN_BACKEND``): a
    function, ``None`` (the backend has no such path, or it declined such a call), or ``_UNKNOWN``."""
    straight = kept.get(key)
    return straight[1] if straight is not None and straight[0] == backend_variable() else _UNKNOWN


def evaluated_again(settings: LayerSettings, input, weight, bias, running_mean, running_var, num_features=None):
    """The output of an eval call without autograd that repeats the layer's last checked call, or ``None``: take
    :func:`run`. The module's first step (:meth:`tritonbn.SyncBatchNorm._normalize`), for a call without residual
    or mask, in eval with running statistics.

    What :func:`run` would do with such a call, on the path it takes for it (checked, eager, nothing recorded, the
    backend's one native eval pass), when all of these hold: an eager call (not compiled, traced or exported, no
    ``torch.func`` transform, dispatch mode or forward-mode AD, a plain tensor), grad mode off, no signature to
    compare across ranks, and the record of ``settings``' last call that passed the checks
    (:func:`~tritonbn._core.checks.check_eager_call`) has this input's shape, strides, dtype and device, no
    residual, and the very same parameter and buffer tensors, with the same shapes, dtypes and devices
    (:func:`_repeats`). Over torch's eval kernel itself, a call then costs 2 µs of host time instead of 3.7 called
    alone, and 7-8 instead of 10-11 with the caches evicted between calls, as in a network (docs/performance.md);
    the Triton backend, which has no native eval pass, returns ``None``.
    """
    record = settings.checked
    if record is None or torch.compiler.is_compiling():  # first: dynamo traces nothing below
        return None
    # (TRITONBN_BACKEND as it was, what its eval pass runs for calls like the record's: None where it declined them)
    kept = record[2]
    straight = _kept(kept, EVALUATED)
    if straight is None:  # the Triton backend, or a layout torch's eval kernel does not keep
        return None
    if torch.is_grad_enabled() or (settings.debug_group is not None and debug_enabled()):
        return None
    if not _repeats(record, input, weight, bias, running_mean, running_var, None, None, num_features):
        return None
    if straight is not _UNKNOWN:
        return straight(settings, input, weight, bias, running_mean, running_var)
    local = ops_for(input).local
    y = None if local is None else local.evaluated(settings, input, weight, bias, running_mean, running_var, None)
    # it takes or declines every call like this one (by its layout and types): the next goes straight there, or on
    kept[EVALUATED] = (backend_variable(), None if y is None else local.evaluated_natively)
    return y


def trained_again(settings: LayerSettings, input, weight, bias, running_mean, running_var, num_batches_tracked,
                  residual=None, num_features=None):  # fmt: skip
    """The output of a training call under autograd that repeats the layer's last checked call, or ``None``: take
    :func:`run`. The module's step before :func:`run` for a training call without mask or ``accumulate_stats`` sink.

    What :func:`run` would do with such a call, on the path it takes for it (checked, eager, autograd recording):
    the PyTorch backend's local path, recorded by autograd itself (:func:`tritonbn.backends.torch.local.recorded`),
    for a layer that synchronizes with nobody, else the eager Function over the backend's launchers, prepared for the
    record's calls (:func:`_eager_again`). It goes there when all of these hold: an eager call (as for
    :func:`evaluated_again`), grad mode on and a tensor that requires grad, not inside backward (a checkpoint's
    recompute, which :func:`run` takes), no signature to compare across ranks, and the record of ``settings``' last
    checked call matches (:func:`_repeats`, the residual's shape, strides, dtype and device included). Which path
    takes a call depends on nothing else (the settings, the input's shape, layout and device, the dtypes, and
    ``TRITONBN_BACKEND``, read at each call), so it is found once per record. It saves 1.1-1.5 µs of host time
    a call: a 2x16x2x2 training forward on the PyTorch backend costs 27.7-28.2 µs against 28.9-29.5 through
    :func:`run` in bfloat16, 22.4-23.2 against 23.3-24.7 in float32 (two runs; docs/performance.md); on the kernels'
    eager path (``benchmarks/host_overhead.py``) no change stands out of the noise.
    """
    if torch.compiler.is_compiling():  # first: dynamo traces nothing below
        return None
    record = settings.checked
    if record is None:
        return None
    kept = record[2]
    straight = _kept(kept, TRAINED)
    if not torch.is_grad_enabled() or in_backward() or (settings.debug_group is not None and debug_enabled()):
        return None
    if not (input.requires_grad or params_need_grad(weight, bias, residual)):
        return None
    if not _repeats(record, input, weight, bias, running_mean, running_var, num_batches_tracked, residual,
                    num_features):  # fmt: skip
        return None
    held = (settings, input, weight, bias, running_mean, running_var, num_batches_tracked, None, residual)
    if straight is not _UNKNOWN:
        return straight(*held)
    backend = ops_for(input)
    local = backend.local
    if local is not None and settings.group is None:
        y = local.recorded(*held)
        if y is not None:  # it takes every call like this one
            kept[TRAINED] = (backend_variable(), local.recorded)
            return y
    again = _eager_again(backend, kept)
    kept[TRAINED] = (backend_variable(), again)
    return again(*held)


def _eager_again(backend, kept: dict):
    """The eager Function over ``backend``'s launchers, prepared for the calls of the record that keeps ``kept`` (as
    :func:`run` prepares them at each call: launches found again after the plan caches are cleared), called as
    :func:`trained_again` calls the local path."""
    prepare = backend.prepare

    def again(settings, input, weight, bias, running_mean, running_var, num_batches_tracked, sink, residual):
        operands = Operands(input, weight, bias, running_mean, running_var, num_batches_tracked, residual, None, sink)
        launchers = backend if prepare is None else prepare(kept)
        return apply_eager(input, weight, bias, residual, launchers, settings, operands)

    return again


def _check(settings: LayerSettings, t: Operands, num_features, compiling: bool, how: str | None):
    """The checks of a call that is compiled, exported or traced, or whose layer compares signatures across ranks
    (``TRITONBN_DEBUG=1``; inside backward, a checkpoint's recompute, the pass that communicates checks: a recompute
    that replays does not). Returns :func:`check_eager_call`'s record for an eager call, else ``None``."""
    input = t.input
    record = None
    checking = settings.debug_group is not None and not compiling and debug_enabled() and not in_backward()
    input_grad = torch.is_grad_enabled() and isinstance(input, torch.Tensor) and input.requires_grad
    try:
        if how is None and not compiling:
            record = check_eager_call(settings, t, num_features)
        elif how is None:
            check_call(settings, t, num_features)
        else:  # jit.trace: sizes are traced values; the checks run on the example's, with the tracer paused
            check_traced_call(settings, t, num_features)
    except (ValueError, TypeError) as error:
        if checking:  # every rank stops here, instead of the others waiting in the next collective
            fields = signature(input, settings.training, input_grad)
            check_signature(settings.debug_group, "forward", fields, local_error=error, name=settings.name)
        raise
    if checking:
        check_signature(
            settings.debug_group, "forward", signature(input, settings.training, input_grad), name=settings.name
        )
    return record


def normalize(input, weight, bias, running_mean, running_var, num_batches_tracked, residual, mask, sink, *, settings,
              num_features=None):  # fmt: skip
    """:func:`run` over loose tensors: what a tensor subclass's ``__torch_function__`` is handed (the input first,
    as ``F.batch_norm`` hands it), and calls back with torch functions disabled for subclasses.

    Under ``torch.compile`` the subclass's protocol runs uncompiled, this function inside it
    (:func:`tritonbn._core.uncompiled.uncompiled`): dynamo's tracing of a ``__torch_function__`` subclass around it
    leaves the rest of the call half traced (torch's own ``nn.BatchNorm2d`` does not compile such an input either),
    so the compiled graph breaks at the call and it runs the eager path on plain tensors.
    """
    operands = Operands(input, weight, bias, running_mean, running_var, num_batches_tracked, residual, mask, sink)
    return run(settings, operands, num_features)


def _plain(operands: Operands) -> Operands:
    """The operands with every ``__torch_function__`` subclass viewed as a plain tensor (``as_subclass``: the same
    data, attached to the same autograd graph), so that the Functions and kernels never see a subclass. Subclasses
    at the dispatch level (FakeTensor, FunctionalTensor) stay: the custom ops trace them."""
    return Operands(*(t.as_subclass(torch.Tensor) if torch_function_subclass(t) else t for t in operands.tensors()))
