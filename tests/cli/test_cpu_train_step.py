"""benchmarks/cpu_train_step.py and benchmarks/cpu_nets.py: the networks convert and train, the script reports
both columns and enforces --max-ratio. (Speed itself is measured by the script, never asserted here.)"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import tritonbn
from tritonbn.modules import SyncBatchNormAct

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cpu_nets  # noqa: E402

BN_LAYERS = {"resnet": 20, "mobilenet": 34, "efficientnet": 49}
# The tritonbn layers of each network by epilogue (SyncBatchNormAct: the activation its child runs, unfused).
EPILOGUES = {
    "resnet": {"none": 20},
    "mobilenet": {"none": 34},
    "efficientnet": {"none": 49},
    "resnet_fx": {"relu": 9, "residual relu": 8, "none": 3},
    "mobilenet_timm": {"relu": 5, "Hardswish": 18, "none": 11},
    "efficientnet_timm": {"silu": 33, "none": 16},
}


@pytest.mark.parametrize("name", cpu_nets.NETS)
def test_nets_convert_and_train(name, monkeypatch):
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")  # what the script runs (conversion lives above the backend)
    torch.manual_seed(0)
    model = cpu_nets.build(name, small=True)
    layers = BN_LAYERS[name.partition("_")[0]]
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == layers
    side = cpu_nets.input_size(name, small=True)
    converted = cpu_nets.converted(name, model)
    epilogues = {}

    def count(m, args, kwargs):
        act = type(m.act).__name__ if isinstance(m, SyncBatchNormAct) else m.activation
        key = " ".join(["residual"] * (len(args) > 1 and args[1] is not None) + [act or ""]).strip() or "none"
        epilogues[key] = epilogues.get(key, 0) + 1

    hooks = [m.register_forward_pre_hook(count, with_kwargs=True) for m in converted.modules()
             if isinstance(m, tritonbn.SyncBatchNorm)]  # fmt: skip
    converted(torch.randn(2, 3, side, side))
    for hook in hooks:
        hook.remove()
    assert epilogues == EPILOGUES[name]
    assert not any(type(m) in (torch.nn.BatchNorm2d, cpu_nets.BatchNormAct2d) for m in converted.modules())
    x = torch.randn(2, 3, side, side)
    loss = torch.nn.functional.cross_entropy(converted(x), torch.tensor([1, 2]))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in converted.parameters())


def _run(tmp_path, *extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script runs the torch backend
    out = tmp_path / "cpu.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cpu_train_step.py"), "--small", "--nets", "mobilenet",
           "--dtypes", "fp32", "--reps", "1", "--warmup", "0", "--json", str(out), *extra]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    return result, out


@pytest.mark.distributed
def test_script_reports_both_columns(tmp_path):
    result, out = _run(tmp_path, "--layouts", "channels_last")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert (row["net"], row["dtype"], row["layout"]) == ("mobilenet", "fp32", "channels_last")
    for key in ("plain_ms", "tritonbn_ms", "ddp_plain_ms", "ddp_tritonbn_ms"):
        assert row[key] > 0, key
    assert row["ratio"] == pytest.approx(row["tritonbn_ms"] / row["plain_ms"])
    assert row["ddp_ratio"] == pytest.approx(row["ddp_tritonbn_ms"] / row["ddp_plain_ms"])
    assert report["worst_ratio"] == row["ratio"]
    assert report["meta"]["tritonbn"] == str(ROOT / "tritonbn")
    assert "| mobilenet | fp32 | channels_last |" in result.stdout


def test_script_times_each_epilogue(tmp_path):
    """--bn-layers on a timm-style network: one group per epilogue, tritonbn's layer against BatchNorm2d + the ops."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "cpu.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cpu_train_step.py"), "--small", "--nets", "mobilenet_timm",
           "--dtypes", "bf16", "--layouts", "channels_last", "--reps", "1", "--warmup", "0", "--no-ddp",
           "--bn-layers", "--json", str(out)]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    groups = {name: e["layers"] for name, e in row["bn_epilogues"].items()}
    assert groups == {"relu": 5, "Hardswish (unfused)": 18, "none": 11}
    assert all(e["plain_ms"] > 0 and e["tritonbn_ms"] > 0 for e in row["bn_epilogues"].values())
    assert "| mobilenet_timm | bf16 | channels_last | relu | 5 |" in result.stdout


def test_script_times_the_batchnorm_layers_alone_and_fails_above_max_ratio(tmp_path):
    """--bn-layers and --results; over --max-ratio the script exits 1, after writing its JSON and its table."""
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n<!-- cpu-train-step:begin -->\nold\n<!-- cpu-train-step:end -->\n\n## After\n")
    result, out = _run(tmp_path, "--layouts", "contiguous", "--no-ddp", "--bn-layers", "--results", str(results),
                       "--max-ratio", "0.01")  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "exceeds --max-ratio 0.01" in result.stderr
    (row,) = json.loads(out.read_text())["results"]
    assert "ddp_ratio" not in row
    assert row["bn_layers"] == BN_LAYERS["mobilenet"]
    assert row["bn_plain_ms"] > 0 and row["bn_tritonbn_ms"] > 0
    assert row["bn_extra_us_per_layer"] == pytest.approx(1e3 * (row["bn_tritonbn_ms"] - row["bn_plain_ms"]) / 34)
    assert "extra per layer" in result.stdout
    assert {name: e["layers"] for name, e in row["bn_epilogues"].items()} == {"none": 34}
    assert sum(e["plain_ms"] for e in row["bn_epilogues"].values()) == pytest.approx(row["bn_plain_ms"])
    assert "| mobilenet | fp32 | contiguous | none | 34 |" in result.stdout
    text = results.read_text()  # --results: the table between the markers, the rest of the file kept
    assert "old" not in text and text.startswith("# Results") and text.rstrip().endswith("## After")
    assert "| mobilenet | fp32 | contiguous |" in text.split("<!-- cpu-train-step:begin -->")[1].split("end -->")[0]
