"""Single-process SyncBatchNorm against the float64 oracle, on both backends."""

import pytest
import torch
from oracle import PARAM_GRAD_TOL, TOLERANCES, Oracle, make_layout

import tritonbn

SHAPES = [
    (4, 3, 5, 7),  # ordinary 4-D, odd sizes
    (3, 1, 5, 7),  # C=1
    (2, 130, 3, 1),  # C=130 spans two channel blocks; spatial 3x1
    (5, 3, 1, 1),  # spatial size 1
    (1, 3, 4, 5),  # batch of one, spatial > 1
    (6, 3),  # 2-D (N, C)
    (3, 5, 9),  # 3-D (N, C, L)
    (2, 3, 3, 4, 5),  # 5-D
]


def _assert_close(actual, expected, tol, what):
    atol, rtol = tol
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _run(shape, layout, dtype, *, affine=True, momentum=0.1, track_running_stats=True, steps=2, seed=0):
    """Train ``steps`` steps then eval once, comparing every output with the oracle."""
    torch.manual_seed(seed)
    C = shape[1]
    bn = tritonbn.SyncBatchNorm(C, momentum=momentum, affine=affine, track_running_stats=track_running_stats)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.rand(C) + 0.5)
            bn.bias.copy_(torch.randn(C))
    oracle = Oracle(
        C, affine=affine, track_running_stats=track_running_stats, momentum=momentum, weight=bn.weight, bias=bn.bias
    )
    tol = TOLERANCES[dtype]
    for step in range(steps):
        x = make_layout((torch.randn(shape) * (1 + step) + 3 * step).to(dtype), layout).requires_grad_()
        dy = torch.randn(shape).to(dtype)
        y = bn(x)
        y.backward(dy)
        y_ref, dx_ref, dw_ref, db_ref = oracle.step(x, dy)
        assert y.dtype == dtype and y.shape == x.shape
        if layout != "sliced":
            assert y.stride() == x.stride(), "output must keep the input's memory format"
        _assert_close(y, y_ref, tol, f"y step {step}")
        _assert_close(x.grad, dx_ref, tol, f"dx step {step}")
        if affine:
            _assert_close(bn.weight.grad, dw_ref, PARAM_GRAD_TOL[dtype], f"dweight step {step}")
            _assert_close(bn.bias.grad, db_ref, PARAM_GRAD_TOL[dtype], f"dbias step {step}")
            bn.weight.grad = bn.bias.grad = None
        if track_running_stats:
            _assert_close(bn.running_mean, oracle.running_mean, (1e-5, 1e-5), f"running_mean step {step}")
            _assert_close(bn.running_var, oracle.running_var, (1e-5, 1e-5), f"running_var step {step}")
            assert bn.num_batches_tracked.item() == oracle.num_batches_tracked
    bn.eval()
    x = make_layout(torch.randn(shape).to(dtype), layout).requires_grad_()
    dy = torch.randn(shape).to(dtype)
    y = bn(x)
    y.backward(dy)
    y_ref, dx_ref, _, _ = oracle.step(x, dy, training=False)
    _assert_close(y, y_ref, tol, "eval y")
    _assert_close(x.grad, dx_ref, tol, "eval dx")


@pytest.mark.parametrize("shape", SHAPES)
def test_shapes(backend_name, shape):
    _run(shape, "contiguous", torch.float32)


