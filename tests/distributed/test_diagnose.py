"""Finding, confirming and repairing drifted BatchNorm statistics; the doctor and the demo."""

from __future__ import annotations

import copy
import fractions
import json
import os
import pathlib
import random
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from dist import load_ranks, save_rank, spawn
from timm_standin import EfficientNetish, InvertedResidual
from torch import nn

import tritonbn
from tritonbn import diagnose
from tritonbn.cli import doctor
from tritonbn.cli.demo import ddp_without_buffer_sync

pytestmark = pytest.mark.distributed


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 6),
        nn.BatchNorm1d(6),
        nn.Linear(6, 2),
    )


def rank_batches(rank, count=3, n=5):
    """Different data per rank: rank r's inputs are shifted by 2r and scaled by 1+r."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(n + rank, 3, 7, 7, generator=g) * (1 + rank) + 2 * rank for _ in range(count)]


def _train(model, rank):
    ddp = ddp_without_buffer_sync(model, torch.device("cpu"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x in rank_batches(rank):
        opt.zero_grad()
        F.mse_loss(ddp(x), torch.zeros(x.shape[0], 2)).backward()
        opt.step()
    return ddp


def _rank_diagnose(rank, world, out_dir):
    out = {}
    # Plain BN under DDP, different data per rank: caught.
    plain = _train(make_model(), rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["unsynced"] = diagnose.find_unsynced_batchnorm(plain)
        diagnose.find_unsynced_batchnorm(plain)
    out["warnings"] = [str(w.message) for w in caught]
    report = diagnose.check_bn_sync(plain)
    out["plain_ok"], out["plain_diverging"], out["plain_text"] = report.ok, report.diverging, str(report)
    out["before_repair"] = {k: v.clone() for k, v in plain.module.state_dict().items()}
    # The repair: pooled statistics, identical on every rank.
    out["repaired_layers"] = tritonbn.sync_running_stats(plain)
    out["after_repair"] = {k: v.clone() for k, v in plain.module.state_dict().items()}
    out["repaired_ok"] = diagnose.check_bn_sync(plain).ok
    # Converted models stay in sync by themselves.
    synced = _train(tritonbn.convert_sync_batchnorm(make_model()), rank)
    out["synced_unsynced"] = diagnose.find_unsynced_batchnorm(synced)
    out["synced_report"] = str(diagnose.check_bn_sync(synced))
    out["synced_ok"] = diagnose.check_bn_sync(synced).ok
    # A settings mismatch is reported too.
    odd = tritonbn.convert_sync_batchnorm(make_model())
    odd[1].eps = 1e-3 if rank == 1 else 1e-5
    out["odd_mismatches"] = diagnose.check_bn_sync(odd).layers[0].mismatches
    # Precise BN over each rank's own batches.
    model = make_model()
    model[1].momentum = 0.3
    model.eval()
    out["recal_count"] = tritonbn.recalibrate_batchnorm(model, [(x, None) for x in rank_batches(rank)])
    out["recal_state"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["recal_training"] = [m.training for m in model.modules()]
    out["recal_momentum"] = model[1].momentum
    out["recal_ok"] = diagnose.check_bn_sync(model).ok
    save_rank(out_dir, rank, out)


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("diagnose")
    spawn(2, _rank_diagnose, str(out_dir))
    return load_ranks(str(out_dir), 2)


def test_plain_batchnorm_under_ddp_is_caught(diagnosed):
    for r in diagnosed:
        assert r["unsynced"] == ["1", "5"]
        assert len(r["warnings"]) == 1, "the DDP warning is given once"
        assert "tritonbn.convert_sync_batchnorm" in r["warnings"][0] and "1, 5" in r["warnings"][0]
        assert not r["plain_ok"]
        assert r["plain_diverging"] == ["1", "5"]
        assert "DIVERGED" in r["plain_text"] and "2 of 2 BatchNorm layers diverge" in r["plain_text"]


def test_converted_model_passes(diagnosed):
    for r in diagnosed:
        assert r["synced_unsynced"] == []
        assert r["synced_ok"], r["synced_report"]
        assert "all 2 BatchNorm layers in sync across 2 ranks" in r["synced_report"]


def test_settings_mismatch_is_reported(diagnosed):
    assert all(r["odd_mismatches"] == ["eps"] for r in diagnosed)


def test_sync_running_stats_repairs(diagnosed):
    r0, r1 = diagnosed
    assert r0["repaired_layers"] == 2 and r0["repaired_ok"] and r1["repaired_ok"]
    for layer in ("1", "5"):
        means = torch.stack([r["before_repair"][f"{layer}.running_mean"].double() for r in diagnosed])
        vars_ = torch.stack([r["before_repair"][f"{layer}.running_var"].double() for r in diagnosed])
        pooled_mean = means.mean(0)
        pooled_var = (vars_ + means**2).mean(0) - pooled_mean**2  # includes the spread of the means
        for r in diagnosed:
            torch.testing.assert_close(r["after_repair"][f"{layer}.running_mean"].double(), pooled_mean)
            torch.testing.assert_close(r["after_repair"][f"{layer}.running_var"].double(), pooled_var)
        assert torch.equal(r0["after_repair"][f"{layer}.running_var"], r1["after_repair"][f"{layer}.running_var"])
        assert (pooled_var > vars_.mean(0)).all(), "the drifted means must widen the pooled variance"


def test_recalibrate_matches_union_statistics(diagnosed):
    model = make_model()
    with torch.no_grad():
        first_inputs = torch.cat([model[0](x) for rank in range(2) for x in rank_batches(rank)]).double()
    mean = first_inputs.mean((0, 2, 3))
    var = first_inputs.var((0, 2, 3), unbiased=True)
    for r in diagnosed:
        assert r["recal_count"] == 3
        torch.testing.assert_close(r["recal_state"]["1.running_mean"].double(), mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["recal_state"]["1.running_var"].double(), var, atol=1e-5, rtol=1e-5)
        assert r["recal_state"]["1.num_batches_tracked"].item() == 3
        assert r["recal_ok"]
        assert not any(r["recal_training"]), "training mode is restored"
        assert r["recal_momentum"] == 0.3
    # not the average of per-batch variances
    with torch.no_grad():
        per_batch = torch.stack([model[0](x).double().var((0, 2, 3)) for rank in range(2) for x in rank_batches(rank)])
    assert (per_batch.mean(0) - var).abs().max() > 1e-2


# --- doctor ---------------------------------------------------------------------------------------


def _checkpoints(tmp_path, drift: bool):
    paths = []
    for rank in range(2):
        model = make_model()
        model.train()
        x = rank_batches(rank if drift else 0)[0]
        model(x)
        state = model.state_dict()
        path = tmp_path / f"rank{rank}.pt"
        torch.save({"model": state} if rank else state, path)  # both accepted forms
        paths.append(str(path))
    return paths


def test_doctor_exit_codes(tmp_path, capsys):
    assert doctor.main(_checkpoints(tmp_path, drift=False)) == 0
    assert "in sync across 2 ranks" in capsys.readouterr().out
    paths = _checkpoints(tmp_path, drift=True)
    assert doctor.main(paths) == 1
    out = capsys.readouterr().out
    assert "DIVERGED" in out and "1, 5" in out
    assert doctor.main(paths, atol=1e3, rtol=1e3) == 0, "a loose enough tolerance accepts the drift"
    capsys.readouterr()

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    assert doctor.main([paths[0], str(garbage)]) == 2
    assert "cannot read checkpoint" in capsys.readouterr().err
    other = tmp_path / "other.pt"
    torch.save(nn.Sequential(nn.BatchNorm1d(9)).state_dict(), other)
    assert doctor.main([paths[0], str(other)]) == 2
    assert "not the same model" in capsys.readouterr().err
    assert doctor.main([paths[0]]) == 2
    assert "at least two checkpoints" in capsys.readouterr().err


class _Touch:
    """A pickle that would create a file if unpickled with code execution."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def _state():
    return nn.Sequential(nn.BatchNorm2d(4)).state_dict()


