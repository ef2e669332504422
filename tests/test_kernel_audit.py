"""The kernel audit (benchmarks/kernel_audit.py): sm_90 code read without a GPU.

The audit runs in a subprocess: this test process has TRITON_INTERPRET=1 set (conftest), and the
audit compiles the kernels. nvdisasm and ptxas ship with the triton wheel, so it normally runs.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parents[1] / "benchmarks" / "kernel_audit.py"
MAX_REGISTERS = 128


def _run(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    if result.returncode == 2 and "cannot run" in result.stderr:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def test_round_trip_counter_on_toy_kernels():
    """A load through a loaded index is 2 round trips per iteration; two independent loads are 1."""
    out = _run("--self-check")
    toys = json.loads(out[out.index("{") :])
    assert toys["_toy_dependent"]["round_trips_per_iteration"] == 2, toys
    assert toys["_toy_independent"]["round_trips_per_iteration"] == 1, toys
    assert toys["_toy_independent"]["load_vector_bits"] == 128, toys  # 4 fp32 per thread, 16-byte aligned


@pytest.fixture(scope="module")
def quick_audit(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    _run("--quick", "--out", str(out))
    rows = json.loads((out / "kernel_audit.json").read_text())
    return rows, (out / "kernel_audit.md").read_text()


def test_quick_audit_covers_every_pass(quick_audit):
    rows, md = quick_audit
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
    assert "## Kernel audit (sm_90, compiled without a GPU)" in md and "### Summary" in md


def test_no_spills_and_at_most_128_registers(quick_audit):
    """The rules of DESIGN.md's speed section that the compiled code alone can show, on every launch."""
    rows, _ = quick_audit
    bad = [(r["kernel"], r["layout"], r["dtype"], r["shape"], r["registers"], r["spill_bytes"]) for r in rows
           if r["spill_bytes"] or r["registers"] > MAX_REGISTERS]  # fmt: skip
    assert not bad, f"spills or more than {MAX_REGISTERS} registers: {sorted(set(bad))}"


def test_one_round_trip_and_two_launches_per_training_pass(quick_audit):
    """A training pass is 2 launches, eval 1. Every main loop loads and stores 128 bits per thread (the
    quick audit's 14x14 and 7x7 NCHW planes through grouped plans), issues all its loads before using
    any (one round trip), and the statistics loop costs at most 8 SASS instructions per element."""
    rows, _ = quick_audit
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
    assert {r["layout"] for r in stats} == {"contiguous", "channels_last"}
    assert max(r["sass_per_element"] for r in stats) <= 8, stats