@pytest.mark.parametrize(
    "shape, layout",
    [
        ((4, 3, 5, 7), "channels_last"),
        ((2, 130, 3, 1), "channels_last"),
        ((2, 3, 3, 4, 5), "channels_last"),  # channels_last_3d
        ((4, 3, 5, 7), "permuted"),
        ((2, 3, 3, 4, 5), "permuted"),
        ((6, 3), "permuted"),
        ((3, 5, 9), "sliced"),  # not dense: strided last dim
    ],
)
def test_layouts(backend_name, shape, layout):
    _run(shape, layout, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_dtypes(backend_name, dtype, layout):
    _run((4, 6, 5, 3), layout, dtype)


@pytest.mark.parametrize(
    "affine, momentum, track",
    [
        (False, 0.1, True),
        (True, None, True),  # cumulative moving average, computed on the device
        (False, None, True),
        (True, 0.1, False),  # batch statistics in eval too
        (False, 0.1, False),
    ],
)
def test_options(backend_name, affine, momentum, track):
    kwargs = dict(affine=affine, momentum=momentum, track_running_stats=track)
    _run((3, 5, 4, 3), "contiguous", torch.float32, steps=3, **kwargs)


def test_deterministic(backend_name):
    """Two identical runs give bitwise-identical outputs and gradients."""
    torch.manual_seed(1)
    x = make_layout(torch.randn(5, 7, 6, 9), "channels_last")
    dy = torch.randn_like(x)
    results = []
    for _ in range(2):
        bn = tritonbn.SyncBatchNorm(7)
        xi = x.clone().requires_grad_()
        y = bn(xi)
        y.backward(dy)
        results.append((y, xi.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_large_mean_keeps_fp32_precision(backend_name):
    """|mean| / std = 1e3 must come out at fp32 precision, where naive fp32 E[x^2] - E[x]^2 fails."""
    torch.manual_seed(2)
    shape = (8, 4, 16, 16)
    x = (torch.randn(shape) + 1e3).requires_grad_()
    dy = torch.randn(shape)
    bn = tritonbn.SyncBatchNorm(4)
    y = bn(x)
    y.backward(dy)
    oracle = Oracle(4, weight=bn.weight, bias=bn.bias)
    y_ref, dx_ref, _, _ = oracle.step(x, dy)
    _assert_close(y, y_ref, (1e-5, 1e-5), "y")
    _assert_close(x.grad, dx_ref, (1e-5, 1e-5), "dx")
    _assert_close(bn.running_var, oracle.running_var, (1e-5, 1e-5), "running_var")

    # The same input through the naive one-pass formula in fp32 is far off.
    dims = (0, 2, 3)
    naive_var = (x.detach() ** 2).mean(dims) - x.detach().mean(dims) ** 2
    true_var = x.detach().double().var(dims, unbiased=False)
    assert (naive_var.double() - true_var).abs().max() > 1e-2


def test_loads_batchnorm2d_checkpoint(backend_name):
    torch.manual_seed(3)
    ref = torch.nn.BatchNorm2d(5)
    ref.train()
    ref(torch.randn(4, 5, 3, 3) * 2 + 1)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.normal_()
    bn = tritonbn.SyncBatchNorm(5)
    assert set(bn.state_dict()) == set(ref.state_dict())
    assert set(bn.state_dict()) == set(torch.nn.SyncBatchNorm(5).state_dict())
    bn.load_state_dict(ref.state_dict())
    bn.eval()
    ref.eval()
    x = torch.randn(2, 5, 4, 4)
    torch.testing.assert_close(bn(x), ref(x), atol=1e-5, rtol=1e-5)


def test_functional_matches_module(backend_name):
    torch.manual_seed(4)
    x = torch.randn(4, 3, 5)
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    rm, rv = torch.zeros(3), torch.ones(3)
    y = tritonbn.sync_batch_norm(x, rm, rv, w, b, training=True, momentum=0.2)
    oracle = Oracle(3, momentum=0.2, weight=w, bias=b)
    y_ref, *_ = oracle.step(x, None)
    _assert_close(y, y_ref, (1e-5, 1e-5), "y")
    _assert_close(rm, oracle.running_mean, (1e-6, 1e-6), "running_mean")
    _assert_close(rv, oracle.running_var, (1e-6, 1e-6), "running_var")
    y_eval = tritonbn.sync_batch_norm(x, rm, rv, w, b)
    y_ref, *_ = oracle.step(x, None, training=False)
    _assert_close(y_eval, y_ref, (1e-5, 1e-5), "eval y")


def test_cached_layer_follows_every_setting():
    """The module keeps its settings (``_core.call.LayerSettings``) until a setting changes. Every attribute the record
    is built from, found by recording what ``_settings`` reads, must be one whose change drops the record, and
    changing each one does; so a new setting cannot leave a stale record behind."""
    from tritonbn import modules

    read = set()

    class Recording(tritonbn.SyncBatchNorm):
        def __getattribute__(self, name):
            read.add(name)
            return super().__getattribute__(name)

    m = Recording(3)
    read.clear()
    m._settings()
    settings = {name for name in read if not name.startswith("__") and not callable(getattr(Recording, name, None))}
    assert {"training", "momentum", "eps", "activation", "process_group"} <= settings, settings
    assert settings <= modules._SETTING_NAMES, (
        f"read by _settings but not in _SETTING_NAMES: {settings - modules._SETTING_NAMES}"
    )
    changes = {"training": False, "momentum": 0.5, "eps": 1e-3, "activation": "relu", "negative_slope": 0.2,
               "process_group": None, "track_running_stats": False, modules.NAME: "renamed"}  # fmt: skip
    assert set(changes) == modules._SETTING_NAMES
    for name, value in changes.items():
        m._settings()
        setattr(m, name, value)
        assert modules._CACHED not in m.__dict__, f"setting {name} kept the old record"
