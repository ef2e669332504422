"""The crash hunt's child process (tests/autograd/test_crash_hunt.py): it runs a batch of cases, one after another.

It reads a JSON list of cases from stdin. For each it prints ``CASE <i> <case>`` (flushed) before running it and
then one outcome line: ``OK <i>`` (torch's answer, or the same error torch raises), ``RAISED <i> <message>`` (a
clear error where torch answers: allowed, reported), or ``FAIL <i> <why>``. A signal or a hang leaves a
``CASE`` line without its outcome, which the parent reports with the case.

A case is one call of a :class:`tritonbn.SyncBatchNorm` (with its backward where anything needs a gradient),
compared with ``torch.nn.functional.batch_norm`` in float64 on the same input: then ``+ residual``, then the
activation; for a mask, batch norm over the real positions and 0 at the padded ones (which hold NaN in the input
and the residual, so that a padded position that reaches a result shows). Where torch's own ``batch_norm``
raises (one value per channel in training), tritonbn must raise too.

Run it by hand: ``echo '[{...}]' | python tests/helpers/crash_hunt.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings

DEVICE = os.environ.get("TRITONBN_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on CPU, as in the tests
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fast_interpreter import install  # noqa: E402
from oracle import make_layout  # noqa: E402

import tritonbn  # noqa: E402

install()
# An integer division by zero in a kernel's index math: numpy warns under the interpreter (and a CPU would trap)
warnings.filterwarnings("error", message="divide by zero", category=RuntimeWarning)
if DEVICE != "cpu":
    torch.set_default_device(DEVICE)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (atol, rtol) for y and the input gradients against the float64 oracle; parameter gradients (sums) scale it
TOLERANCES = {torch.float64: (1e-9, 1e-9), torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2),
              torch.bfloat16: (6e-2, 6e-2)}  # fmt: skip
# what a clear error's message names: tritonbn, or an argument of the call
NAMES = ("tritonbn", "input", "mask", "residual", "weight", "bias", "running_mean", "running_var", "momentum", "eps",
         "num_features", "value per channel")  # fmt: skip
EPS = 1e-5


def _activate(z, activation):
    if activation == "relu":
        return F.relu(z)
    if activation == "leaky_relu":
        return F.leaky_relu(z, 0.01)
    if activation == "silu":
        return F.silu(z)
    return z


def make_case(case):
    """The case's tensors: ``x``, ``dy``, ``mask``, ``residual`` and a layer with its parameters and buffers."""
    g = torch.Generator().manual_seed(case["seed"])
    shape, dtype = tuple(case["shape"]), DTYPES[case["dtype"]]
    C = shape[1]
    mask = None
    if case["mask"] is not None:
        mshape = (shape[0], *shape[2:])
        mask = {"all_real": torch.ones(mshape, dtype=torch.bool, device="cpu"),
                "all_padding": torch.zeros(mshape, dtype=torch.bool, device="cpu"),
                "random": torch.rand(mshape, generator=g, device="cpu") > 0.4}[case["mask"]]  # fmt: skip

    def tensor(poison):
        t = torch.randn(shape, generator=g, dtype=torch.float64, device="cpu") * 2 + 1
        if poison and mask is not None:
            t = t.masked_fill(~mask.unsqueeze(1), float("nan"))
        return make_layout(t.to(dtype), case["layout"]).to(DEVICE)

    x, dy = tensor(True), tensor(False)
    residual = tensor(True) if case["residual"] else None
    bn = tritonbn.SyncBatchNorm(C, momentum=case["momentum"], affine=case["affine"],
                                track_running_stats=case["track"], activation=case["activation"])  # fmt: skip
    with torch.no_grad():
        if case["affine"]:
            bn.weight.copy_(torch.rand(C, generator=g, device="cpu") + 0.5)
            bn.bias.copy_(torch.randn(C, generator=g, device="cpu"))
        if case["track"]:
            bn.running_mean.copy_(torch.randn(C, generator=g, device="cpu"))
            bn.running_var.copy_(torch.rand(C, generator=g, device="cpu") + 0.5)
            bn.num_batches_tracked.fill_(3)
    bn = bn.to(DEVICE, DTYPES[case["param_dtype"]])
    bn.train(case["training"])
    if case["affine"]:
        bn.weight.requires_grad_(case["param_grad"])
        bn.bias.requires_grad_(case["param_grad"])
    return x, dy, None if mask is None else mask.to(DEVICE), residual, bn


def oracle(case, x, dy, mask, residual, bn, wants_grad):
    """``(y, grads, running_mean, running_var)`` in float64, or torch's error.

    ``grads`` maps "x", "weight", "bias", "residual" to the gradients that ``wants_grad`` names.
    """
    batch_stats = case["training"] or not case["track"]
    xd = x.detach().double().requires_grad_()
    w = b = None
    if case["affine"]:
        w, b = bn.weight.detach().double().requires_grad_(), bn.bias.detach().double().requires_grad_()
    rm = rv = None
    momentum = 0.0
    if case["track"]:
        rm, rv = bn.running_mean.double(), bn.running_var.double()  # copies: F.batch_norm updates these
        if case["training"]:
            momentum = case["momentum"] if case["momentum"] is not None else 1.0 / (bn.num_batches_tracked.item() + 1)
    res = None if residual is None else residual.detach().double().requires_grad_()
    if mask is None:
        z = F.batch_norm(xd, rm, rv, w, b, batch_stats, momentum, EPS)
        if res is not None:
            z = z + res
        y = _activate(z, case["activation"])
    else:
        channels_last = xd.movedim(1, -1)
        real = channels_last[mask]  # (n, C)
        # One real value per channel: F.batch_norm raises; tritonbn reads no count on the host (no host sync),
        # so it answers as torch's unchecked batch_norm does (variance 0)
        if batch_stats and real.shape[0] == 1:
            zr = torch.batch_norm(real, w, b, rm, rv, True, momentum, EPS, False)
        else:
            zr = F.batch_norm(real, rm, rv, w, b, batch_stats, momentum, EPS)
        z = torch.zeros_like(channels_last).masked_scatter(mask.unsqueeze(-1), zr).movedim(-1, 1)
        padded = ~mask.unsqueeze(1)
        if res is not None:
            z = z + res.masked_fill(padded, 0)
        y = _activate(z, case["activation"]).masked_fill(padded, 0)
    named = {"x": xd, "weight": w, "bias": b, "residual": res}
    inputs = [named[k] for k in wants_grad]
    grads = dict(zip(wants_grad, torch.autograd.grad(y, inputs, dy.double()) if inputs else (), strict=True))
    return y.detach(), grads, rm, rv


