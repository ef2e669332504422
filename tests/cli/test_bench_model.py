"""``tritonbn bench --model``: tiny CPU runs of the command on a built-in model and on a user's own module.

The recorded inputs are checked against the model's BatchNorm inputs as a plain forward hook sees
them; the totals against the CSV's own rows. CPU times mean nothing, so no time is checked beyond
being a positive number.
"""

from __future__ import annotations

import csv
import os
import textwrap

import pytest
import torch
from torch import nn

from tritonbn.backend import interpreted
from tritonbn.cli import main

FAST = ["--reps", "1", "--warmup", "0"]

USER_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 5, 3, padding=1)
            self.bn = nn.BatchNorm2d(5)  # called twice per step
            self.seq = nn.BatchNorm1d(5)  # on a 3-D input

        def forward(self, x):
            return self.seq(self.bn(self.bn(self.conv(x))).flatten(2))


    def build():
        return Net()
    """
)


def _rows(out) -> list[dict]:
    with open(os.path.join(out, "bench_model.csv")) as f:
        return list(csv.DictReader(f))


def _bn_inputs(model: nn.Module, x: torch.Tensor) -> list[tuple]:
    seen = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, a: seen.append(("x".join(map(str, a[0].shape)), a[0].is_contiguous())))
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.interpreter
def test_bench_builtin_demo_model(tmp_path, capsys):
    assert interpreted(), "conftest runs the kernels under the Triton interpreter"
    out = tmp_path / "out"
    assert main(["bench", "--model", "demo", "--dtype", "fp32", "--out", str(out), *FAST]) == 0
    printed = capsys.readouterr()
    rows = _rows(out)
    from tritonbn.cli.demo import make_model

    expected = _bn_inputs(make_model(), torch.randn(8, 3, 12, 12))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    assert shapes == [s for s, _ in expected]
    providers = ["tritonbn[torch]", "tritonbn[triton]", "batchnorm"]
    assert len(rows) == len(shapes) * 2 * len(providers)
    for r in rows:
        assert r["provider"] in providers and r["mode"] in ("train", "eval") and not r["error"], r
        assert float(r["ms"]) > 0 and r["dtype"] == "float32" and r["layers"] == r["calls"] == "1"
    for mode in ("train", "eval"):
        total = sum(
            float(r["ms"]) * int(r["calls"]) for r in rows if r["mode"] == mode and r["provider"] == "batchnorm"
        )
        line = next(s for s in printed.out.splitlines() if s.startswith("total per step") and f" {mode} " in s)
        assert f"{total:.4g}" in line.split()
    assert "these times say nothing about a GPU" in printed.out
    assert "torch_sync: not measured (torch.nn.SyncBatchNorm refuses CPU tensors)" in printed.out
    assert f"{len(rows)}/{len(rows)}" in printed.err  # the progress bar
    with open(out / "bench_model.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_user_model_channels_last(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    (tmp_path / "tritonbn_user_net.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    args = ["bench", "--model", "tritonbn_user_net:build", "--input", "2,3,5,4", "--channels-last", "--dtype", "bf16"]
    assert main([*args, "--out", str(out), *FAST]) == 0
    rows = [r for r in _rows(out) if r["provider"] == "batchnorm" and r["mode"] == "train"]
    by_shape = {r["shape"]: r for r in rows}
    assert set(by_shape) == {"2x5x5x4", "2x5x20"}
    conv_out = by_shape["2x5x5x4"]
    assert (conv_out["layers"], conv_out["calls"], conv_out["layout"]) == ("1", "2", "channels_last")
    assert conv_out["dtype"] == "bfloat16"  # autocast: the conv gives bf16
    # flatten(2) of a channels_last tensor is a view with channels innermost: timed at those strides.
    assert (by_shape["2x5x20"]["layers"], by_shape["2x5x20"]["layout"]) == ("1", "strided")
    assert by_shape["2x5x20"]["stride"] == "100,1,5" and conv_out["stride"] == "100,1,20,5"
    capsys.readouterr()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no_such_module_xyz:build"], "cannot import module 'no_such_module_xyz'"),
        (["--model", "tritonbn.cli.demo:no_such_fn"], "has no attribute 'no_such_fn'"),
        (["--model", "tritonbn.cli.demo:PER_RANK"], "expected a torch.nn.Module"),
        (["--model", "resnet5O"], "--model must be MODULE:CALLABLE or one of resnet50, demo"),
        (["--model", "demo", "--input", "3"], "--input must be a positive shape"),
        (["--model", "torch.nn:Identity", "--input", "2,3"], "the model has no BatchNorm layer"),
    ],
)
def test_bench_bad_arguments(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args, "--out", str(tmp_path), *FAST])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_user_model_needs_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    (tmp_path / "tritonbn_user_net2.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit):
        main(["bench", "--model", "tritonbn_user_net2:build", "--out", str(tmp_path), *FAST])
    assert "give the input shape with --input" in capsys.readouterr().err


@pytest.mark.distributed
def test_bench_two_ranks(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    out = tmp_path / "out"
    assert main(["bench", "--model", "demo", "--world", "2", "--dtype", "fp32", "--out", str(out), *FAST]) == 0
    rows = _rows(out)
    assert rows and all(float(r["ms"]) > 0 for r in rows)
    assert "2 rank(s) on cpu" in capfd.readouterr().out  # printed by rank 0, a spawned process


def test_bench_budget_spent(tmp_path, monkeypatch, capsys):
    """Past --budget-s no case starts; the table and CSV are still written, with nothing made up."""
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    out = tmp_path / "out"
    assert main(["bench", "--model", "demo", "--budget-s", "1e-9", "--out", str(out), *FAST]) == 0
    rows = _rows(out)
    assert rows and all(r["ms"] == "" and r["error"] == "skipped: time budget spent" for r in rows)
    printed = capsys.readouterr().out
    assert f"{len(rows)} case(s) not measured" in printed
    (line,) = [s for s in printed.splitlines() if s.startswith("total per step") and " train " in s]
    assert line.split()[-3:] == ["-", "-", "-"]
