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

**Packed planes.** A contiguous NCHW plane whose size has no factor of 8 (7x7 = 49, 14x14 = 196,
3x3 = 9) cannot be read in 16-byte vectors plane by plane: plane ``c`` starts at ``c * 49``
elements. ``PACK`` consecutive planes, though, are one contiguous run per sample that starts on a
16-byte boundary when ``PACK * H * W`` is a multiple of 8. For such inputs the plan is *packed*
(``PLANE = H * W``): a program owns ``PACK`` channels, and its tile is a ``[1, BLOCK_I]`` run of
``PACK * PLANE`` elements (up to 5% of the lanes idle) of one sample; lane ``f`` belongs to channel
``f // PLANE`` of the pack. The kernels broadcast per-channel values to the lanes once per program
(:func:`tritonbn.backends.triton._common.per_lane`) and reduce lanes to channels by a segmented scan
(:func:`tritonbn.backends.triton._common.store_partials`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch

from tritonbn.backends.triton._tiles import channels_fastest, inner_block, next_pow2, vector_hint

# The interpreter runs a numpy op per tile, so large tiles and few programs are fastest there;
# a GPU wants tiles of a few thousand elements and a few waves of programs.
_GPU_TILE = 2048
_CPU_TILE = 4096
_CPU_PROGRAMS = 4
# Elements of the [BLOCK_R, BLOCK_C] tile a merge reads at a time. The merge loop holds two such tiles
# (current and prefetched) of fp64: 1024 keeps the reducing kernels at <= 80 registers (24 warps per SM);
# 2048 took them to 98 (16 warps), which the main loop pays for (see benchmarks/kernel_audit.py).
_MERGE_TILE = 1024
# and at most this many rows of it: a [32, 32] tile (32-channel blocks) took Triton 3.6's backward
# reduction to 80 registers with a spill, and its statistics to 128; [16, 32] to 75 and 116, no spill.
_MERGE_ROWS = 16
# Programs per SM a CUDA plan is made for before its kernel is compiled, and the most a fitted plan
# asks for. A launch fits its plan to the compiled kernel's occupancy before its first launch (see
# tritonbn.backends.triton._launch.Launch): then the grid is one wave, every program resident at once. No
# fitted plan needs more tickets or scratch than the unfitted one, which the first call sized.
_PROGRAMS_PER_SM = 8
# Up to this many programs per channel block, or while their partials (two float64 per channel and
# program) are at most _FLAT_MERGE_BYTES, the last one merges them all (one level); past both, the merge
# is two-level, in groups of about sqrt(programs) (see _common.merge_tree). Each level puts a barrier,
# an atomic and a dependent load after the last main loop. 64 KB is the tail the kernel audit's test
# holds a one-level merge to (tests/kernels/test_kernel_audit.py); at the ~150 GB/s one SM reads from L2 (the
# audit's time model assumes it) that is about what a level costs (0.44 us against ~0.5 us).
_FLAT_MERGE = 16
_FLAT_MERGE_BYTES = 64 * 1024
# Channels per program of a channels_last reduction (its partials' width): the merge tail reads
# partials of r_progs * BLOCK_C, and r_progs = programs / (C / BLOCK_C), so the tail grows as BLOCK_C
# squared. 32 channels, torch's own tile width for its channels_last reductions (OPTIMAL_TILE_W in
# Normalization.cuh), keep runs of 64 bytes in bf16 and let one level merge a wave of programs for
# C >= 128 on an H100/H200; the elementwise kernels, which do not merge, keep 128, and so does the
# interpreter, whose merges are of at most _CPU_PROGRAMS partials and whose cost is per program.
_MERGE_BLOCK_C = 32
_INT32_MAX = 2**31 - 1
_PACK_ALIGN = 8  # elements a packed run starts on: 16 bytes of fp16/bf16, 32 of fp32
_NO_MASK = (0, 0, 0, 0, 0)  # the mask strides of an unmasked plan (its kernels do not read them)


@functools.cache
def _sm_count(index: int) -> tuple[int, int, int]:
    """SMs (CUs on ROCm), the warp (wavefront) size and the compute capability (``major * 10 + minor``,
    0 on ROCm) of a GPU."""
    props = torch.cuda.get_device_properties(index)
    arch = 0 if torch.version.hip else props.major * 10 + props.minor
    return props.multi_processor_count, getattr(props, "warp_size", 32), arch


# Set by :func:`planned_as`: plan every launch as if it ran on this kind of device.
_planned_as: tuple[str, int, int, int] | None = None


@contextlib.contextmanager
def planned_as(device_type: str = "cuda", sm_count: int = 132, warp_size: int = 32, arch: int = 90):
    """Plan launches as a ``device_type`` device with ``sm_count`` SMs would, whatever the tensors' device.

    For tools that read the compiled code without a GPU (``benchmarks/kernel_audit.py``): the
    tensors stay on CPU, the tiles and grid are those a CUDA device (default: an H100/H200's 132
    SMs, compute capability ``arch`` 9.0) would get; ``warp_size=64``, ``arch=0`` for an AMD GPU.
    """
    global _planned_as
    old, _planned_as = _planned_as, (device_type, sm_count, warp_size, arch)
    clear_caches()
    try:
        yield
    finally:
        _planned_as = old
        clear_caches()


def planned_target() -> tuple[int, int]:
    """``(warp size, compute capability)`` :func:`planned_as` plans for (``(32, 90)`` outside it)."""
    return _planned_as[2:] if _planned_as is not None else (32, 90)


def _device_kind(device: torch.device) -> tuple[str, int, int, int]:
    """``(device type, SM count, warp size, arch)`` the plan is made for (a program has 256 or 128 threads)."""
    if _planned_as is not None:
        return _planned_as
    if device.type == "cuda":
        return "cuda", *_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return device.type, 0, 32, 0


def _target_programs(kind: tuple, per_sm: int | None) -> int:
    if kind[0] == "cuda":
        return min(per_sm or _PROGRAMS_PER_SM, _PROGRAMS_PER_SM) * kind[1]
    return _CPU_PROGRAMS


def fits_occupancy(device: torch.device) -> bool:
    """Whether launches on ``device`` are planned for a GPU, and so fit their grid to the kernel's occupancy."""
    return _device_kind(device)[0] == "cuda"


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
    VEC: int  # divides INNER and every channel and outer stride (see _tiles.vector_hint)
    BLOCK_R: int  # rows of partials the last program merges at a time
    PLANE: int  # packed plans: the plane size (lanes per channel); 0 otherwise
    PACK: int  # channels per program: PACK of the BLOCK_C per-channel slots (BLOCK_C when not packed)
    GATHER: bool  # packed statistics: lanes to channels by a gather, not a per-lane store (see _gathers)
    G: int  # programs per merge subtree: r_progs when the merge is one level (see _merge_subtree)
    # What every kernel takes, computed once per plan:
    size_args: tuple[int, ...]  # (C, O1, O2, INNER / VEC, inner_tiles, tiles, tiles_per_prog)
    stride_args: tuple[int, ...]  # per tensor: (s_c, s_o0, s_o1, s_o2) / VEC, then s_i; zeros for no mask
    masked: bool = False  # the last tensor is a mask (channel stride 0, see plan)

    @property
    def channels_fastest(self) -> bool:
        """Whether every tensor's channels are contiguous (channels_last) and the inner dim is not."""
        return channels_fastest(self.strides[:-1] if self.masked else self.strides)

    @property
    def grid(self) -> tuple[int, int]:
        return (self.c_blocks, self.r_progs)

    @property
    def merge_subtrees(self) -> int:
        """Level-2 partial rows per channel block (1 when the merge is one level)."""
        return -(-self.r_progs // self.G)

    @property
    def merge_tickets(self) -> int:
        """Ticket counters a reducing launch takes: a top counter and one per group, per channel block."""
        return self.c_blocks * (self.merge_subtrees + 1)

    @property
    def merge_scratch(self) -> int:
        """float64 scratch values of a reducing launch: ``(2, r_progs, C)`` partials, then ``(2, groups, C)``."""
        return 2 * (self.r_progs + self.merge_subtrees) * self.C


# Caches of launch settings that the launchers key by shape, strides and dtypes (see
# tritonbn.backends.triton._launch). They hold plans, so whatever changes plans clears them too.
_launch_caches: list[dict] = []
_CACHE_SIZE = 4096


def launch_cache() -> dict:
    """A new cache of launch settings, cleared with the plans (:func:`clear_caches`)."""
    cache: dict = {}
    _launch_caches.append(cache)
    return cache


def cache_put(cache: dict, key, value):
    """Store ``value`` under ``key`` in a launch cache, emptying it first when it is full; returns ``value``."""
    if len(cache) >= _CACHE_SIZE:
        cache.clear()
    cache[key] = value
    return value


# How many times the caches were cleared: what a layer keeps of them (``_prepared.Prepared``) is stale when it changes.
generation = 0


def clear_caches() -> None:
    """Forget every plan and every launch built on one (after the planning constants change)."""
    global generation
    generation += 1
    _plan_cached.cache_clear()
    for cache in _launch_caches:
        cache.clear()


def plan(
    shape: torch.Size | tuple[int, ...],
    *tensors: torch.Tensor,
    tile_scale: int = 1,
    per_sm: int | None = None,
    merges: bool = False,
    mask: torch.Tensor | None = None,
) -> Plan:
    """Fold the reduction space of ``shape`` jointly for ``tensors`` and choose blocks and grid.

    All ``tensors`` have the logical ``shape`` ``(N, C, *S)``; they may have different strides.
    Plans are cached by shape, strides and device. ``tile_scale`` multiplies the tile: a read-only
    reduction (the forward statistics) takes twice the elements per thread, which spreads its loop
    overhead over more elements. ``per_sm``: the programs one SM of a CUDA device holds at once (the
    compiled kernel's occupancy): the reduction is then split into at most one wave of programs.
    ``merges``: the plan of a reducing kernel, whose programs' partials are merged after the main
    loops: a channels_last one for a GPU takes narrower channel blocks (``_MERGE_BLOCK_C``).

    ``mask``: masked BatchNorm's ``(N, C, *S)`` view of its ``(N, *S)`` mask (channel stride 0), folded
    with the rest; its strides come last in ``stride_args``. It takes no part in choosing the tile
    (a channels_last plan stays one) and rules out packed planes, whose lanes span channels; its lanes
    span the inner dim up to 1024 (idle ones included: a tile of many channels and a few lanes would hold
    too many per-channel values, over 128 registers in the statistics kernel at 7x7). Without
    it ``stride_args`` ends in five zeros, what the kernels take for a mask they do not read.
    """
    if len(shape) < 2:
        raise ValueError(f"expected an input of shape (N, C, *S), got shape {tuple(shape)}")
    kind = _device_kind(tensors[0].device)
    strides = tuple([t.stride() for t in tensors])
    if mask is not None:
        return _plan_cached(tuple(shape), (*strides, mask.stride()), kind, tile_scale, per_sm, merges, True)
    return _plan_cached(tuple(shape), strides, kind, tile_scale, per_sm, merges)


@functools.lru_cache(maxsize=4096)
def _plan_cached(
    shape: tuple[int, ...],
    all_strides: tuple[tuple[int, ...], ...],
    kind: tuple,
    tile_scale: int = 1,
    per_sm: int | None = None,
    merges: bool = False,
    masked: bool = False,
) -> Plan:
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
    # The outermost real dim is o0, which the kernels get without a division; unused dims have size 1.
    outer_dims = outer_dims + [(1, [0] * len(all_strides))] * (3 - len(outer_dims))
    (o0, s0), (o1, s1), (o2, s2) = outer_dims
    if o1 == 0 or o2 == 0:  # nothing to reduce: the kernels' index math (_common.tile_offsets) divides by o1 and o2,
        o0, o1, o2 = 0, 1, 1  # even for the tile they prefetch before a loop of no tiles; o0 is never divided by
    outer = o0 * o1 * o2
    strides = tuple((st[1], s0[k], s1[k], s2[k], inner_strides[k]) for k, st in enumerate(all_strides))

    tile = (_GPU_TILE if kind[0] == "cuda" else _CPU_TILE) * tile_scale
    max_offset = 0
    if all(shape):
        max_offset = max(sum((size - 1) * abs(s) for size, s in zip(shape, st, strict=True)) for st in all_strides)
    # A packed tile stays at one tile's lanes even for the statistics: their segmented scan, in fp64,
    # would need more than 128 registers at twice that.
    packed = None
    if not masked:
        packed = _packed(C, o0, o1 * o2, inner_size, strides, tile // tile_scale, kind, max_offset, per_sm)
    if packed is not None:
        return packed
    c_pow2 = next_pow2(C)
    if channels_fastest(strides[:-1] if masked else strides):  # channels_last: lanes along C are contiguous
        BLOCK_C = min(c_pow2, _MERGE_BLOCK_C if merges and kind[0] == "cuda" else 128)
        BLOCK_I = max(1, min(next_pow2(inner_size), tile // BLOCK_C))
    else:  # NCHW and the rest: lanes along the inner dim (a masked plan's always span it: see plan)
        BLOCK_I = inner_block(inner_size, min(1024, tile)) if not masked else min(next_pow2(inner_size), 1024, tile)
        BLOCK_C = max(1, min(c_pow2, tile // BLOCK_I))
    c_blocks = -(-C // BLOCK_C)
    inner_tiles = max(1, -(-inner_size // BLOCK_I))
    tiles = outer * inner_tiles if inner_size else 0
    r_progs, tiles_per_prog = _split(tiles, c_blocks, kind, per_sm)
    G = _merge_subtree(r_progs, min(C, BLOCK_C))
    VEC = vector_hint(inner_size, strides)
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
        # 8 elements per thread and tensor (16 for a scaled tile) when the tile is full; a tile that C
        # or the inner size cut short gets 4 warps (of 32 threads: half as many wavefronts of 64 on AMD).
        num_warps=(8 if BLOCK_C * BLOCK_I >= 2048 * tile_scale else 4) * 32 // kind[2],
        VEC=VEC,
        BLOCK_R=_merge_rows(G, BLOCK_C),
        PLANE=0,
        PACK=BLOCK_C,
        GATHER=False,
        G=G,
        size_args=(C, o1, o2, inner_size // VEC, inner_tiles, tiles, tiles_per_prog),
        stride_args=tuple(x for st in strides for x in (st[0] // VEC, st[1] // VEC, st[2] // VEC, st[3] // VEC, st[4]))
        + (() if masked else _NO_MASK),
        masked=masked,
    )


def _split(tiles: int, c_blocks: int, kind: tuple, per_sm: int | None) -> tuple[int, int]:
    """``(r_progs, tiles_per_prog)``: the programs along the reduction and the tiles each walks.

    With the occupancy known (``per_sm``), the grid is at most one wave (unless the channel blocks
    alone are more); otherwise at least the target.
    """
    target = _target_programs(kind, per_sm)
    r_progs = max(1, min(tiles, target // c_blocks if per_sm else -(-target // c_blocks)))
    tiles_per_prog = max(1, -(-tiles // r_progs))
    return max(1, -(-tiles // tiles_per_prog)), tiles_per_prog  # drop programs that would get no tile


def _merge_subtree(r_progs: int, channels: int) -> int:
    """Programs per merge subtree: all of them up to ``_FLAT_MERGE``, or while their partials of ``channels``
    channels each fit ``_FLAT_MERGE_BYTES``; else ``ceil(sqrt(r_progs))``, which makes the serial tail
    (a group, then at most as many level-2 rows) about ``2 sqrt(r_progs)`` rows."""
    if r_progs <= _FLAT_MERGE or 2 * 8 * r_progs * channels <= _FLAT_MERGE_BYTES:
        return max(1, r_progs)
    return math.isqrt(r_progs - 1) + 1


def _merge_rows(group: int, BLOCK_C: int) -> int:
    """Rows of partials merged at a time, in a ``[BLOCK_R, BLOCK_C]`` tile: a group's rows (and at most as
    many level-2 rows) in one step where the tile allows."""
    return max(1, min(next_pow2(group), _MERGE_TILE // BLOCK_C, _MERGE_ROWS))


def _packed(C, outer, extra_outer, plane, strides, tile, kind, max_offset, per_sm) -> Plan | None:
    """The packed plan (see the module docstring) when it gives 16-byte vectors that planes alone
    cannot, else ``None``.

    It needs every tensor's planes contiguous and back to back (``stride_c == H * W``, unit inner
    stride), at most one outer dim (``N``) with a stride divisible by 16, ``C`` a multiple of the
    smallest aligned pack, and a pack that fits a tile. The kernels take the outer strides as they
    are (not divided by ``VEC``): Triton's divisibility-by-16 specialization of integer arguments
    shows their alignment, and the loop steps by a stride it reads straight from the constant bank.
    """
    if extra_outer != 1 or plane < 2 or C < 2 or vector_hint(plane, strides) >= _PACK_ALIGN:
        return None
    if not all(s[4] == 1 and s[0] == plane for s in strides):
        return None
    g_min = _PACK_ALIGN // math.gcd(plane, _PACK_ALIGN)
    group = (tile // plane) // g_min * g_min
    if group == 0 or C % g_min:
        return None
    if group >= C:  # every channel in one pack: a tile just large enough
        group, tile = C, next_pow2(C * plane)
    outer_strides = [s[1] for s in strides] if outer > 1 else []
    if any(s % 16 for s in outer_strides):  # Triton's own divisibility-by-16 hint must hold for them
        return None
    vec = 16  # what the masks change by: the run of a pack, and of the last one
    for v in (group * plane, C * plane):
        while v % vec:
            vec //= 2
    BLOCK_C = next_pow2((tile - 1) // plane + 1)  # a slot for the channel of every lane, idle ones included
    c_blocks = -(-C // group)
    tiles = outer
    r_progs, tiles_per_prog = _split(tiles, c_blocks, kind, per_sm)
    G = _merge_subtree(r_progs, group)
    return Plan(
        C=C,
        O1=1,
        O2=1,
        INNER=group * plane,
        outer=outer,
        strides=tuple((s[0], s[1] if outer > 1 else 0, 0, 0, 1) for s in strides),
        BLOCK_C=BLOCK_C,
        BLOCK_I=tile,
        c_blocks=c_blocks,
        inner_tiles=1,
        tiles=tiles,
        r_progs=r_progs,
        tiles_per_prog=tiles_per_prog,
        use_int64=max_offset > _INT32_MAX or tiles * tile > _INT32_MAX,
        num_warps=(8 if tile >= _GPU_TILE else 4) * 32 // kind[2],
        VEC=vec,
        BLOCK_R=_merge_rows(G, BLOCK_C),
        PLANE=plane,
        PACK=group,
        GATHER=_gathers(kind),
        G=G,
        size_args=(C, 1, 1, group * plane // vec, 1, tiles, tiles_per_prog),
        # As they are: a tile starts at o * stride_o0 + pid_c * PACK * PLANE (see _common.tile_rows),
        # whose alignment Triton sees from its hint on the stride and from the constexprs.
        stride_args=tuple(x for s in strides for x in (1, s[1] if outer > 1 else 0, 0, 0, 1)) + _NO_MASK,
    )


def _gathers(kind: tuple) -> bool:
    """Whether a packed statistics kernel gathers its channels' sums out of the lane scan (all but sm_90) or
    stores each from its last lane: a store over all BLOCK_I lanes, whose addresses and masks stay live across
    the fp64 scan (sm_80, sm_89: 128 registers and spills; sm_100: 150; the gather: 80 to 100). sm_90 keeps
    its audited 114 until a GPU compares the two there (the gather compiles to 80)."""
    return kind[3] != 90
