"""A ``__torch_function__`` tensor subclass that carries metadata through every op, as MONAI's ``MetaTensor`` does.

``Meta(x, meta={...})`` wraps ``x``. Its ``__torch_function__`` runs the op as ``torch.Tensor``'s does (the
outputs come back as ``Meta``), then gives every ``Meta`` output the metadata of the first ``Meta`` argument, and
records each function it was handed in ``Meta.seen``. Like MetaTensor, its ``new_empty`` takes a tuple size only
(``x.new_empty(0)`` raises), so code that calls tensor methods on it inside an autograd Function shows up.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


class Meta(torch.Tensor):
    seen: list = []

    @staticmethod
    def __new__(cls, data: torch.Tensor, meta: dict | None = None):
        out = data.as_subclass(cls)
        out.meta = dict(meta or {})
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        Meta.seen.append(func)
        out = super().__torch_function__(func, types, args, kwargs)
        source = next((a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Meta)), None)
        for o in tree_flatten(out)[0]:
            if isinstance(o, Meta) and source is not None and o is not source:
                o.meta = dict(getattr(source, "meta", {}))
        return out

    def new_empty(self, size, *args, **kwargs):
        if not isinstance(size, tuple | list | torch.Size):
            raise TypeError(f"new_empty(): argument 'size' must be tuple of ints, not {type(size).__name__}")
        return super().new_empty(size, *args, **kwargs)
