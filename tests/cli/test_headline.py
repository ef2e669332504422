"""The GPU check's Python runs on CPU: the ResNet-50 builder, and benchmarks/headline.py in its smoke mode."""

import json
import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from tritonbn.cli.resnet50 import bn_input_shapes, distinct_bn_shapes, resnet50  # noqa: E402


def test_resnet50_matches_torchvision_layout():
    model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision.models.resnet50
    shapes = bn_input_shapes(model, (32, 3, 224, 224))
    assert len(shapes) == 53
    distinct = dict(distinct_bn_shapes(32))
    assert len(distinct) == 12 and sum(distinct.values()) == 53
    assert distinct[(32, 64, 112, 112)] == 1 and distinct[(32, 256, 14, 14)] == 11


def test_tiny_resnet50_trains_on_cpu():
    torch.manual_seed(0)
    model = resnet50(num_classes=10, width=4).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([1, 2]))
    loss.backward()
    assert torch.isfinite(loss) and model.conv1.weight.grad is not None


def test_headline_smoke_mode(tmp_path):
    """Per-layer table and eager training steps on CPU over a 1-rank gloo group; every case runs or is skipped."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # tritonbn's torch backend on CPU
    cmd = [sys.executable, str(ROOT / "benchmarks" / "headline.py"), "--smoke", "--no-compile", "--out", str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "headline.jsonl").read_text().splitlines()]
    measured = {(r["table"], r.get("provider", r.get("variant"))) for r in rows if "ms" in r}
    assert {("layer", "tritonbn"), ("layer", "cudnn"), ("step", "tritonbn"), ("step", "cudnn")} <= measured
    assert all("ms" in r or "host_us" in r or r["error"].startswith("skipped") for r in rows), rows
    host = {r["variant"] for r in rows if r["table"] == "step" and "host_us" in r}
    assert {"none", "tritonbn", "cudnn"} <= host, rows  # the host time per BatchNorm layer has its baseline
    md = (tmp_path / "headline.md").read_text()
    assert "CPU SMOKE RUN" in md and "sum over the" in md and "host µs per BatchNorm layer" in md


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)
