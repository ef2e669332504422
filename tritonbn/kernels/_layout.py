"""How the kernels see a tensor: one channel axis and a strided reduction space.

Every kernel treats its input as ``(N, C, *S)`` with arbitrary strides. The reduction space is
``(N, *S)``. :func:`plan` folds it, jointly for every tensor a kernel touches, into at most three
*outer* dims and one *inner* dim, merging neighbours whose strides line up in all of them:

* contiguous NCHW: outer ``N`` (stride ``C*H*W``), inner ``H*W`` (stride 1);
* channels_last / channels_last_3d: no outer dim at all, inner ``N*H*W`` (stride ``C``);
* 2-D ``(N, C)``: inner ``N`` (stride ``C``);
* anything else (a permute, a slice): up to three outer dims and the innermost as the inner dim.

A kernel walks ``[BLOCK_C, BLOCK_I]`` tiles: a block of channels by a block of the inner dim, at
one outer index. Tiles are numbered ``t = outer * inner_tiles + inner_tile`` and split into
contiguous chunks, one chunk per program along grid axis 1, so the reduction runs in parallel
over channels (axis 0) *and* over ``N*S`` (axis 1). No ``.contiguous()`` copy is ever made.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

# The interpreter runs a numpy op per tile, so large tiles and few programs are fastest there;
# a GPU wants tiles of a few thousand elements and a few waves of programs.
_GPU_TILE = 2048
_CPU_TILE = 4096
_CPU_PROGRAMS = 4
_PROGRAMS_PER_SM = 4
_INT32_MAX = 2**31 - 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Set by :func:`planned_as`: plan every launch as if it ran on this kind of device.
_planned_as: tuple[str, int] | None = None


@contextlib.contextmanager
def planned_as(device_type: str = "cuda", sm_count: int = 132):
    """Plan launches as a ``device_type`` device with ``sm_count`` SMs would, whatever the tensors' device.

    For tools that read the compiled code without a GPU (``benchmarks/kernel_audit.py``): the
    tensors stay on CPU, the tiles and grid are those a CUDA device (default: an H100/H200's 132
    SMs) would get.
    """
    global _planned_as
    old, _planned_as = _planned_as, (device_type, sm_count)
    _plan.cache_clear()
    try:
        yield
    finally:
        _planned_as = old
        _plan.cache_clear()


def _device_kind(device: torch.device) -> tuple[str, int]:
    """``(device type, SM count)`` the plan is made for."""
    if _planned_as is not None:
        return _planned_as
    if device.type == "cuda":
        return "cuda", _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return device.type, 0


def _target_programs(kind: tuple[str, int]) -> int:
    if kind[0] == "cuda":
        return _PROGRAMS_PER_SM * kind[1]
    return _CPU_PROGRAMS


@dataclass(frozen=True)
class Plan:
    """Sizes, per-tensor strides and launch settings shared by the kernels of one pass.

    ``strides[k]`` is ``(stride_c, stride_o0, stride_o1, stride_o2, stride_i)`` for the k-th
    tensor given to :func:`plan`.
    """

    C: int
    O1: int  # outer dims are (O0, O1, O2); O0 is implied by the tile count
    O2: int
    INNER: int
    outer: int  # O0 * O1 * O2
    strides: tuple[tuple[int, int, int, int, int], ...]
    BLOCK_C: int
    BLOCK_I: int
    c_blocks: int
    inner_tiles: int
    tiles: int
    r_progs: int  # programs along the reduction (grid axis 1)
    tiles_per_prog: int
    use_int64: bool
    num_warps: int

    @property
    def grid(self) -> tuple[int, int]:
        return (self.c_blocks, self.r_progs)


def plan(shape: torch.Size | tuple[int, ...], *tensors: torch.Tensor) -> Plan:
    """Fold the reduction space of ``shape`` jointly for ``tensors`` and choose blocks and grid.

    All ``tensors`` have the logical ``shape`` ``(N, C, *S)``; they may have different strides.
    Plans are cached by shape, strides and device.
    """
    if len(shape) < 2:
        raise ValueError(f"expected an input of shape (N, C, *S), got shape {tuple(shape)}")
    kind = _device_kind(tensors[0].device)
    return _plan(tuple(int(d) for d in shape), tuple(t.stride() for t in tensors), kind)


@functools.lru_cache(maxsize=4096)
def _plan(shape: tuple[int, ...], all_strides: tuple[tuple[int, ...], ...], kind: tuple[str, int]) -> Plan:
    C = shape[1]
    # Reduction dims: N then the spatial dims, as (size, [stride per tensor]).
    dims = [(shape[0], [st[0] for st in all_strides])]
    dims += [(shape[d], [st[d] for st in all_strides]) for d in range(2, len(shape))]
    dims = [d for d in dims if d[0] != 1]
    merged: list[tuple[int, list[int]]] = []
    for size, strides in dims:
        if merged:
            psize, pstrides = merged[-1]
            if all(ps == s * size for ps, s in zip(pstrides, strides, strict=True)):
                merged[-1] = (psize * size, strides)
                continue
        merged.append((size, strides))
    if not merged:
        merged = [(1, [0] * len(all_strides))]
    if len(merged) > 4:  # cannot happen for inputs of rank <= 5
        raise ValueError(f"tritonbn supports inputs of rank 2 to 5, got shape {tuple(shape)}")
    inner_size, inner_strides = merged[-1]
    outer_dims = merged[:-1]
    outer_dims = [(1, [0] * len(all_strides))] * (3 - len(outer_dims)) + outer_dims
    (o0, s0), (o1, s1), (o2, s2) = outer_dims
    outer = o0 * o1 * o2
    strides = tuple((st[1], s0[k], s1[k], s2[k], inner_strides[k]) for k, st in enumerate(all_strides))

    tile = _GPU_TILE if kind[0] == "cuda" else _CPU_TILE
    c_pow2 = _next_pow2(C)
    i_pow2 = _next_pow2(inner_size)
    channels_fastest = all(s[0] == 1 for s in strides) and not all(s[4] == 1 for s in strides)
    if channels_fastest:  # channels_last: lanes along C are contiguous
        BLOCK_C = min(c_pow2, 128)
        BLOCK_I = max(1, min(i_pow2, tile // BLOCK_C))
    else:  # NCHW and the rest: lanes along the inner dim
        BLOCK_I = min(i_pow2, 1024, tile)
        BLOCK_C = max(1, min(c_pow2, tile // BLOCK_I))
    c_blocks = -(-C // BLOCK_C)
    inner_tiles = -(-inner_size // BLOCK_I)
    tiles = outer * inner_tiles
    r_progs = max(1, min(tiles, -(-_target_programs(kind) // c_blocks)))
    tiles_per_prog = max(1, -(-tiles // r_progs))
    r_progs = max(1, -(-tiles // tiles_per_prog))  # drop programs that would get no tile

    max_offset = 0
    if all(shape):
        max_offset = max(sum((size - 1) * abs(s) for size, s in zip(shape, st, strict=True)) for st in all_strides)
    return Plan(
        C=C,
        O1=o1,
        O2=o2,
        INNER=inner_size,
        outer=outer,
        strides=strides,
        BLOCK_C=BLOCK_C,
        BLOCK_I=BLOCK_I,
        c_blocks=c_blocks,
        inner_tiles=inner_tiles,
        tiles=tiles,
        r_progs=r_progs,
        tiles_per_prog=tiles_per_prog,
        use_int64=max_offset > _INT32_MAX or tiles * BLOCK_I > _INT32_MAX,
        num_warps=4 if BLOCK_C * BLOCK_I <= 2048 else 8,
    )
