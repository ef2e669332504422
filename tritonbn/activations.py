"""The activations tritonbn fuses after batch norm (and the optional residual add)."""

from __future__ import annotations

from torch import nn

ACTIVATIONS = (None, "relu", "leaky_relu", "silu")


def check_activation(activation, negative_slope) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of None, 'relu', 'leaky_relu', 'silu', got {activation!r}")
    # A tuple, not ``int | float``: torch 2.9's compiler cannot trace types.UnionType.
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, (int, float)):
        raise TypeError(f"negative_slope must be a float, got {type(negative_slope).__name__}")


def output_gives_grad(activation: str | None, negative_slope: float) -> bool:
    """Whether act'(z) can be read from the sign of y = act(z): relu, or leaky_relu with a slope >= 0."""
    return activation == "relu" or (activation == "leaky_relu" and negative_slope >= 0)


def check_output_gives_grad(activation: str | None, negative_slope: float) -> None:
    """Raise unless act'(z) can be read from the saved output y (the ``output=`` launcher argument)."""
    if not output_gives_grad(activation, negative_slope):
        raise ValueError(
            f"output: the sign of y gives act'(z) for relu or leaky_relu with a slope >= 0, not for {activation} "
            f"(slope {negative_slope}); pass residual instead"
        )


# The torch modules whose function the kernels fuse, by name (timm's act layers and fx graphs hold these).
ACTIVATION_MODULES = {nn.ReLU: "relu", nn.LeakyReLU: "leaky_relu", nn.SiLU: "silu"}


def activation_of_module(module: nn.Module) -> tuple[str, float] | None:
    """``(activation, negative_slope)`` the kernels compute for ``module`` (exactly that class), or ``None``."""
    name = ACTIVATION_MODULES.get(type(module))
    if name is None:
        return None
    return name, float(getattr(module, "negative_slope", 0.01))


def activation_module(activation: str | None, negative_slope: float = 0.01) -> nn.Module:
    """The torch module computing ``activation`` (``nn.Identity`` for ``None``): a fused epilogue, unfused."""
    if activation is None:
        return nn.Identity()
    (cls,) = [cls for cls, name in ACTIVATION_MODULES.items() if name == activation]
    return cls(negative_slope) if cls is nn.LeakyReLU else cls()
