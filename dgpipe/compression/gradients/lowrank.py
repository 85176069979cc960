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

from ..base import Codec, Header, Payload, check_params, check_tensor_specs, make_payload, register_codec

__all__ = ["LowRank", "matrix_view_shape", "factor_product"]

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


def factor_product(h: Header, tensors: tuple[torch.Tensor, ...], param: str, names: tuple[str, str],
                   right_by_rows: bool) -> torch.Tensor:
    """The decoded tensor of a low-rank payload: the product of its two float32 factors.

    Args:
        h: the parsed header; its one param (named ``param``) is the rank ``k``.
        tensors: the left factor ``(m, k)`` and the right one, sent as ``(n, k)`` (``right_by_rows``: it
            is transposed) or ``(k, n)``, for the matrix view ``(m, n)`` of the shape
            (:func:`matrix_view_shape`).
        names: the factors' names, for errors.

    Raises:
        ValueError: the rank or a factor's size disagrees with the header.
    """
    m, n = matrix_view_shape(h.shape)
    (k,) = check_params(h, (param, 0, min(m, n)))
    check_tensor_specs(h, (names[0], torch.float32, m * k), (names[1], torch.float32, k * n))
    left, right = tensors
    right = right.view(n, k).T if right_by_rows else right.view(k, n)
    return (left.view(m, k) @ right).to(h.dtype).view(h.shape)


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
        return factor_product(self.parse(payload), payload.tensors, "rank", ("P", "Q"), right_by_rows=True)
