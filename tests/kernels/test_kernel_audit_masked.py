"""The kernel audit of masked BatchNorm's launches (``benchmarks/kernel_audit.py --quick --masked``), sm_90.

The same rules as the unmasked audit (tests/kernels/test_kernel_audit.py): no spills, at most 128
registers, the launches of an unmasked layer (a mask adds none), and one memory round trip per main-loop
iteration wherever the loads are full 16-byte vectors. An odd-length sequence in 16 bits cannot be read
in vectors (each channel's row starts anywhere): there the unmasked layer takes up to 3 round trips too,
and the masked one is held to 2.

In the README's test command these rules are checked on one case, an odd-length bf16 sequence in NCL (no vector
loads: the rule of its own). The whole ``--quick --masked`` audit, whose 7x7 NCHW bf16 planes hold the most registers,
is the exhaustive sweep (``compile_sweep``, run by scripts/compile_sweep.sh in CI).
"""

import json

import pytest
from test_kernel_audit import _no_spills_and_at_most_128_registers

CASES = ("32x256x499,bf16,contiguous",)


def _audit(kernel_audit, tmp_path_factory, jobs) -> tuple[list, str]:
    """Rows and markdown of the masked audit's ``jobs`` together."""
    rows, md = [], ""
    for job in jobs:
        out = tmp_path_factory.mktemp("audit_masked")
        kernel_audit(*job, "--masked", "--out", str(out))
        rows += json.loads((out / "kernel_audit.json").read_text())
        md += (out / "kernel_audit.md").read_text()
    return rows, md


@pytest.fixture(scope="module")
def masked_audit(kernel_audit, tmp_path_factory):
    """Rows and markdown of the masked audit of CASES."""
    return _audit(kernel_audit, tmp_path_factory, [("--case", case) for case in CASES])


def _covers_its_cases(rows, md, quick=False):
    if quick:
        assert {r["shape"] for r in rows} == {"32x256x14x14", "32x2048x7x7", "32x256x499"}
        assert {(r["dtype"], r["layout"]) for r in rows} == {(d, lay) for d in ("bf16", "fp32")
                                                             for lay in ("contiguous", "channels_last")}  # fmt: skip
    else:
        assert {(r["shape"], r["dtype"], r["layout"]) for r in rows} == {tuple(c.split(",")) for c in CASES}
    assert all(r["constexprs"].get("HAS_MASK") for r in rows), "every audited launch must be a masked one"
    assert "masked BatchNorm" in md and "--masked" in md


def _a_mask_adds_no_launch(rows):
    per_pass = {}
    for r in rows:
        per_pass.setdefault((r["shape"], r["dtype"], r["layout"], r["mode"]), []).append(r["kernel"])
    for (*_, mode), kernels in per_pass.items():
        assert len(kernels) == (1 if mode == "eval_forward" else 2), (mode, kernels)


def _round_trips_per_iteration(rows):
    for r in rows:
        trips = r["round_trips_per_iteration"]
        if trips is None:
            continue
        limit = 1 if r["load_vector_bits"] == 128 else 2
        assert trips <= limit, (r["kernel"], r["shape"], r["dtype"], r["layout"], trips, r["load_vector_bits"])


def test_covers_its_cases(masked_audit):
    _covers_its_cases(*masked_audit)


def test_no_spills_and_at_most_128_registers(masked_audit):
    _no_spills_and_at_most_128_registers(masked_audit[0])


def test_a_mask_adds_no_launch(masked_audit):
    _a_mask_adds_no_launch(masked_audit[0])


def test_round_trips_per_iteration(masked_audit):
    _round_trips_per_iteration(masked_audit[0])


@pytest.mark.compile_sweep
def test_whole_quick_audit(kernel_audit, tmp_path_factory):
    """The whole ``--quick --masked`` audit (the sweep) held to the same four rules: one test, so that one worker runs
    its one job."""
    rows, md = _audit(kernel_audit, tmp_path_factory, [("--quick",)])
    _covers_its_cases(rows, md, quick=True)
    _no_spills_and_at_most_128_registers(rows)
    _a_mask_adds_no_launch(rows)
    _round_trips_per_iteration(rows)
