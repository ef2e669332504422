"""Tile shapes: the inner block and the vector width a plan takes (see :mod:`tritonbn.backends.triton._plan`)."""

from __future__ import annotations


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def channels_fastest(strides: tuple[tuple[int, ...], ...]) -> bool:
    """Whether every tensor's channels are contiguous (channels_last) and the inner dim is not."""
    return all(s[0] == 1 for s in strides) and not all(s[4] == 1 for s in strides)


def inner_block(inner: int, cap: int) -> int:
    """The inner block for lanes along a contiguous inner dim: the largest power of two up to ``cap``
    that pads ``inner`` by less than 5% (so a 7x7 plane, 49 elements, gets 25 blocks of 2 lanes,
    not one block of 64 lanes with 15 idle), or the one that pads least when none does.
    """
    if inner <= 1:
        return 1
    best, best_waste = 1, 1.0
    b = 1
    while b <= min(cap, next_pow2(inner)):
        waste = (-(-inner // b) * b - inner) / inner
        if waste < 0.05:
            best, best_waste = b, 0.0
        elif best_waste > 0.0 and waste < best_waste:
            best, best_waste = b, waste
        b *= 2
    return best


def vector_hint(inner: int, strides: tuple[tuple[int, ...], ...]) -> int:
    """The largest power of two (at most 16) that divides ``inner`` and every channel and outer stride,
    when every tensor's inner dim is contiguous; else 1.

    The kernels take those sizes and strides divided by ``VEC`` and multiply them back by the
    constexpr ``VEC``, so Triton can prove each tile row starts on a ``VEC``-element boundary and
    masks change only every ``VEC`` lanes: vector loads and stores for planes such as 14x14 (196 =
    4 * 49), whose sizes Triton's divisible-by-16 specialization cannot see.
    """
    if not all(s[4] == 1 for s in strides):
        return 1
    vec = 16
    for v in (inner, *(x for s in strides for x in s[:4])):
        while vec > 1 and v % vec:
            vec //= 2
    return vec
