"""``benchmarks/scaling.py --smoke`` (what CI runs): one ResNet-50 step's collectives at worlds 2 and 4, the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from tritonbn.cli.resnet50 import resnet50  # noqa: E402

pytestmark = pytest.mark.distributed


def test_scaling_smoke(tmp_path):
    out, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "scaling.py"), "--smoke", "--json", str(out), "--plot",
           str(png)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    with torch.device("meta"):
        channels = [m.num_features for m in resnet50().modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(channels) == 53
    measured = data["measured"]
    cases = {(r["world"], r["impl"], r["group_size"]) for r in measured}
    assert cases == {(2, "tritonbn", 2), (2, "allgather", 2), (4, "tritonbn", 2), (4, "allgather", 2),
                     (4, "tritonbn", 4), (4, "allgather", 4)}  # fmt: skip
    for r in measured:
        assert set(r) >= {"world", "impl", "group_size", "collectives_per_step", "bytes_per_step", "us_per_step"}
        assert r["collectives_per_step"] == 2 * 53, "one collective per pass and layer"
        if r["impl"] == "tritonbn":  # 2C+3 fp64 each pass (tritonbn.lockstep): the world size does not enter
            assert r["bytes_per_step"] == sum(2 * 8 * (2 * c + 3) for c in channels)
        else:  # torch's all-gather of group_size x (2C+1) fp32, then the same backward all-reduce
            assert r["bytes_per_step"] == sum(4 * r["group_size"] * (2 * c + 1) + 4 * 2 * c for c in channels)
        assert r["us_per_step"] > 0
    model = {(r["world"], r["impl"], r["group_size"]): r["us_per_step"] for r in data["model"]}
    worlds = [2**k for k in range(3, 13)]
    assert set(model) == {(w, i, g) for w in worlds for i, g in (("tritonbn", w), ("tritonbn", 8), ("allgather", w))}
    assert len({model[(w, "tritonbn", 8)] for w in worlds}) == 1, "a group of 8 costs the same at any world size"
    gather = [model[(w, "allgather", w)] for w in worlds]
    assert gather == sorted(gather) and gather[-1] > 10 * model[(4096, "tritonbn", 4096)]
    assert all(a["source"] for a in data["assumptions"].values()), "every parameter names its source"
    assert len(data["model_check"]) == len(measured) and data["fit"]["rms_relative_error"] >= 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
