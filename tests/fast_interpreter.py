"""Make Triton's interpreter do less redundant work in the tests (about 3x faster kernels on CPU).

Two costs of the interpreter that the tests do not need, found with cProfile:

* Its integer-overflow sanitizer: every int32 add, subtract and multiply of a kernel is redone in
  int64 and checked, about half the interpreter's time. It guards index arithmetic against passing
  2^31; the tests' tensors have a few thousand elements, and the plans switch to int64 offsets
  themselves past 2^31 (tests/test_hardening.py forces that path with fake limits).
* Every call of a ``@triton.jit`` helper from a kernel patches ``triton.language`` again (looking
  every member up with ``inspect``), a millisecond per call. Within one launch those patches stay in
  place (only the launch's own patch is undone when it ends), so patching once per helper and
  launch does the same.

Nothing about what a kernel computes changes. :func:`install` is a no-op when the interpreter is not
the one these patches were written against (Triton 3.6 to 3.9), or not in use.
"""

from __future__ import annotations

import os


def install() -> bool:
    """Apply both patches; ``False`` (and nothing changed) when this Triton's interpreter differs."""
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
    ti.InterpretedFunction._tritonbn_fast = True
    return True
