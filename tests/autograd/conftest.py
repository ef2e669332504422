"""Fixtures of the autograd tests."""

import pytest

from tritonbn._core import dispatch
from tritonbn.backends.torch import local


@pytest.fixture
def calls(monkeypatch, form):
    """Count the PyTorch backend's local-path calls, and the times it declined a call. ``form``: ``"autograd"`` (an
    eager call records torch's own ops: ``local.recorded``; a call its route finds it does not take,
    ``local.takes_recorded``, counts as declined) or ``"function"`` (that taken away: the autograd.Function over
    ``local.forward`` and ``local.backward``, as the custom ops (torch.compile) and calls without autograd run them).
    """
    seen = {"autograd": 0, "forward": 0, "declined": 0, "backward": 0}

    def counting(key, function):
        def count(*args, **kwargs):
            out = function(*args, **kwargs)
            seen[key if out is not None else "declined"] += 1
            return out

        return count

    monkeypatch.setattr(local, "forward", counting("forward", local.forward))
    monkeypatch.setattr(local, "backward", counting("backward", local.backward))
    if form == "autograd":
        monkeypatch.setattr(local, "recorded", counting("autograd", local.recorded))
        takes = local.takes_recorded

        def declining(*args):
            taken = takes(*args)
            seen["declined"] += not taken
            return taken

        monkeypatch.setattr(local, "takes_recorded", declining)
    else:
        monkeypatch.setattr(local, "takes_recorded", lambda *args: False)
    monkeypatch.setenv("TRITONBN_BACKEND", "torch")
    return seen


@pytest.fixture
def dispatched(monkeypatch) -> list:
    """Each call whose route is chosen (``tritonbn._core.route.route_for``, after the checks), appended to a list (its
    input): a call that repeats its layer's record takes the route kept there, and is not."""
    calls = []
    original = dispatch.route_for

    def count(settings, operands, *args, **kwargs):
        calls.append(operands.input)
        return original(settings, operands, *args, **kwargs)

    monkeypatch.setattr(dispatch, "route_for", count)
    return calls


@pytest.fixture
def routes():
    """The name of the route of every call made in the test, in order (``tritonbn._core.dispatch.watching``)."""
    seen = []
    with dispatch.watching(lambda settings, route: seen.append(route.name)):
        yield seen