MALFORMED = [
    # (file name, how to write it, fragment of the one-line reason)
    ("int.pt", lambda p: torch.save({**_state(), "0.num_batches_tracked": 5}, p), "0.num_batches_tracked is an int"),
    ("list.pt", lambda p: torch.save({**_state(), "0.running_mean": [0.0] * 4}, p), "0.running_mean is a list"),
    ("intkey.pt", lambda p: torch.save({**_state(), 3: torch.ones(2)}, p), "key 3 is an int, not a string"),
    ("shape.pt", lambda p: torch.save({**_state(), "0.running_var": torch.ones(5)}, p), "has shape (5,), not (4,)"),
    ("nbt.pt", lambda p: torch.save({**_state(), "0.num_batches_tracked": torch.ones(2)}, p), "must hold one integer"),
    ("cplx.pt", lambda p: torch.save({**_state(), "0.running_var": torch.ones(4, dtype=torch.cfloat)}, p), "floating"),
    (
        "extra.pt",
        lambda p: torch.save({**_state(), "1.running_mean": torch.ones(1), "1.running_var": torch.ones(1)}, p),
        "has BatchNorm layer '1'",
    ),  # fmt: skip
    ("alist.pt", lambda p: torch.save([1, 2], p), "expected a state_dict"),
    ("evil.pt", lambda p: torch.save({"x": _Touch(str(p) + ".ran")}, p), "refused by the weights-only loader"),
    (
        "frac.pt",
        lambda p: torch.save({"x": fractions.Fraction(1, 3)}, p),
        "it needs globals that are not allowed: fractions.Fraction",
    ),
    (
        "ckpt.json",
        lambda p: p.write_text(json.dumps({"0.running_mean": [0.0]})),
        "not a checkpoint written by torch.save",
    ),
    (
        "random.pt",
        lambda p: p.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(300))),
        "not a checkpoint",
    ),
    ("empty.pt", lambda p: p.write_bytes(b""), "cannot read checkpoint: empty file"),
    ("truncated.pt", lambda p: p.write_bytes(_saved(p)[:200]), "failed reading zip archive"),
    ("missing.pt", lambda p: None, "No such file or directory"),
]


