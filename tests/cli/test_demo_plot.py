"""``tritonbn demo --plot FILE.png``: the spreads across ranks after every step, plain BatchNorm against tritonbn."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from tritonbn.cli import main

pytest.importorskip("matplotlib", reason="matplotlib is the plot extra: pip install -e '.[plot]'")


@pytest.mark.distributed
def test_demo_plot_under_torchrun(tmp_path):
    """``tritonbn demo --plot`` launched by torchrun (2 ranks over gloo; the spawned launch and the kernels:
    tests/distributed/test_diagnose.py's ``test_demo_runs``)."""
    png = tmp_path / "drift.png"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITONBN_BACKEND="torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "tritonbn", "demo", "--steps", "3", "--plot", str(png)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 ranks over gloo" in result.stdout
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "drift.csv") as f:
        rows = list(csv.DictReader(f))
    by = {}
    for r in rows:
        by.setdefault(r["method"], []).append((int(r["step"]), float(r["bn_stats_spread"]), float(r["eval_spread"])))
    assert set(by) == {"plain BatchNorm under DDP", "tritonbn.SyncBatchNorm"}
    assert [s for s, _, _ in by["tritonbn.SyncBatchNorm"]] == [1, 2, 3]
    assert all(stats == 0 and spread == 0 for _, stats, spread in by["tritonbn.SyncBatchNorm"])
    assert all(stats > 1e-2 and spread > 0 for _, stats, spread in by["plain BatchNorm under DDP"])
    # The last step's figures are the table's, measured after training.
    for label, trace in by.items():
        (line,) = [line for line in result.stdout.splitlines() if line.startswith(label + " ")]
        assert line[len(label) :].split()[:2] == [f"{trace[-1][1]:.2e}", f"{trace[-1][2]:.2e}"]


def test_demo_plot_needs_a_png_name(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--plot", "drift.jpg"])
    assert "--plot must name a .png file" in capsys.readouterr().err
