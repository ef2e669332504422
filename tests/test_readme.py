"""The README's examples run as written."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_custom_layer_example_runs():
    (code,) = [block for block in _python_blocks() if "class SharedStatsBatchNorm" in block]
    namespace = {}
    exec(compile(code, str(README), "exec"), namespace)  # asserts against F.batch_norm itself
    ya, yb = namespace["ya"], namespace["yb"]
    (ya.sum() + (yb * yb).sum()).backward()
    a, b = namespace["a"], namespace["b"]
    ref_a = a.detach().clone().requires_grad_()
    ref_b = b.detach().clone().requires_grad_()
    w = namespace["weight"].detach().clone().requires_grad_()
    bias = namespace["bias"].detach().clone().requires_grad_()
    ref = torch.nn.functional.batch_norm(torch.cat([ref_a, ref_b]), None, None, w, bias, training=True)
    ref_ya, ref_yb = ref.split([a.shape[0], b.shape[0]])
    (ref_ya.sum() + (ref_yb * ref_yb).sum()).backward()
    for got, want in [(a.grad, ref_a.grad), (b.grad, ref_b.grad), (namespace["weight"].grad, w.grad)]:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert yb.stride() == b.stride()
