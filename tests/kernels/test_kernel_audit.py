"""The kernel audit (benchmarks/kernel_audit.py): sm_90 code read without a GPU.

The audit runs in a subprocess: this test process has TRITON_INTERPRET=1 set (conftest), and the
audit compiles the kernels. nvdisasm and ptxas ship with the triton wheel, so it normally runs. The jobs
run in one process per worker, in one Triton cache per test run (the ``kernel_audit`` fixture,
tests/kernels/conftest.py); the quick audit in eight parts (one a case), each charged to the first test
that reads it, as are the other targets' audits. The README's test command runs four parts and two other targets;
CI's compile sweep (``compile_sweep``) the rest.
"""

import json
import math
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "kernel_audit.py"
MAX_REGISTERS = 128
# The merge tail (see tritonbn.kernels._common.merge_tree). A flat merge reads R rows after the last main
# loop; the two-level one at most 2 * ceil(sqrt(R)). By design all of them are merged in one level up to
# 16 programs, or while they are at most 64 KiB (tritonbn.kernels._plan).
FLAT_MERGE_ROWS = 16
FLAT_MERGE_BYTES = 64 * 1024
# Bytes of the tail per launch as planned on a 132-SM GPU. A one-level merge reads at most 64 KiB
# (tritonbn.kernels._plan._FLAT_MERGE_BYTES, else the plan merges in two levels). A grid is one wave at
# the kernel's occupancy: at most 4 programs of 8 warps per SM (<= 64 registers), so a two-level chain
# reads up to 2 * 23 rows (R <= 4 * 132) of at most 128 channels (NCHW blocks; channels_last reductions
# take 32) * 2 fp64: 92 KiB, about 0.63 us at the 150 GB/s one SM reads (the model's assumption); 106
# such tails (the 53 layers' statistics and backward reductions) would be 5% of the ResNet-50 floor
# (1.32 ms), which the model checks with the real tails. A flat merge of 523 programs reads 1 MiB.
MAX_TAIL_BYTES = 96 * 1024


def test_round_trip_counter_on_toy_kernels(kernel_audit):
    """A load through a loaded index is 2 round trips per iteration; two independent loads are 1."""
    out = kernel_audit("--self-check")
    toys = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert toys["_toy_dependent"]["round_trips_per_iteration"] == 2, toys
    assert toys["_toy_independent"]["round_trips_per_iteration"] == 1, toys
    assert toys["_toy_independent"]["load_vector_bits"] == 128, toys  # 4 fp32 per thread, 16-byte aligned


# The quick audit (--quick --model) in eight parts, one a case. The README's test command audits four of them, which
# hold both shapes, both dtypes and both layouts, and both dtypes of one shape and layout (the time model's fp32 to
# bf16 check); the sweep (compile_sweep, scripts/compile_sweep.sh) the other four, so that CI audits all eight.
README_PARTS = [("32x256x14x14", d, "channels_last") for d in ("bf16", "fp32")] + [
    ("32x2048x7x7", d, "contiguous") for d in ("bf16", "fp32")
]
PARTS = [(shape, d, lay) for shape in ("32x256x14x14", "32x2048x7x7") for d in ("bf16", "fp32")
         for lay in ("contiguous", "channels_last")]  # fmt: skip
SWEEP_PARTS = [part for part in PARTS if part not in README_PARTS]


@pytest.fixture(scope="module")
def quick_part(kernel_audit, tmp_path_factory):
    """``quick_part((shape, dtype, layout))``: rows, markdown and model of that case of the quick audit, run once."""
    done = {}

    def get(part):
        if part not in done:
            out = tmp_path_factory.mktemp("audit")
            kernel_audit("--quick", "--model", "--case", ",".join(part), "--out", str(out))
            done[part] = (json.loads((out / "kernel_audit.json").read_text()), (out / "kernel_audit.md").read_text(),
                          json.loads((out / "model.json").read_text()))  # fmt: skip
        return done[part]

    return get


@pytest.fixture(scope="module")
def quick_audit(quick_part):
    """The README's parts of the quick audit together: their rows, the first's markdown, and their model."""
    parts = [quick_part(p) for p in README_PARTS]
    rows = [r for rs, _, _ in parts for r in rs]
    m = dict(parts[0][2])
    for key in ("launches", "per_layer"):
        m[key] = [x for _, _, pm in parts for x in pm[key]]
    whole = {}  # the training step per dtype and layout: the sum of its layers, over the parts' shapes
    for _, _, pm in parts:
        for w in pm["whole_model"]:
            step = whole.setdefault((w["dtype"], w["layout"]), {"dtype": w["dtype"], "layout": w["layout"]})
            for key in ("floor_ms", "modeled_ms", "tails_ms"):
                step[key] = step.get(key, 0.0) + w[key]
    m["whole_model"] = list(whole.values())
    return rows, parts[0][1], m


