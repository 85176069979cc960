"""Low-rank approximation (codec ``lowrank``): two thin factors instead of the matrix.

The tensor is viewed as a matrix ``M`` of ``n0 = shape[0]`` rows (the first dimension
is kept; a 0-d tensor is 1x1) and ``m = numel / n0`` columns, and sent as factors
``P`` (``n0 x r``, orthonormal columns) and ``Q = M^T P`` (``m x r``), decoded as
``P Q^T = P P^T M``: the projection of ``M`` on the span of ``P``. ``P`` comes from
subspace (power) iteration started from a fixed-seed Gaussian sketch::

    P = orth(M G)                               # G: m x r, randn, fixed seed
    repeat power_iters times:  P = orth(M (M^T P))
    Q = M^T P

This is PowerSGD's compressor without its warm start and error feedback (Vogels et
al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019), i.e. the randomized range finder of Halko, Martinsson
& Tropp (SIAM Review 2011); wrap it in :class:`~dgpipe.compression.feedback.ErrorFeedback`
for error compensation. A matrix of rank ``<= r`` is reproduced exactly (to float
rounding), whatever ``power_iters``.
"""

from __future__ import annotations

import math

import torch

from ..base import Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec

__all__ = ["LowRank", "matrix_view_shape"]

SKETCH_SEED = 0x10F7
"""Seed of the Gaussian sketch ``G`` (encode is deterministic)."""


def matrix_view_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, cols)`` of the 2-D view that ``lowrank`` and ``atomo`` factorise: the first
    dimension kept, the rest flattened.

    ``()`` -> ``(1, 1)``; ``(n,)`` -> ``(n, 1)``; ``(a, b, c, ...)`` -> ``(a, b*c*...)``.
    """
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


@register_codec("lowrank", 7)
class LowRank(Codec):
    """Rank-``r`` factors ``P`` (``n0 x r``) and ``Q`` (``m x r``) of the tensor's matrix view.

    Args:
        rank: r >= 1; the effective rank is ``min(rank, n0, m)``.
        power_iters: extra subspace iterations (>= 0); each costs two more matrix
            products and brings ``P`` closer to the top singular vectors.

    Input: a floating tensor (float32/float16/bfloat16/float64), any shape, any device;
    computed in float32, factors sent as float32. Decode returns the original shape,
    dtype and device. Wire::

        nbytes = 4 * r * (n0 + m) + header bytes

    Raises (encode):
        ValueError: non-floating input, or inf/NaN values (a matrix product would
            spread them over the whole decoded tensor).
    """

    def __init__(self, rank: int = 4, power_iters: int = 1) -> None:
        for name, v, lo in (("rank", rank, 1), ("power_iters", power_iters, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"lowrank: {name} must be an int >= {lo}, got {v!r}")
        self.rank, self.power_iters = rank, power_iters

    def encode(self, x: torch.Tensor) -> Payload:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"lowrank codec needs a floating tensor (float32/float16/bfloat16/float64), got {got}")
        n0, m = matrix_view_shape(tuple(x.shape))
        mat = x.detach().reshape(n0, m).to(torch.float32)
        if mat.numel() and not bool(torch.isfinite(mat).all()):
            raise ValueError(
                "lowrank codec got inf/NaN values, which a matrix product spreads over the whole "
                "tensor: replace them first (e.g. torch.nan_to_num) or use codec 'none'"
            )
        r = min(self.rank, n0, m)
        # drawn on CPU, so that a GPU rank sends what a CPU rank would (device generators differ)
        q = torch.randn(m, r, generator=torch.Generator().manual_seed(SKETCH_SEED)).to(mat.device)
        p = torch.linalg.qr(mat @ q).Q
        for _ in range(self.power_iters):
            p = torch.linalg.qr(mat @ (mat.T @ p)).Q
        q = mat.T @ p
        return make_payload(self.codec_id, x.dtype, x.shape, (r,), (p, q))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        n0, m = matrix_view_shape(h.shape)
        (r,) = check_params(h, ("rank", 0, min(n0, m)))
        check_tensor_specs(h, ("P", torch.float32, n0 * r), ("Q", torch.float32, m * r))
        p, q = payload.tensors
        return (p.view(n0, r) @ q.view(m, r).T).to(h.dtype).view(h.shape)
