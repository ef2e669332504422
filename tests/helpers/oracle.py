"""The independent oracle: ``torch.nn.functional.batch_norm`` in float64 on the global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# dtype -> (atol, rtol) for y and dx against the float64 oracle.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
# Gradients of weight and bias are sums over the batch; they get a looser absolute bound.
PARAM_GRAD_TOL = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (5e-2, 1e-2),
    torch.bfloat16: (3e-1, 3e-2),
}


def make_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Return ``x`` (same values) in the named memory layout."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "channels_last":
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        return x.contiguous(memory_format=fmt)
    if layout == "permuted":  # a dense but unusual order: channels innermost, N in the middle
        order = list(range(2, x.dim()))[:1] + [0] + list(range(3, x.dim())) + [1]
        inverse = [order.index(i) for i in range(x.dim())]
        return x.permute(order).contiguous().permute(inverse)
    if layout == "sliced":  # not dense: every other element of a wider tensor along the last dim
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    raise ValueError(layout)


class Oracle:
    """Batch norm state and steps in float64, stepped with ``F.batch_norm``."""

    def __init__(self, C, *, affine=True, track_running_stats=True, momentum=0.1, eps=1e-5, weight=None, bias=None):
        self.momentum, self.eps, self.track = momentum, eps, track_running_stats
        self.weight = weight.detach().double().clone() if affine else None
        self.bias = bias.detach().double().clone() if affine else None
        self.running_mean = torch.zeros(C, dtype=torch.float64) if track_running_stats else None
        self.running_var = torch.ones(C, dtype=torch.float64) if track_running_stats else None
        self.num_batches_tracked = 0

    def step(self, x: torch.Tensor, dy: torch.Tensor | None, training: bool = True):
        """One forward (and backward with ``dy``); returns ``(y, dx, dw, db)`` in float64."""
        x = x.detach().double().requires_grad_(dy is not None)
        w = self.weight.clone().requires_grad_(dy is not None) if self.weight is not None else None
        b = self.bias.clone().requires_grad_(dy is not None) if self.bias is not None else None
        use_batch = training or not self.track
        momentum = 0.0
        if training and self.track:
            self.num_batches_tracked += 1
            momentum = 1.0 / self.num_batches_tracked if self.momentum is None else self.momentum
        y = F.batch_norm(x, self.running_mean, self.running_var, w, b, use_batch, momentum, self.eps)
        if dy is None:
            return y.detach(), None, None, None
        y.backward(dy.double())
        return (
            y.detach(),
            x.grad,
            w.grad if w is not None else None,
            b.grad if b is not None else None,
        )
