"""benchmarks/cpu_eval_step.py: whole networks in eval and one layer, both columns, --results and the bounds.
(Speed itself is measured by the script, never asserted here.)"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


def _run(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "eval.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cpu_eval_step.py"), "--small", "--nets", "resnet_fx",
           "--dtypes", "bf16", "--layouts", "channels_last", "--batches", "1", "2", "--reps", "1", "--warmup", "0",
           "--layer-reps", "1", "--json", str(out), *args]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600), out


def test_script_times_nets_and_layers(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n<!-- cpu-eval-step:begin -->\nold\n<!-- cpu-eval-step:end -->\n\n## After\n")
    result, out = _run(tmp_path, "--layers", "--results", str(results))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["net"], r["dtype"], r["layout"], r["batch"]) for r in report["results"]] == [
        ("resnet_fx", "bf16", "channels_last", 1), ("resnet_fx", "bf16", "channels_last", 2)]  # fmt: skip
    for r in report["results"]:
        assert r["ratio"] == pytest.approx(r["tritonbn_ms"] / r["plain_ms"])
    assert {(r["layer"], r["mode"]) for r in report["layers"]} == {
        (layer, mode)
        for layer in ("8x128x8x8", "8x512x4x4", "8x64x16x16", "16x256x14x14")
        for mode in ("eval", "train")
    }
    assert report["worst_layer_ratio"] == max(r["ratio"] for r in report["layers"] if r["mode"] == "eval")
    assert report["meta"]["grad_mode"] == "inference_mode"
    text = results.read_text()  # the tables between the markers, the rest of the file kept
    assert "old" not in text and text.startswith("# Results") and text.rstrip().endswith("## After")
    # one row per network (a column pair per batch) and per layer (a column pair per mode)
    assert "| network | dtype | layout | batch 1 ms (plain / tritonbn) | ratio | batch 2 ms" in text
    assert "| resnet_fx | bf16 | channels_last | " in text and text.count("| resnet_fx |") == 1
    assert "eval ratio | train µs (BN / tritonbn) | train ratio |" in text and "| 16x256x14x14 | bf16 | " in text


def test_script_fails_above_its_bounds(tmp_path):
    result, _ = _run(tmp_path, "--batches", "1", "--layers", "--max-ratio", "0.01", "--max-train-layer-ratio", "0.01",
                     "--max-layer-ratio", "99")  # fmt: skip
    assert result.returncode == 1
    assert "exceeds --max-ratio 0.01" in result.stderr and "exceeds --max-train-layer-ratio 0.01" in result.stderr
    assert "--max-layer-ratio 99" not in result.stderr
