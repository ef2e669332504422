"""The crash hunt: no input kills the process (a signal) or hangs it, and each gives torch's answer or a clear error.

A Python test cannot catch a dead process, so the cases run in a child process (``tests/helpers/crash_hunt.py``),
a batch at a time (torch's start-up costs a second or two): the child prints each case before running it, and a
child that dies by a signal or stops answering fails the test with the case it was running. The child checks each
case against ``torch.nn.functional.batch_norm`` in float64 (see its docstring) and reports every outcome.

Hypothesis draws the batches, deterministically (``derandomize``), and without shrinking: the child names the case
that failed. The cases stress what the data path special-cases: zero-sized dimensions (N = 0, a spatial size of 0),
one value per channel (N x S = 1), masks (all padding, all real, random), the fused residual and activation, every
dtype, contiguous, channels_last and non-dense layouts, train and eval, with and without running statistics,
gradients of the input and/or the parameters, no_grad and inference_mode, on both backends (the PyTorch backend, and
the Triton kernels under the interpreter on CPU). The explicit examples hold the crashes found so far.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import sys
import threading

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

SCRIPT = pathlib.Path(__file__).parents[1] / "helpers" / "crash_hunt.py"
CASE_TIMEOUT_S = 60  # one case takes well under a second; longer is a hang
BATCH = 64  # cases per child process
# Drawn batches per backend: the kernels under the interpreter take one (their special cases, the empty and one-value
# shapes and the masks, are in the explicit examples, which both backends run in full).
BATCHES = {"torch": 3, "triton": 1}


@st.composite
def cases(draw, backend):
    ndim = draw(st.integers(2, 5))
    size = st.sampled_from([0, 1, 1, 2, 3])  # 0 and 1 often: empty batches and one value per channel
    shape = [draw(size), draw(st.integers(1, 3))] + [draw(size) for _ in range(ndim - 2)]
    layouts = ["contiguous", "sliced"] + (["channels_last"] * 2 if ndim >= 4 else [])
    dtype = draw(st.sampled_from(["float32", "float64", "float16", "bfloat16"]))
    return {
        "backend": backend,
        "shape": shape,
        "dtype": dtype,
        "layout": draw(st.sampled_from(layouts)),
        "training": draw(st.booleans()),
        "track": draw(st.sampled_from([True, True, False])),
        "affine": draw(st.sampled_from([True, True, False])),
        "param_dtype": draw(st.sampled_from(["float32", dtype])),
        "momentum": draw(st.sampled_from([0.1, None])),
        "x_grad": draw(st.booleans()),
        "param_grad": draw(st.booleans()),
        "grad_mode": draw(st.sampled_from(["grad", "grad", "no_grad", "inference_mode"])),
        "mask": draw(st.sampled_from([None, None, "random", "all_padding", "all_real"])),
        "residual": draw(st.booleans()),
        "activation": draw(st.sampled_from([None, "relu", "leaky_relu", "silu"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def case(backend, shape, training, **changes):
    """An explicit case: float32, contiguous, running statistics, every gradient, no mask or epilogue."""
    base = {"backend": backend, "shape": list(shape), "dtype": "float32", "layout": "contiguous", "training": training,
            "track": True, "affine": True, "param_dtype": "float32", "momentum": 0.1, "x_grad": True,
            "param_grad": True, "grad_mode": "grad", "mask": None, "residual": False, "activation": None,
            "seed": 0}  # fmt: skip
    return base | changes


def seeds(backend):
    """The explicit cases: the crashes found so far, then the edges around them."""
    return [
        case(backend, (0, 5, 9), False),  # SIGFPE: the eval backward of an empty batch (torch's native kernel)
        case(backend, (0, 5, 9), False, param_grad=False),
        case(backend, (0, 5, 9), False, x_grad=False),
        case(backend, (0, 3, 2, 2), False, layout="channels_last"),
        case(backend, (0, 3, 2, 2), False, dtype="bfloat16"),
        case(backend, (0, 3, 2, 2), False, dtype="float16", param_dtype="float16"),
        case(backend, (0, 3, 4), False, track=False),
        case(backend, (0, 3, 4), True),
        case(backend, (0, 3, 4), True, momentum=None),
        case(backend, (0, 3), True, dtype="float64", param_dtype="float64"),
        case(backend, (2, 3, 0, 1, 0), True),  # the kernels divided by an outer size 0 (the interpreter warns)
        case(backend, (2, 1, 0, 0, 1), True, layout="channels_last", mask="all_real", grad_mode="no_grad"),
        case(backend, (2, 3, 0), False),
        case(backend, (2, 3, 0), True),
        case(backend, (2, 3, 4, 0), True, layout="channels_last"),
        case(backend, (1, 3), True),  # one value per channel: torch raises
        case(backend, (1, 3, 1, 1), True, layout="channels_last"),
        case(backend, (1, 3), False, track=False),
        case(backend, (1, 3), False),
        case(backend, (2, 3, 4), True, mask="all_padding"),
        case(backend, (2, 3, 4), False, mask="all_padding", residual=True, activation="silu"),
        case(backend, (0, 3, 4), True, mask="all_padding"),
        case(backend, (1, 3, 1), True, mask="all_real"),
        case(backend, (0, 5, 9), False, residual=True, activation="relu"),
        case(backend, (0, 5, 9), True, residual=True, activation="leaky_relu"),
        case(backend, (0, 5, 9), False, grad_mode="no_grad"),
        case(backend, (0, 5, 9), False, grad_mode="inference_mode"),
        case(backend, (0, 5, 9), True, grad_mode="inference_mode"),
    ]


class Batch(list):
    """A batch of cases; hypothesis's report of a failing batch names its size only (the failure names the case)."""

    def __repr__(self):
        return f"<a batch of {len(self)} cases>"

    def _repr_pretty_(self, printer, cycle):  # what hypothesis's pretty printer calls
        printer.text(repr(self))