def run_tritonbn(case, x, dy, mask, residual, bn):
    """``(y, grads)``: one call (under the case's grad mode), then its backward where anything needs a gradient."""
    grad_mode = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad,
                 "inference_mode": torch.inference_mode}[case["grad_mode"]]  # fmt: skip
    x = x.detach().requires_grad_(case["x_grad"])
    if residual is not None:
        residual = residual.detach().requires_grad_(case["x_grad"])
    with grad_mode():
        y = bn(x, residual, mask=mask)
    grads = {}
    if y.requires_grad:
        y.backward(dy)
        named = {"x": x, "weight": bn.weight, "bias": bn.bias, "residual": residual}
        grads = {k: t.grad for k, t in named.items() if t is not None and t.requires_grad}
    return y, grads


def close(what, actual, expected, tol, failures):
    if actual is None:
        failures.append(f"{what}: missing (expected shape {tuple(expected.shape)})")
        return
    if actual.shape != expected.shape:
        failures.append(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
        return
    try:
        torch.testing.assert_close(actual.detach().double().cpu(), expected.cpu(), atol=tol[0], rtol=tol[1])
    except AssertionError as error:
        failures.append(f"{what}: {' '.join(str(error).split())[:400]}")


def check(case):
    """``(outcome, detail)`` of one case: ``"OK"``, ``"RAISED"`` or ``"FAIL"``."""
    os.environ["TRITONBN_BACKEND"] = case["backend"]
    x, dy, mask, residual, bn = make_case(case)
    grad_mode = case["grad_mode"] == "grad"
    wants_grad = []
    if grad_mode and case["x_grad"]:
        wants_grad += ["x"] + (["residual"] if residual is not None else [])
    if grad_mode and case["affine"] and case["param_grad"]:
        wants_grad += ["weight", "bias"]
    try:
        want = oracle(case, x, dy, mask, residual, bn, wants_grad)
        torch_error = None
    except (ValueError, RuntimeError) as error:
        want, torch_error = None, error
    try:
        y, grads = run_tritonbn(case, x, dy, mask, residual, bn)
    except (ValueError, RuntimeError, TypeError) as error:
        message = f"{type(error).__name__}: {error}"
        if not any(name in str(error) for name in NAMES):
            return "FAIL", f"an error that names neither tritonbn nor an argument: {message}"
        if torch_error is not None:
            return "OK", f"raised as torch does: {message}"
        return "RAISED", message
    if torch_error is not None:
        return "FAIL", f"torch raises {type(torch_error).__name__}: {torch_error}; tritonbn gave an answer"
    y_want, grads_want, rm_want, rv_want = want
    dtype = x.dtype
    tol = TOLERANCES[dtype]
    failures = []
    if y.dtype != dtype:
        failures.append(f"y: dtype {y.dtype}, expected {dtype}")
    if case["layout"] != "sliced" and y.numel() and y.stride() != x.stride():  # the output keeps the input's layout
        failures.append(f"y: strides {y.stride()}, the input's {x.stride()}")
    close("y", y, y_want, tol, failures)
    if sorted(grads) != sorted(grads_want):
        failures.append(f"gradients of {sorted(grads)}, expected of {sorted(grads_want)}")
    count = max(1, y_want.numel() // y_want.shape[1])
    for name, want_grad in grads_want.items():
        param = name in ("weight", "bias")
        if param:  # sums over the batch, in the parameters' dtype
            ptol = max(tol, TOLERANCES[bn.weight.dtype])
            grad_tol = (10 * ptol[0] * count**0.5, 10 * ptol[1])
        else:
            grad_tol = (4 * tol[0], 4 * tol[1])
        close(f"d{name}", grads.get(name), want_grad, grad_tol, failures)
    if case["training"] and case["track"]:
        buffer_tol = (1e-5, 1e-4) if bn.running_mean.dtype == torch.float32 else TOLERANCES[bn.running_mean.dtype]
        close("running_mean", bn.running_mean, rm_want, buffer_tol, failures)
        if mask is None or int(mask.sum()) != 1:  # one real value: torch's unbiased variance divides by 0
            close("running_var", bn.running_var, rv_want, buffer_tol, failures)
    return ("FAIL", "; ".join(failures)) if failures else ("OK", "")


def main() -> None:
    cases = json.load(sys.stdin)
    for i, case in enumerate(cases):
        print("CASE", i, json.dumps(case), flush=True)
        try:
            outcome, detail = check(case)
        except Exception as error:  # noqa: BLE001 - any other exception is a failure of this case, not of the batch
            outcome, detail = "FAIL", f"unexpected {type(error).__name__}: {error}"
        print(outcome, i, " ".join(detail.split()), flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
