"""What the kernel audit reads of an AMD kernel (gfx90a, gfx942): LLVM's AMDGCN assembly, as Triton's HIP backend
compiles it without a GPU (``triton.compile(..., target=GPUTarget("hip", arch, 64))``).

* registers: ``; TotalNumVgprs:`` (architectural and accumulation VGPRs: one file on CDNA2/CDNA3), per lane;
* spills: ``.vgpr_spill_count`` VGPRs (4 bytes each a lane, to scratch) and ``; ScratchSize:`` (bytes a lane);
  SGPR spills go to VGPR lanes, not memory, and are reported apart;
* occupancy: waves per SIMD by ``tritonbn.kernels._launch.CDNA`` (what the fit on ROCm assumes), beside LLVM's own
  ``; Occupancy:`` (waves per SIMD), which the audit checks it against;
* the main loop: the innermost loop (a backward ``s_branch``/``s_cbranch_*`` to a ``.LBB`` label) with the most
  global loads; its widest global load and store (``global_load_dwordx4`` is 128 bits) and its instructions per
  element. Round trips per iteration are not read on AMD (the NVIDIA audit reads them from SASS scoreboards).
"""

from __future__ import annotations

import re

from tritonbn.kernels._launch import CDNA, resident_limits

_LABEL = re.compile(r"^(\.LBB\d+_\d+):")
_BRANCH = re.compile(r"^\s+s_(?:c?branch)\w*\s+(\.LBB\d+_\d+)")
_WIDTH = {"dwordx4": 128, "dwordx3": 96, "dwordx2": 64, "dword": 32, "short": 16, "ushort": 16, "sshort": 16,
          "short_d16": 16, "short_d16_hi": 16, "ubyte": 8, "sbyte": 8, "byte": 8}  # fmt: skip


def _meta(text: str, pattern: str) -> int | None:
    m = re.search(pattern, text, re.M)
    return int(m.group(1)) if m else None


def _width(op: str) -> int:
    suffix = op.split("_", 2)[2] if op.count("_") >= 2 else ""
    return _WIDTH.get(suffix, 32)


def instructions(text: str) -> tuple[list[str], dict[str, int]]:
    """The instruction lines of the kernel (opcode first) and each label's index among them."""
    insns, labels = [], {}
    for line in text.splitlines():
        if m := _LABEL.match(line):
            labels[m.group(1)] = len(insns)
            continue
        stripped = line.strip()
        if not stripped or stripped[0] in ".;" or stripped.endswith(":") or not line.startswith(("\t", " ")):
            continue
        insns.append(stripped)
    return insns, labels


def main_loop(insns: list[str], labels: dict[str, int]) -> tuple[int, int] | None:
    loops = []
    for i, ins in enumerate(insns):
        if (m := _BRANCH.match("\t" + ins)) and labels.get(m.group(1), i + 1) <= i:
            loops.append((labels[m.group(1)], i))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    if not inner:
        return None
    best = max(inner, key=lambda lp: sum(_is_load(x) for x in insns[lp[0] : lp[1] + 1]))
    return best if any(_is_load(x) for x in insns[best[0] : best[1] + 1]) else None


def _is_load(ins: str) -> bool:
    return ins.startswith(("global_load_", "buffer_load_"))


def _is_store(ins: str) -> bool:
    return ins.startswith(("global_store_", "buffer_store_"))


def read(kernel, num_warps: int, elements_per_thread: float) -> dict:
    """An audit row's register, spill, occupancy and main-loop fields for one compiled HIP kernel."""
    text = kernel.asm["amdgcn"]
    vgprs = _meta(text, r"; TotalNumVgprs:\s*(\d+)") or _meta(text, r"\.vgpr_count:\s*(\d+)")
    spilled = _meta(text, r"\.vgpr_spill_count:\s*(\d+)") or 0
    shared = int(kernel.metadata.shared)
    limits = resident_limits(vgprs, num_warps, shared, CDNA)
    limiter = min(limits, key=limits.get)
    insns, labels = instructions(text)
    loop = main_loop(insns, labels)
    body = insns[loop[0] : loop[1] + 1] if loop else []
    loads = [x.split()[0] for x in body if _is_load(x)]
    stores = [x.split()[0] for x in body if _is_store(x)]
    return {
        "merge_loops": None,
        "tail_round_trips": None,
        "registers": vgprs,
        "spill_bytes": 4 * spilled,
        "spill_store_bytes": None,
        "spill_load_bytes": None,
        "stack_bytes": _meta(text, r"; ScratchSize:\s*(\d+)") or 0,
        "sgpr_spills": _meta(text, r"\.sgpr_spill_count:\s*(\d+)") or 0,
        "shared_bytes": shared,
        "max_warps_per_sm": limits[limiter] * num_warps,
        "occupancy_limit": limiter,
        "llvm_waves_per_simd": _meta(text, r"; Occupancy:\s*(\d+)"),
        "model_waves_per_simd": min(
            CDNA["warps"] // CDNA["simds"], resident_limits(vgprs, 1, 0, CDNA)["registers"] // 4
        ),
        "elements_per_thread": elements_per_thread,
        "main_loop": f"{loop[0]}-{loop[1]}" if loop else None,
        "loop_instructions": len(body) if loop else None,
        "loop_global_loads": len(loads) if loop else None,
        "loop_global_stores": len(stores) if loop else None,
        "load_vector_bits": max(map(_width, loads), default=None),
        "store_vector_bits": max(map(_width, stores), default=None),
        "round_trips_per_iteration": None,
        "sass_per_element": round(len(body) / elements_per_thread, 2) if loop and elements_per_thread else None,
    }
