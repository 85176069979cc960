"""Randomized Hadamard rotation along the last axis: the ``transform`` step of the low-bit codecs.

A rotation ``y = H D x`` (``D`` a diagonal of random signs, ``H`` the orthonormal
Walsh-Hadamard matrix) spreads a few large outlier features over all coordinates, so
that after it every coordinate of a vector looks alike (close to Gaussian) and a
per-vector scale fits them all. It is orthonormal, so squared error in the rotated
space is squared error in the original one, and it is its own kind of exact inverse:
``x = D H y``. Used this way by QuaRot (Ashkboos et al., 2024), QuIP# (Tseng et al.,
2024) and TAH-Quant (arXiv 2506.01352) for activations and by Suresh et al. (ICML 2017,
"Distributed mean estimation with limited communication") for gradients.

Width ``d`` of the last axis:

- ``d`` a power of two: one ``d x d`` rotation;
- ``d`` with a power-of-two divisor ``b >= MIN_BLOCK`` (e.g. 384 = 3 x 128, 768 =
  3 x 256): a block-diagonal rotation, one ``b x b`` Hadamard per block of ``b``
  consecutive features (after the random signs over all ``d``). No wire overhead;
- otherwise: the vector is zero-padded to the next power of two and rotated as a whole;
  the codec then sends the padded width (the wire counts it).

The transform is :func:`.kernels.fwht.fwht` (``O(d log d)`` per vector, no dense matrix). The signs
come from a fixed seed and ``d``: both sides derive them, nothing is sent.
"""

from __future__ import annotations

import functools

import torch

from ..kernels.fwht import fwht

__all__ = ["MIN_BLOCK", "ROTATION_SEED", "random_signs", "HadamardRotation"]

MIN_BLOCK = 32
"""Smallest power-of-two block a block-diagonal rotation may use (smaller: pad instead)."""
ROTATION_SEED = 0x4AD4
"""Base seed of the random signs (combined with the width, so every width gets its own)."""


def random_signs(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``d`` random signs (+1/-1, float32) from a seed derived from :data:`ROTATION_SEED` and ``d``.
    Computed once per width and device (the same tensor is returned each time: do not modify it; on a GPU
    no copy from the host after the first)."""
    device = torch.device(device)
    return _cpu_signs(d) if device.type == "cpu" else _device_signs(d, device)


@functools.lru_cache(maxsize=64)
def _cpu_signs(d: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(ROTATION_SEED * 1_000_003 + d)
    return (torch.randint(0, 2, (d,), generator=gen) * 2 - 1).to(torch.float32)


@functools.lru_cache(maxsize=64)
def _device_signs(d: int, device: torch.device) -> torch.Tensor:
    return _cpu_signs(d).to(device)


class HadamardRotation:
    """The seeded random-sign Hadamard rotation of vectors of width ``d`` (module docstring).

    Args:
        d: width of the last axis, >= 1.

    Attributes:
        d: input width.
        width: output width (``d``, or the next power of two when padding).
        block: size of each Hadamard block (``width`` when there is one block).
    """

    def __init__(self, d: int) -> None:
        if d < 1:
            raise ValueError(f"a Hadamard rotation needs a last axis of width >= 1, got {d}")
        self.d = d
        low = d & -d  # largest power-of-two divisor
        if low == d or low >= MIN_BLOCK:
            self.width, self.block = d, low
        else:
            self.width = self.block = 1 << (d - 1).bit_length()

    def signs_on(self, device: torch.device | str) -> torch.Tensor:
        """The random signs, float32 ``(d,)`` on ``device`` (:func:`random_signs`; do not modify)."""
        return random_signs(self.d, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate: ``x`` float32 ``(rows, d)`` -> ``(rows, width)`` float32 (a new tensor)."""
        y = x * random_signs(self.d, x.device)
        if self.width != self.d:
            y = torch.nn.functional.pad(y, (0, self.width - self.d))
        return fwht(y.view(y.shape[0], -1, self.block)).view(y.shape[0], self.width)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`forward`: ``y`` float32 ``(rows, width)`` -> ``(rows, d)`` float32."""
        x = fwht(y.reshape(y.shape[0], -1, self.block)).view(y.shape[0], self.width)[:, : self.d]
        return x * random_signs(self.d, y.device)