def _no_spills_and_at_most_128_registers(rows):
    """The rules of DESIGN.md's speed section that the compiled code alone can show, on every launch."""
    bad = [(r["kernel"], r["layout"], r["dtype"], r["shape"], r["registers"], r["spill_bytes"]) for r in rows
           if r["spill_bytes"] or r["registers"] > MAX_REGISTERS]  # fmt: skip
    assert not bad, f"spills or more than {MAX_REGISTERS} registers: {sorted(set(bad))}"


def _one_round_trip_and_two_launches_per_training_pass(rows, layout):
    """A training pass is 2 launches, eval 1. Every main loop loads and stores 128 bits per thread (the
    quick audit's 14x14 and 7x7 NCHW planes through packed plans), issues all its loads before using
    any (one round trip), and the statistics loop costs at most 8 SASS instructions per element."""
    assert {r["mode"]: r["launch"].split("/")[1] for r in rows} == {
        "train_forward": "2",
        "backward": "2",
        "eval_forward": "1",
    }
    loops = [r for r in rows if r["main_loop"] is not None]
    assert {(r["layout"], r["shape"]) for r in loops} == {(r["layout"], r["shape"]) for r in rows}
    narrow = [(r["kernel"], r["layout"], r["dtype"], r["shape"], r["load_vector_bits"], r["store_vector_bits"])
              for r in loops if r["load_vector_bits"] != 128 or r["store_vector_bits"] not in (None, 128)]  # fmt: skip
    assert not narrow, f"main loops without 128-bit loads and stores: {narrow}"
    assert {r["round_trips_per_iteration"] for r in loops} == {1}
    stats = [r for r in loops if r["kernel"] == "_batch_norm_stats_kernel"]
    assert {r["layout"] for r in stats} == {layout}
    assert max(r["sass_per_element"] for r in stats) <= 8, stats


