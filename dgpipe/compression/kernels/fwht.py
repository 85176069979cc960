"""The orthonormal fast Walsh-Hadamard transform: the butterflies of the Hadamard rotation.

Reference: Fino and Algazi, "Unified matrix treatment of the fast Walsh-Hadamard
transform", IEEE Trans. Computers 1976. Compiled on CPU (:func:`.compiled.fwht`, the
same butterflies in the same order, so the same bits) for float32 tensors of at least
:data:`.backend.MIN_VALUES` values.
"""

from __future__ import annotations

import math

import torch

from . import compiled
from .dispatch import choose

__all__ = ["fwht"]


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform along the last axis.

    Args:
        x: floating tensor ``(..., b)``, ``b`` a power of two.

    Returns:
        ``x @ H_b / sqrt(b)`` with ``H_b`` Sylvester's Hadamard matrix in natural order
        (``scipy.linalg.hadamard(b)``), same shape and dtype; a new tensor. Applying it
        twice gives ``x`` back (``H_b^2 = b I``).

    Raises:
        ValueError: the last axis is not a power of two.
    """
    b = x.shape[-1]
    if b < 1 or b & (b - 1):
        raise ValueError(f"fwht needs a power-of-two last axis, got {b}")
    if choose(x) == "c":
        y = compiled.fwht(x)
        if y is not None:
            return y
    y = x.reshape(-1, b)
    h = 1
    while h < b:
        pairs = y.view(-1, b // (2 * h), 2, h)
        lo, hi = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((lo + hi, lo - hi), dim=2).view(-1, b)
        h *= 2
    return (y * (1.0 / math.sqrt(b))).view(x.shape)