def _reader(stream, lines):
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def hunt(batch):
    """Run ``batch`` in a child process; fail on a signal, a hang, or a case whose outcome is not torch's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITONBN_BACKEND"}  # each case sets its own
    child = subprocess.Popen([sys.executable, str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    errors = []
    threading.Thread(target=lambda: errors.append(child.stderr.read()), daemon=True).start()
    lines = queue.Queue()
    threading.Thread(target=_reader, args=(child.stdout, lines), daemon=True).start()
    child.stdin.write(json.dumps(batch))
    child.stdin.close()
    running, outcomes, done = None, {}, False
    try:
        while True:
            try:
                line = lines.get(timeout=CASE_TIMEOUT_S)
            except queue.Empty:
                child.kill()
                raise AssertionError(f"hang: no answer in {CASE_TIMEOUT_S} s while running\n{running}") from None
            if line is None:
                break
            kind, _, rest = line.partition(" ")
            if kind == "CASE":
                running = rest.partition(" ")[2]
            elif kind in ("OK", "RAISED", "FAIL"):
                index, _, detail = rest.partition(" ")
                outcomes[int(index)] = (kind, detail)
                running = None
            elif kind == "DONE":
                done = True
    finally:
        returncode = child.wait()
    stderr = errors[0][-3000:] if errors else ""
    if returncode < 0:
        raise AssertionError(f"the process died by signal {-returncode} while running\n{running}\n{stderr}")
    assert returncode == 0 and done, f"the child failed (exit {returncode}) while running\n{running}\n{stderr}"
    assert len(outcomes) == len(batch)
    failures = [f"{json.dumps(batch[i])}\n    {detail}" for i, (kind, detail) in outcomes.items() if kind == "FAIL"]
    assert not failures, f"{len(failures)} of {len(batch)} cases failed:\n" + "\n".join(failures)


def _hunt_on(backend: str) -> type:
    class Hunt:
        @settings(max_examples=BATCHES[backend], deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(st.lists(cases(backend), min_size=BATCH, max_size=BATCH).map(Batch))
        @example(Batch(seeds(backend)))
        def test_crash_hunt(self, batch):
            hunt(batch)

    return Hunt


# One class per backend: under pytest-xdist's --dist loadscope the two run on different workers.
TestTorchBackend = _hunt_on("torch")
TestTritonBackend = _hunt_on("triton")