def _grids_are_one_wave(rows, m):
    """Each launch fitted its grid to its compiled kernel's occupancy (tritonbn.kernels._launch): at most
    one wave of programs on 132 SMs, unless the channel blocks alone are more, and the model runs it in
    one wave."""
    for r, launch in zip(rows, m["launches"], strict=True):
        wave = 132 * (r["max_warps_per_sm"] // r["num_warps"])
        c_blocks, r_progs = r["grid"]
        assert c_blocks * r_progs <= wave or r_progs == 1, r
        assert launch["waves"] <= 1 or r_progs == 1, launch


def _tail_violations(rows):
    """Reducing launches whose merge tail breaks the rule: more than max(16, 2 ceil(sqrt(R))) rows in
    series, unless they are one level of at most FLAT_MERGE_BYTES."""
    bad = []
    for r in rows:
        if r["tail_rows"] is None:
            continue
        R = r["grid"][1]
        flat_ok = r["tail_levels"] == 1 and r["tail_bytes"] <= FLAT_MERGE_BYTES
        if r["tail_rows"] > max(FLAT_MERGE_ROWS, 2 * math.isqrt(R - 1) + 2) and not flat_ok:
            bad.append((r["kernel"], r["layout"], r["shape"], R, r["tail_rows"], r["tail_bytes"]))
    return bad


def _merge_tail_is_short(rows, md):
    """Every statistics and backward-reduction launch reports its merge tail; the tail reads at most
    2 ceil(sqrt(R)) rows or one level of FLAT_MERGE_BYTES, and at most MAX_TAIL_BYTES, and its merge
    loop is in the SASS."""
    reducing = [r for r in rows if r["kernel"] in ("_batch_norm_stats_kernel", "_batch_norm_backward_reduce_kernel")]
    assert {r["mode"] for r in reducing} == {"train_forward", "backward"}
    for r in reducing:
        assert r["tail_bytes"] > 0 and r["tail_iterations"] >= 1 and r["tail_levels"] in (1, 2), r
        assert r["merge_loops"] >= 1 and r["tail_round_trips"] >= 1, r
    assert all(r["tail_bytes"] is None for r in rows if r not in reducing)
    assert not _tail_violations(rows)
    assert max(r["tail_bytes"] for r in reducing) <= MAX_TAIL_BYTES
    assert "Longest merge tail" in md


# One test a part, holding its rows to the four rules: under the sweep's --dist load each part's job then runs once.
@pytest.mark.parametrize(
    "part",
    [*README_PARTS, *(pytest.param(p, marks=pytest.mark.compile_sweep) for p in SWEEP_PARTS)],
    ids=lambda part: "-".join(part),
)
def test_quick_audit_part(quick_part, part):
    rows, md, m = quick_part(part)
    _no_spills_and_at_most_128_registers(rows)
    _one_round_trip_and_two_launches_per_training_pass(rows, part[2])
    _grids_are_one_wave(rows, m)
    _merge_tail_is_short(rows, md)


def test_quick_audit_covers_every_pass(quick_audit):
    rows, md, _ = quick_audit
    fields = ("kernel", "shape", "dtype", "layout", "mode", "registers", "spill_bytes", "max_warps_per_sm",
              "load_vector_bits", "store_vector_bits", "round_trips_per_iteration", "sass_per_element", "grid",
              "num_warps", "blocks")  # fmt: skip
    for r in rows:
        assert all(f in r for f in fields), r
    cases = {(r["shape"], r["dtype"], r["layout"]) for r in rows}
    assert {d for _, d, _ in cases} == {"bf16", "fp32"}
    assert {lay for *_, lay in cases} == {"contiguous", "channels_last"}
    for case in cases:
        modes = {r["mode"] for r in rows if (r["shape"], r["dtype"], r["layout"]) == case}
        assert modes == {"train_forward", "backward", "eval_forward"}, case
    for r in rows:  # a pass has as many rows as launches
        k, n = map(int, r["launch"].split("/"))
        same = [s for s in rows if (s["shape"], s["dtype"], s["layout"], s["mode"]) ==
                (r["shape"], r["dtype"], r["layout"], r["mode"])]  # fmt: skip
        assert len(same) == n and 1 <= k <= n
    eval_rows = [r for r in rows if r["mode"] == "eval_forward"]
    assert all(r["launch"] == "1/1" for r in eval_rows), "eval is one launch"
    stats = [r for r in rows if r["kernel"] == "_batch_norm_stats_kernel" and r["main_loop"] is not None]
    assert {r["layout"] for r in stats} == {"contiguous", "channels_last"}
    assert "## Kernel audit (sm_90, compiled without a GPU)" in md and "### Summary" in md


def test_merge_tail_with_many_programs(kernel_audit, tmp_path):
    """Planned as on a 2048-SM GPU, a 112x112 channels_last layer has thousands of programs per channel
    block: the two-level tail stays near 2 sqrt(R) rows; a flat merge (--flat-merge) breaks the rule."""
    case = ("--case", "32x64x112x112,bf16,channels_last", "--sm-count", "2048")
    kernel_audit(*case, "--out", str(tmp_path / "tree"))
    rows = json.loads((tmp_path / "tree" / "kernel_audit.json").read_text())
    reducing = [r for r in rows if r["tail_rows"] is not None]
    assert reducing and min(r["grid"][1] for r in reducing) > 1000, [r["grid"] for r in reducing]
    assert {r["tail_levels"] for r in reducing} == {2}
    assert not _tail_violations(rows)
    kernel_audit(*case, "--flat-merge", "--out", str(tmp_path / "flat"))
    flat = json.loads((tmp_path / "flat" / "kernel_audit.json").read_text())
    assert len(_tail_violations(flat)) == len(reducing)
    assert min(r["tail_bytes"] for r in flat if r["tail_bytes"]) > 8 * MAX_TAIL_BYTES


def test_time_model_on_the_quick_subset(quick_audit):
    """--model: each launch's estimate is at least its HBM time plus the fixed cost; the training step's
    rows hold dtype, layout, modeled_ms and floor_ms, with the modeled time above the floor; every
    assumption has a value and a source."""
    rows, md, m = quick_audit
    assert "a model" in md.lower() and "Assumptions" in md
    assert all(a["source"] and a["value"] > 0 for a in m["assumptions"].values())
    fixed = m["assumptions"]["launch_fixed_s"]["value"] * 1e6
    assert len(m["launches"]) == len(rows)
    for launch in m["launches"]:
        assert launch["modeled_us"] >= max(launch["hbm_us"], launch["issue_us"], launch["little_us"]) + fixed - 1e-9
        assert (launch["tail_us"] > 0) == (launch["kernel"] in ("_batch_norm_stats_kernel",
                                                                "_batch_norm_backward_reduce_kernel"))  # fmt: skip
    whole = {(w["dtype"], w["layout"]): w for w in m["whole_model"]}
    assert set(whole) == {(d, lay) for d in ("bf16", "fp32") for lay in ("contiguous", "channels_last")}
    for w in whole.values():
        assert w["floor_ms"] > 0 and w["modeled_ms"] > w["floor_ms"] and 0 < w["tails_ms"] < w["modeled_ms"], w
    # fp32 moves twice the bytes of bf16: its floor is twice as long.
    assert abs(whole[("fp32", "channels_last")]["floor_ms"] / whole[("bf16", "channels_last")]["floor_ms"] - 2) < 1e-3


def test_model_check_prints_model_beside_measured():
    """benchmarks/model_check.py (the GPU check's comparison) pairs the model's per-layer times with
    headline.py's measured rows by shape, and sums both over the measured layers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_check", SCRIPT.parent / "model_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cl = {"layout": "channels_last"}
    model = {"per_layer": [{"shape": "32x64x56x56", "dtype": "bf16", **cl, "fwd_bwd_us": 20.0},
                           {"shape": "32x2048x7x7", "dtype": "bf16", **cl, "fwd_bwd_us": 8.0},
                           {"shape": "32x64x56x56", "dtype": "fp32", **cl, "fwd_bwd_us": 99.0}]}  # fmt: skip
    measured = [{"table": "layer", "shape": [32, 64, 56, 56], "provider": "tritonbn", "count": 6, "ms": 0.03},
                {"table": "layer", "shape": [32, 64, 56, 56], "provider": "cudnn", "count": 6, "ms": 0.01}]  # fmt: skip
    lines = mod.compare(model, measured)
    row = next(line for line in lines if "32x64x56x56" in line).split()
    assert row[1:] == ["6", "20.0", "30.0", "1.50"], row
    assert next(line for line in lines if "32x2048x7x7" in line).split()[-2:] == ["-", "-"]
    assert lines[-1].split()[-5:] == ["0.120", "ms", "0.180", "ms", "1.50"], lines[-1]


# --- the other GPUs users train on: one case each (the NCHW bf16 case whose packed statistics plan held the
# most registers: 128 and spills on sm_80 and sm_89, 150 on sm_100, before those targets' plans gathered the
# lanes' sums, see tritonbn.kernels._plan._gathers), planned as on that GPU (its SM/CU count, warp size and
# per-SM limits). The full audit per target is run by hand (benchmarks/RESULTS.md). The same rules hold on
# every target: the plans assume programs of 4 or 8 warps, at least 2 of 8 (4 of 4) resident per SM, which
# 64K registers allow at up to 128 registers a thread on every NVIDIA target (AMD: 128 VGPRs, 4 waves a SIMD).
# The README's test command audits sm_89 and gfx942; the sweep (compile_sweep) sm_80, sm_100 and gfx90a too.
TARGETS = ["89", "gfx942"]
SWEEP_TARGETS = ["80", "100", "gfx90a"]
# Warps per SM of this case's eval kernel (8 warps, 30 registers) by each target's own per-SM limits: an sm_89 SM
# holds 1536 threads, so 48 warps there, where sm_90's limits would give 64; sm_80 and sm_100 SMs hold 2048 threads.
EVAL_WARPS_PER_SM = {"80": (64, None), "89": (48, "threads"), "100": (64, None)}


@pytest.fixture(scope="module")
def target_audit(kernel_audit, tmp_path_factory):
    """``target_audit(arch)``: the rows of that target's audit of the case, run once."""
    done = {}

    def get(arch):
        if arch not in done:
            path = tmp_path_factory.mktemp(f"audit{arch}")
            kernel_audit("--arch", arch, "--case", "32x256x14x14,bf16,contiguous", "--out", str(path))
            done[arch] = json.loads((path / "kernel_audit.json").read_text())
        return done[arch]

    return get


# One test a target (its job runs once under the sweep's --dist load).
@pytest.mark.parametrize("arch", [*TARGETS, *(pytest.param(a, marks=pytest.mark.compile_sweep) for a in SWEEP_TARGETS)])
def test_other_target(target_audit, arch):
    """Vector loads and one round trip, no spills, at most 128 registers and 2 programs of 8 warps (4 of 4) per SM,
    and the eval kernel's occupancy by the target's own limits (NVIDIA) or as LLVM reports it (AMD)."""
    rows = target_audit(arch)
    assert {r["mode"] for r in rows} == {"train_forward", "backward", "eval_forward"}
    warps = {r["num_warps"] for r in rows}
    assert warps <= ({2, 4} if arch.startswith("gfx") else {4, 8}), warps  # 128 or 256 threads a program
    for r in rows:
        assert r["load_vector_bits"] == 128, r  # 14x14 bf16 planes packed: 16-byte loads
        if r["round_trips_per_iteration"] is not None:  # read on NVIDIA only
            assert r["round_trips_per_iteration"] == 1, r
        if arch.startswith("gfx"):  # tritonbn's CDNA occupancy model against LLVM's own figure
            assert r["model_waves_per_simd"] == r["llvm_waves_per_simd"], r
    assert [r["spill_bytes"] for r in rows] == [0] * len(rows)
    assert max(r["registers"] for r in rows) <= MAX_REGISTERS
    assert min(r["max_warps_per_sm"] for r in rows) >= 16  # 2 programs of 8 warps (4 of 4) per SM at least
    if arch in EVAL_WARPS_PER_SM:
        warps_per_sm, limit = EVAL_WARPS_PER_SM[arch]
        row = next(r for r in rows if r["mode"] == "eval_forward")
        assert row["max_warps_per_sm"] == warps_per_sm, row
        assert limit is None or row["occupancy_limit"] == limit, row
