"""Fixtures of the autograd tests."""

import pytest

from tritonbn import modules
from tritonbn.backends.torch import local


@pytest.fixture
def calls(monkeypatch, form):
    """Count the PyTorch backend's local-path calls, and the times it declined. ``form``: ``"autograd"`` (an eager
    call records torch's own ops: ``local.recorded``) or ``"function"`` (that taken away: the autograd.Function over
    ``local.forward`` and ``local.backward``, as the custom ops (torch.compile) and calls without autograd run them).
    """
    seen = {"autograd": 0, "forward": 0, "declined": 0, "backward": 0}

    def counting(key, function):
        def count(*args):
            out = function(*args)
            seen[key if out is not None else "declined"] += 1
            return out

        return count

    monkeypatch.setattr(local, "forward", counting("forward", local.forward))
    monkeypatch.setattr(local, "backward", counting("backward", local.backward))
    recorded = counting("autograd", local.recorded) if form == "autograd" else lambda *args: None
    monkeypatch.setattr(local, "recorded", recorded)
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    return seen


@pytest.fixture
def dispatched(monkeypatch) -> list:
    """Each call of the whole dispatch (``tritonbn._core.dispatch.run``) that the module makes, appended to a list
    (its input): a call that the module's straight paths (``evaluated_again``, ``trained_again``) take is not."""
    calls = []
    original = modules.run

    def count(*args, **kwargs):
        calls.append(args[1].input)
        return original(*args, **kwargs)

    monkeypatch.setattr(modules, "run", count)
    return calls