def _saved(path):
    torch.save(_state(), path)
    return path.read_bytes()


@pytest.mark.parametrize("name, write, reason", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_doctor_malformed_file_exit_2_one_line(tmp_path, capsys, name, write, reason):
    good = tmp_path / "good.pt"
    torch.save(_state(), good)
    bad = tmp_path / name
    write(bad)
    # with the extra layer's file first, it is the good file that lacks a layer: only the order good, bad
    for order in ([good, bad], [bad, good])[: 1 if name == "extra.pt" else 2]:
        assert doctor.main([str(p) for p in order]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"tritonbn doctor: error: {bad}: ") and reason in err, err
        assert "\x1b" not in err and "weights_only" not in err, err
    assert not (tmp_path / (name + ".ran")).exists(), "unpickling ran code"


def test_doctor_console_script_malformed(tmp_path):
    """The issue's reproduction: exit 2 and one line, not a traceback and exit 1."""
    torch.save(_state(), tmp_path / "a.pt")
    torch.save({**_state(), "0.num_batches_tracked": 5}, tmp_path / "b.pt")
    cmd = [sys.executable, "-m", "tritonbn", "doctor", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tritonbn doctor: error: {tmp_path / 'b.pt'}: 0.num_batches_tracked is an int, not a tensor"
    ]


def test_doctor_console_script(tmp_path):
    paths = _checkpoints(tmp_path, drift=True)
    result = subprocess.run([sys.executable, "-m", "tritonbn", "doctor", *paths], capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "DIVERGED" in result.stdout


def test_demo_runs(tmp_path):
    """The README's first command as a user runs it on CPU: no interpreter, the default backend (the PyTorch one
    there). The kernels train under DDP in tests/distributed/test_training.py."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITONBN_BACKEND")}
    result = subprocess.run(
        [sys.executable, "-m", "tritonbn", "demo", "--steps", "1"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "backend 'torch'" in out

    def row(label):  # the three figures after a method's label
        (line,) = [line for line in out.splitlines() if line.startswith(label + " ")]
        return [float(v) for v in line[len(label) :].split()]

    stats_spread, eval_spread, distance = row("tritonbn.SyncBatchNorm")
    assert stats_spread == 0 and eval_spread == 0 and distance < 1e-4
    stats_spread, eval_spread, distance = row("plain BatchNorm under DDP")
    assert stats_spread > 1e-2 and eval_spread > 1e-3 and distance > 1e-2
    stats_spread, eval_spread, _ = row("plain BN + sync_running_stats")
    assert stats_spread == 0 and eval_spread == 0


def test_recalibrate_a_fused_model_in_one_process():
    """Fused modules (activation, residual) recalibrate too; one process needs no group."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(3, 3, 3, padding=1)
            self.bn = tritonbn.SyncBatchNorm(3, activation="relu")

        def forward(self, x):
            return self.bn(self.conv(x), x)

    torch.manual_seed(5)
    block = Block()
    batches = [torch.randn(4, 3, 6) * 2 + 1 for _ in range(3)]
    assert tritonbn.recalibrate_batchnorm(block, batches) == 3
    with torch.no_grad():
        inputs = torch.cat([block.conv(x) for x in batches]).double()
    torch.testing.assert_close(block.bn.running_mean.double(), inputs.mean((0, 2)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block.bn.running_var.double(), inputs.var((0, 2)), atol=1e-5, rtol=1e-5)
    assert block.training and "forward" not in block.bn.__dict__


@pytest.mark.parametrize("converted", [False, True], ids=["timm_layers", "converted"])
def test_recalibrate_runs_every_layers_own_forward(converted):
    """timm's BatchNormAct2d (and what it converts to) keep their activation while recalibrating."""
    blocks = [InvertedResidual(act_layer=nn.ReLU), InvertedResidual(act_layer=lambda inplace=False: nn.GELU())]
    torch.manual_seed(6)
    model = EfficientNetish(blocks)
    reference = copy.deepcopy(model)
    if converted:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model = tritonbn.convert_sync_batchnorm(model)
    batches = [torch.randn(3, 3, 5, 7) * 2 + 1 for _ in range(2)]
    assert tritonbn.recalibrate_batchnorm(model, batches) == 2

    inputs = {}  # the oracle: each BatchNorm's inputs in torch's own training forward
    hooks = [
        m.register_forward_pre_hook(lambda m, args, name=name: inputs.setdefault(name, []).append(args[0].double()))
        for name, m in reference.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    reference.train()
    with torch.no_grad():
        for x in batches:
            reference(x)
    for h in hooks:
        h.remove()
    assert len(inputs) == 8
    for name, xs in inputs.items():
        bn, x = model.get_submodule(name), torch.cat(xs)
        torch.testing.assert_close(bn.running_mean.double(), x.mean((0, 2, 3)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(bn.running_var.double(), x.var((0, 2, 3)), atol=1e-5, rtol=1e-5)
        assert int(bn.num_batches_tracked) == 2
