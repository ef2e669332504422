"""A tensor subclass's call, run uncompiled: a graph break under ``torch.compile``, with tritonbn's reason.

:func:`tritonbn._core.dispatch.run` hands an input with ``__torch_function__`` to torch's protocol
(``handle_torch_function``) through :func:`uncompiled`, so that under ``torch.compile`` the subclass's
``__torch_function__`` and tritonbn's call inside it run eagerly, on plain tensors (torch's own ``nn.BatchNorm2d``
does not compile such an input either); with ``fullgraph=True`` dynamo's error quotes the reason below.

A module of its own, imported by the first subclass call and not by ``import tritonbn``: ``torch.compiler.disable``
imports ``torch._dynamo``, about half the time of ``import tritonbn`` (a second or more), which a process that neither
compiles nor passes a subclass would otherwise pay. Under ``torch.compile`` dynamo runs that import itself.
"""

from __future__ import annotations

import torch

SUBCLASS_BREAK = (
    "tritonbn: a call on a __torch_function__ tensor subclass runs uncompiled (a graph break; torch's own BatchNorm "
    "does not compile such an input either): pass a plain tensor (.as_subclass(torch.Tensor)) to compile it"
)


@torch.compiler.disable(reason=SUBCLASS_BREAK)
def uncompiled(fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)``, uncompiled under ``torch.compile`` (and everything it calls)."""
    return fn(*args, **kwargs)
