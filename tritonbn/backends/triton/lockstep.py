"""The device side of :mod:`tritonbn.lockstep`: compare a summed message's identity slots, on the device, no host read.

A message ends with ``[S1 | S2]``, the sums over ``W`` ranks of each rank's ``[f | f*f]``. Every rank sent the same
``f`` exactly when ``S1 * S1 == W * S2`` (both sides exact in float64). Otherwise the kernel writes NaN over the whole
message, so the kernel that consumes it outputs NaN (and, a NaN count not being positive, the forward leaves the
running statistics alone), and notes ``code`` in ``flag`` unless an earlier mismatch is noted there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritonbn.backends.triton._launch import Launch


@triton.jit
def _check_message_kernel(
    # pointers
    message_ptr,  # (n,) fp64, the summed message, ending with [S1 | S2]
    flag_ptr,  # (1,) int64: 0, or the code of the first mismatched call
    # sizes
    n,
    world,
    code,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    """``message[:] = NaN`` and ``flag = flag or code`` where ``S1 * S1 != world * S2``."""
    s1 = tl.load(message_ptr + n - 2)
    s2 = tl.load(message_ptr + n - 1)
    if s1 * s1 != s2 * world:
        offs = tl.arange(0, BLOCK)
        nan = tl.full([BLOCK], float("nan"), tl.float64)
        for start in range(0, n, BLOCK):
            tl.store(message_ptr + start + offs, nan, mask=start + offs < n)
        old = tl.load(flag_ptr)
        tl.store(flag_ptr, tl.where(old == 0, code, old).to(tl.int64))


def check_launch(n: int, world: int, code: int) -> Launch:
    """The check of an ``n``-long message over ``world`` ranks, noting ``code``: ``launch(message, flag)``, one
    program, launched as the passes' kernels are (:mod:`~tritonbn.backends.triton._launch`: a few microseconds of
    host time once found). ``message`` is a fresh allocation, aligned; ``flag`` (torch's) is the pointer read."""
    return Launch(
        _check_message_kernel, (1, 1), (n, world, code), {"BLOCK": 1024}, num_warps=4, pointers=2, checked=(1,)
    )
