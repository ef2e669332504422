"""Checks that need a CUDA GPU and the compiled kernels (run with TRITON_INTERPRET unset or 0).

1. A full training step of a small model (forward, backward, SGD step) captured in a CUDA graph and
   replayed matches the same steps run eagerly: parameters, running statistics, num_batches_tracked
   (momentum=None, so the cumulative factor is read on the device at every replay).
2. An empty batch captured in a CUDA graph: the empty-rank guard lives in the kernels.
3. Forward and backward under torch.cuda.set_sync_debug_mode("error"): no host synchronization.
4. A layer large enough for the two-level merge of the partials (tritonbn.kernels._common.merge_tree):
   bitwise-identical results over repeated eager steps and CUDA-graph replays, every ticket counter
   back at zero, and the statistics and gradients close to float64 torch.
5. The direct launch (tritonbn/kernels/_launch.py) is the path a repeated step takes (no call of
   Triton's ``JITFunction.run``), and gives the same bits as Triton's own launch path.
6. Every launch made so far fitted its grid to its compiled kernel's occupancy: at most one wave of
   programs on this GPU (unless the channel blocks alone are more), and no fit left pending.

Run directly (``python tests/helpers/gpu_checks.py``); tests/kernels/test_gpu.py runs it when a GPU is present.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("gpu_checks: unset TRITON_INTERPRET: these checks need the compiled kernels")

import tritonbn  # noqa: E402
from tritonbn.cli.demo import make_model as demo_model  # noqa: E402


def make_model():
    model = demo_model((16, 16, 8)).cuda()
    model[1].momentum = None  # a cumulative average too: num_batches_tracked read on the device
    return model


def batches(n):
    g = torch.Generator(device="cuda").manual_seed(1)
    return [(torch.randn(32, 3, 24, 24, device="cuda", generator=g) * 2 + 1).to(memory_format=torch.channels_last)
            for _ in range(n)]  # fmt: skip


def check_cuda_graph_training_step():
    model = tritonbn.convert_sync_batchnorm(make_model()).to(memory_format=torch.channels_last)
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    data = batches(6)

    def step(m, o, x):
        o.zero_grad(set_to_none=False)
        loss = m(x).square().mean()
        loss.backward()
        o.step()
        return loss

    # Warm up on a side stream (allocates optimizer state), as the CUDA-graph recipe requires.
    static_x = data[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in data[:2]:
            static_x.copy_(x)
            step(model, opt, static_x)
    torch.cuda.current_stream().wait_stream(side)
    for x in data[:2]:
        step(eager, eager_opt, x)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_x)
    for x in data[2:]:
        static_x.copy_(x)
        graph.replay()
        eager_loss = step(eager, eager_opt, x)
        torch.testing.assert_close(static_loss, eager_loss, atol=1e-4, rtol=1e-4)
    torch.cuda.synchronize()
    for (k, a), b in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert torch.equal(a, b), f"{k}: {a} != {b}"
    assert model[1].num_batches_tracked.item() == len(data)
    print("cuda graph: captured training step replays like eager, buffers included")


def check_empty_batch_in_graph():
    bn = tritonbn.SyncBatchNorm(8).cuda()
    x = torch.empty(0, 8, 5, 5, device="cuda")
    bn(x)  # warm-up compiles the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bn(x)
    graph.replay()
    torch.cuda.synchronize()
    # one process counts an empty step as torch's module does: the warm-up and the replay
    assert y.shape == x.shape and bn.num_batches_tracked.item() == 2
    assert torch.equal(bn.running_mean, torch.zeros(8, device="cuda"))
    print("cuda graph: an empty batch is handled in the kernels")


def check_no_host_sync():
    bn = tritonbn.SyncBatchNorm(16, momentum=None).cuda()
    x = torch.randn(8, 16, 9, 9, device="cuda", requires_grad=True).to(memory_format=torch.channels_last)
    bn(x).sum().backward()  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for dtype in (torch.float32, torch.bfloat16):
            xi = x.detach().to(dtype).requires_grad_()
            y = bn(xi)
            y.backward(torch.ones_like(y))
        bn.eval()
        bn(x.detach())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print("sync debug mode: training forward, backward and eval ran without a host synchronization")


def check_two_level_merge():
    """The two-level merge, forced (a GPU plan merges in one level while the partials are at most
    _FLAT_MERGE_BYTES, which this layer's fitted grid may be)."""
    from tritonbn.kernels import _plan

    flat_bytes, _plan._FLAT_MERGE_BYTES = _plan._FLAT_MERGE_BYTES, 0
    _plan.clear_caches()
    try:
        _check_two_level_merge()
    finally:
        _plan._FLAT_MERGE_BYTES = flat_bytes
        _plan.clear_caches()


def _check_two_level_merge():
    from tritonbn.kernels import _plan, _workspace

    x0 = torch.randn(8, 64, 56, 56, device="cuda").to(memory_format=torch.channels_last) * 3 + 1
    dy = torch.randn_like(x0)
    for p in (_plan.plan(x0.shape, x0, tile_scale=2, per_sm=1, merges=True),
              _plan.plan(x0.shape, dy, x0, x0, per_sm=1, merges=True)):  # fmt: skip
        assert p.merge_subtrees > 1, f"expected a two-level merge even at one program per SM, got {p}"
    bn = tritonbn.SyncBatchNorm(64).cuda()
    x = x0.clone().requires_grad_()

    def step():
        y = bn(x)
        return [y.detach(), *torch.autograd.grad(y, [x, bn.weight, bn.bias], dy)]

    first = step()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, step(), strict=True)), "eager steps differ"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # the side stream's workspace exists before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = step()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(first, captured, strict=True)), "graph replay differs from eager"
    assert all(not ws.tickets.any() for ws in _workspace._workspaces.values()), "a ticket counter was left non-zero"
    ref_x = x0.double().cpu().requires_grad_()
    ref = torch.nn.functional.batch_norm(ref_x, None, None, bn.weight.double().cpu(), bn.bias.double().cpu(), True)
    ref.backward(dy.double().cpu())
    torch.testing.assert_close(first[0].double().cpu(), ref.detach(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[1].double().cpu(), ref_x.grad, atol=1e-4, rtol=1e-4)
    print("two-level merge: bitwise identical over eager steps and graph replays; tickets at zero; matches float64")


def check_direct_launch():
    import triton
    from triton.runtime.jit import JITFunction

    from tritonbn.kernels import _launch

    assert _launch.DIRECT, f"the direct launch is off with triton {triton.__version__}"

    def step():
        torch.manual_seed(0)
        bn = tritonbn.SyncBatchNorm(24, activation="relu").cuda()
        x = torch.randn(6, 24, 7, 9, device="cuda").to(memory_format=torch.channels_last).requires_grad_()
        r = torch.randn(6, 24, 7, 9, device="cuda", requires_grad=True)
        y = bn(x, r)
        y.backward(torch.randn_like(y))
        bn.eval()
        return [y, x.grad, r.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var, bn(x.detach(), r)]

    step()  # finds the kernels through Triton's path
    calls = []
    original = JITFunction.run

    def counting(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    JITFunction.run = counting
    try:
        direct = step()
        assert not calls, f"{len(calls)} launches of a repeated step went through JITFunction.run"
        _launch.DIRECT = False
        through_triton = step()
        assert len(calls) == 5, f"Triton's path took {len(calls)} launches, expected 5"
    finally:
        JITFunction.run = original
        _launch.DIRECT = True
    for i, (a, b) in enumerate(zip(direct, through_triton, strict=True)):
        assert torch.equal(a, b), f"result {i} differs between the direct launch and Triton's"
    print("direct launch: a repeated step skips JITFunction.run and gives Triton's path's bits")


def check_fitted_grids():
    from tritonbn.kernels import _launch, backward_elemt, backward_reduce, elemt, stats

    sm = _launch.device_sm(torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    seen = 0
    for module in (stats, elemt, backward_reduce, backward_elemt):
        for launch in module._launches.values():
            assert launch.refit is None, f"{launch.fn.__name__}: a fit was left pending"
            for *_, compiled in launch.compiled.values():
                wave = sms * _launch.programs_per_sm(compiled.n_regs, launch.options["num_warps"],
                                                     compiled.metadata.shared, sm)  # fmt: skip
                c_blocks, r_progs = launch.grid
                assert c_blocks * r_progs <= wave or r_progs == 1, (launch.fn.__name__, launch.grid, wave)
                seen += 1
    assert seen, "no compiled launch to check"
    print(f"fitted grids: {seen} compiled launches, each at most one wave at its occupancy")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("gpu_checks: no CUDA device")
    check_direct_launch()
    check_two_level_merge()
    check_cuda_graph_training_step()
    check_empty_batch_in_graph()
    check_no_host_sync()
    check_fitted_grids()
    print("gpu checks passed")
