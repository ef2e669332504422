"""Make Triton's interpreter do less redundant work in the tests (about 3x faster kernels on CPU).

Three costs of the interpreter that the tests do not need, found with cProfile:

* Its integer-overflow sanitizer: every int32 add, subtract and multiply of a kernel is redone in
  int64 and checked, about half the interpreter's time. It guards index arithmetic against passing
  2^31; the tests' tensors have a few thousand elements, and the plans switch to int64 offsets
  themselves past 2^31 (tests/autograd/test_hardening.py forces that path with fake limits).
* Every call of a ``@triton.jit`` helper from a kernel patches ``triton.language`` again (looking
  every member up with ``inspect``), a millisecond per call. Within one launch those patches stay in
  place (only the launch's own patch is undone when it ends), so patching once per helper and
  launch does the same.
* A scan with a combine function of its own (not a plain sum or product) runs element by element,
  the combine called in Python for each: about 80 µs an element. The packed plans' segmented sum
  (``tritonbn.kernels._common._segmented_add``) scanned 4096 lanes that way took 1.3 s of a 1.5 s
  training step at ``(2, 64, 7, 7)``. Its scan is done instead by NumPy, one cumulative sum per
  segment: the same left-to-right additions, so the same bits.

Nothing about what a kernel computes changes. :func:`install` is a no-op when the interpreter is not
the one these patches were written against (Triton 3.6 to 3.9), or not in use.
"""

from __future__ import annotations

import os


def install() -> bool:
    """Apply the patches; ``False`` (and nothing changed) when this Triton's interpreter differs."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    needed = ("InterpreterOptions", "GridExecutor", "InterpretedFunction", "InterpreterError", "interpreter_builder")
    if not all(hasattr(ti, name) for name in needed) or getattr(ti.InterpretedFunction, "_tritonbn_fast", False):
        return False
    if "sanitize_overflow" not in getattr(ti.InterpreterOptions, "__dataclass_fields__", {}):
        return False
    ti.interpreter_builder.options = ti.InterpreterOptions(sanitize_overflow=False)

    launches = [0]  # a counter of launches: a helper patches triton.language once per launch
    run_launch = ti.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        launches[0] += 1
        return run_launch(self, *args, **kwargs)

    call_helper = ti.InterpretedFunction.__call__

    def helper(self, *args, **kwargs):
        if self.__dict__.get("_tritonbn_launch") != launches[0]:
            self._tritonbn_launch = launches[0]
            return call_helper(self, *args, **kwargs)  # patches triton.language, then calls
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = helper
    scan_ops = getattr(ti, "ScanOps", None)
    if scan_ops is not None and hasattr(scan_ops, "generic_scan") and hasattr(scan_ops, "to_tensor"):
        generic_scan = scan_ops.generic_scan

        def scan(self, input):
            if getattr(getattr(self.combine_fn, "fn", None), "__qualname__", None) != "_segmented_add":
                return generic_scan(self, input)
            return _segmented_scan(self, input)

        scan_ops.generic_scan = scan
    ti.InterpretedFunction._tritonbn_fast = True
    return True


def _segmented_scan(ops, input):
    """``_segmented_add``'s scan of ``(starts, values)`` along ``ops.axis``, in NumPy.

    The element-by-element scan computes ``out[i] = v[i] if starts[i] else out[i - 1] + v[i]`` (and
    ``out[0] = v[0]``) and ORs the flags; here each segment's values get one ``np.cumsum``, which adds
    left to right in the values' dtype, as the element-by-element scan does.
    """
    import itertools

    import numpy as np

    starts, values = (arg.handle.data for arg in input)
    flags = np.moveaxis(starts, ops.axis, -1)
    data = np.moveaxis(values, ops.axis, -1)
    sums = np.empty_like(data)
    for index in np.ndindex(data.shape[:-1]):
        row, out = data[index], sums[index]
        bounds = [0, *np.flatnonzero(flags[index][1:]) + 1, row.shape[0]]
        for lo, hi in itertools.pairwise(bounds):
            np.cumsum(row[lo:hi], out=out[lo:hi])
    ored = np.bitwise_or.accumulate(starts, axis=ops.axis)
    return [ops.to_tensor(ored, input[0].dtype), ops.to_tensor(np.moveaxis(sums, -1, ops.axis), input[1].dtype)]
