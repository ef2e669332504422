"""The one dispatch: every call of the module and of the functional form goes through :func:`run`.

A call is checked (:mod:`tritonbn._core.checks`, and with ``TRITONBN_DEBUG=1`` the signature check across ranks,
:mod:`tritonbn._signature`), then runs its route (:mod:`tritonbn._core.route`, where the one choice is made, and
docs/design.md, "Routes", the table of them): the export lowering, the ``torch.func`` lowering, the custom ops, the
eager autograd Function over a backend's launchers, the forward pass alone, or the PyTorch backend's own ops. An eager
call that repeats the layer's last checked one (:class:`~tritonbn._core.call.CallRecord`) in the same context takes
the route kept there, without the checks.

A call is a :class:`~tritonbn._core.call.LayerSettings` (built by :func:`~tritonbn._core.call.settings_for`,
once per module) and its :class:`~tritonbn.backends.launchers.Operands`.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import handle_torch_function, has_torch_function

from tritonbn._compat import jit_tracing, torch_function_subclass
from tritonbn._core.call import LayerSettings, in_backward
from tritonbn._core.checks import check_call, check_eager_call, check_traced_call, repeats
from tritonbn._core.lowering import exporter
from tritonbn._core.route import context, is_eager, route_for
from tritonbn._signature import check_signature, debug_enabled, signature
from tritonbn.backends.launchers import Operands


def run(settings: LayerSettings, operands: Operands, num_features: int | None = None) -> torch.Tensor:
    """One call: the route kept for a call that repeats the layer's record, or the checks and then the route
    :func:`~tritonbn._core.route.route_for` chooses.

    Every argument a rank can get wrong alone is checked first; with ``TRITONBN_DEBUG=1`` the ranks of
    ``settings.debug_group`` then compare signatures, so that a rank whose input was rejected makes every rank
    raise instead of leaving them waiting in the next collective.
    """
    t = operands
    if type(t.input) is not torch.Tensor and has_torch_function(t.tensors()):
        # an input with __torch_function__: torch's protocol, as F.batch_norm, which calls normalize back on plain
        # tensors (the one test the ordinary path pays for tensor subclasses is the type's)
        from tritonbn._core.uncompiled import uncompiled  # imported here, at the first subclass call: see there

        tensors = t.tensors()
        y = uncompiled(
            handle_torch_function, normalize, tensors, *tensors, settings=settings, num_features=num_features
        )
    else:
        if type(t.input) is not torch.Tensor:
            t = _plain(t)
        route = _kept_route(settings, t, num_features)
        if route is None:
            compiling = torch.compiler.is_compiling()
            how = exporter(compiling)  # THE export hook: the tracer recording this call (it also picks the checks)
            record = _check(settings, t, num_features, compiling, how)
            route = route_for(settings, t, record, how, compiling)
        if _watchers:  # tritonbn.explain, and tests: the route each call takes
            _watchers[-1](settings, route)
        y = route.run(settings, t)
    return y


_watchers: list = []


@contextlib.contextmanager
def watching(watcher):
    """Within the block, ``watcher(settings, route)`` is called with the route of every call of this thread and the
    others (:func:`tritonbn.explain`; the tests)."""
    _watchers.append(watcher)
    try:
        yield
    finally:
        _watchers.remove(watcher)


def _kept_route(settings: LayerSettings, operands: Operands, num_features):
    """The route kept for an eager call that repeats the layer's record (:func:`~tritonbn._core.checks.repeats`) in
    the same :func:`~tritonbn._core.route.context`, or ``None``: a first call, a call with a mask or a sink, or one
    that is compiled, traced, transformed, or checked across ranks (``TRITONBN_DEBUG=1``)."""
    record = settings.record
    if record is None or operands.mask is not None or operands.sink is not None or torch.compiler.is_compiling():
        return None
    if (settings.debug_group is not None and debug_enabled()) or jit_tracing() or not is_eager(operands.input):
        return None
    if not repeats(record, operands, num_features):
        return None
    return record.routes.get(context(operands))


def _check(settings: LayerSettings, t: Operands, num_features, compiling: bool, how: str | None):
    """The checks of a call, and with ``TRITONBN_DEBUG=1`` the signature check across ranks (not inside backward, a
    checkpoint's recompute: the pass that communicates checks; a recompute that replays does not). Returns
    :func:`check_eager_call`'s record for an eager call, else ``None``."""
    if how is None and not compiling and settings.debug_group is None:  # the ordinary eager call
        return check_eager_call(settings, t, num_features)
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
            fields = signature(input, settings.batch_stats, input_grad)
            check_signature(settings.debug_group, "forward", fields, local_error=error, name=settings.name)
        raise
    if checking:
        check_signature(
            settings.debug_group, "forward", signature(input, settings.batch_stats, input_grad), name=settings.name
        )
    return record


def normalize(
    input,
    weight,
    bias,
    running_mean,
    running_var,
    num_batches_tracked,
    residual,
    mask,
    sink,
    *,
    settings,
    num_features=None,
):
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
