"""Benchmark set-up: the device, the interpreter on CPU, a real process group for the synchronized paths.

``TRITONBN_TEST_DEVICE=cuda`` (the GPU check script) benchmarks the compiled kernels on the GPU at
full sizes. Otherwise the suite is a CPU smoke run at small sizes, with the kernels under the
Triton interpreter: it checks that every case and provider runs, and its times measure nothing.
"""

import datetime
import os
import socket
import sys

DEVICE = os.environ.get("TRITONBN_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "helpers"))
    from fast_interpreter import install  # noqa: E402

    install()  # the interpreter without the costs the smoke run does not need (see tests/helpers/fast_interpreter.py)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def device():
    return torch.device(DEVICE)


@pytest.fixture(scope="session")
def process_group(device):
    """A one-rank process group: the synchronized code paths run with a real collective in them."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    yield dist.group.WORLD
    dist.destroy_process_group()
