"""convert_sync_batchnorm and revert_sync_batchnorm."""

import torch
from torch import nn

import tritonbn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4, momentum=None, eps=1e-3)
        self.inner = nn.Sequential(nn.BatchNorm3d(2, affine=False), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4))
        self.head = nn.BatchNorm1d(6, track_running_stats=False)
        self.synced = nn.SyncBatchNorm(5)
        self.ln = nn.LayerNorm(4)


def test_convert_and_revert_keep_everything():
    torch.manual_seed(0)
    model = Block().to(torch.float64)
    model.bn.weight.requires_grad_(False)
    model.bn.running_mean.normal_()
    model.bn.num_batches_tracked.fill_(7)
    model.inner.eval()
    originals = {name: type(m) for name, m in model.named_modules()}
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    group = object()  # any process group handle; conversion only stores it

    converted = tritonbn.convert_sync_batchnorm(model, process_group=group)
    bns = ["bn", "inner.0", "head", "synced"]
    modules = dict(converted.named_modules())
    for name in bns:
        assert type(modules[name]) is tritonbn.SyncBatchNorm, name
        assert modules[name].process_group is group
    for name in ["conv", "inner.1", "inner.2", "ln"]:
        assert type(modules[name]) is originals[name], "other modules are left alone"
    assert modules["bn"].momentum is None and modules["bn"].eps == 1e-3
    assert not modules["inner.0"].affine and not modules["head"].track_running_stats
    assert not modules["inner.0"].training and modules["bn"].training
    # the very same parameter and buffer objects: device, dtype, requires_grad and optimizer state kept
    for name, p in converted.named_parameters():
        assert p is params[name], name
    for name, b in converted.named_buffers():
        assert b is buffers[name], name
    assert not converted.bn.weight.requires_grad
    assert converted.bn.running_mean.dtype == torch.float64
    assert {k: v for k, v in converted.state_dict().items()}.keys() == state.keys()

    assert type(tritonbn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3))) is tritonbn.SyncBatchNorm

    reverted = tritonbn.revert_sync_batchnorm(converted)
    modules = dict(reverted.named_modules())
    for name in bns:
        assert type(modules[name]) is originals[name], name
    assert modules["synced"].process_group is group
    for name, p in reverted.named_parameters():
        assert p is params[name], name
    for key, value in reverted.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert not modules["inner.0"].training


def test_convert_a_bare_batchnorm_and_revert_a_direct_module():
    bn = nn.BatchNorm3d(4)
    converted = tritonbn.convert_sync_batchnorm(bn)
    assert type(converted) is tritonbn.SyncBatchNorm and converted.weight is bn.weight
    assert type(tritonbn.revert_sync_batchnorm(converted)) is nn.BatchNorm3d
    direct = tritonbn.SyncBatchNorm(4)
    assert type(tritonbn.revert_sync_batchnorm(direct)) is nn.BatchNorm2d
    assert type(tritonbn.revert_sync_batchnorm(direct, default=nn.BatchNorm1d)) is nn.BatchNorm1d


def test_converted_model_runs_and_matches_plain_bn():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    reference.load_state_dict(model.state_dict())
    converted = tritonbn.convert_sync_batchnorm(model)
    x = torch.randn(5, 3, 7, 6)
    torch.testing.assert_close(converted(x), reference(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(converted[1].running_var, reference[1].running_var, atol=1e-6, rtol=1e-6)
