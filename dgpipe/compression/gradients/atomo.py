"""``atomo``: unbiased spectral sparsification (sampled singular triplets), ATOMO.

Source:
    H. Wang, S. Sievert, Z. Charles, S. Liu, S. Wright, D. Papailiopoulos, "ATOMO:
    Communication-efficient Learning via Atomic Sparsification", NeurIPS 2018
    (Algorithm 1 with the singular value decomposition as atomic decomposition, and the
    variance-minimising probabilities of its Algorithm 2 under a budget of ``s`` atoms).
"""

from __future__ import annotations

import torch

from ..base import Payload, make_payload, register_codec
from .core import SeededCodec, check_gradient
from .lowrank import factor_product, matrix_view_shape

__all__ = ["Atomo", "atomo_probabilities"]


def atomo_probabilities(weights: torch.Tensor, budget: int) -> torch.Tensor:
    """Variance-minimising inclusion probabilities ``p`` with ``sum(p) = min(budget, #nonzero)``.

    Solves ``min sum_i w_i^2 / p_i`` s.t. ``sum_i p_i = budget``, ``0 <= p_i <= 1``
    (ATOMO, Algorithm 2): the largest weights get ``p = 1`` while ``w_i * budget_left``
    exceeds the sum of the weights not yet set; the rest get ``p_i = budget_left * w_i /
    sum`` of those weights. Vectorised: the prefix set to 1 is found with one cumsum.

    Args:
        weights: 1-D non-negative float tensor (singular values), any order.
        budget: expected number of atoms ``s >= 0``.

    Returns:
        float tensor of the same shape and order, values in ``[0, 1]``; ``p = 1`` for
        every nonzero weight when ``budget`` is at least their count.
    """
    lam, order = torch.sort(weights, descending=True)
    r = lam.numel()
    tails = lam.flip(0).cumsum(0).flip(0)
    left = budget - torch.arange(r, device=lam.device, dtype=lam.dtype)
    fits = lam * left <= tails
    start = int(fits.to(torch.int64).argmax()) if bool(fits.any()) else r
    p_sorted = torch.ones_like(lam)
    if start < r:
        total = tails[start]
        share = left[start] * lam[start:] / total if total > 0 else torch.zeros_like(lam[start:])
        p_sorted[start:] = share.clamp(0, 1)
    return torch.empty_like(p_sorted).scatter_(0, order, p_sorted)


@register_codec("atomo", 12)
class Atomo(SeededCodec):
    """ATOMO with SVD atoms: ``X = sum_i sigma_i u_i v_i^T``, atom ``i`` kept with
    probability ``p_i`` (:func:`atomo_probabilities`) and scaled by ``1 / p_i``.

    ``E[decode(encode(x))] = x`` (unbiased); the number of atoms sent is random with
    mean ``min(budget, rank)``. When ``budget >= rank`` every atom has ``p = 1`` and the
    decode equals ``x`` up to float32 rounding.

    Args:
        budget: expected atoms ``s >= 1`` per tensor.
        seed: seed of the sampling (see :class:`~.gradbase.SeededCodec`).

    Input: floating tensor, any shape (factorised as :func:`~.lowrank.matrix_view_shape`, ``m x n``),
    CPU or CUDA; inf/NaN raise ``ValueError``. Output: same shape, dtype and device.
    The SVD runs in float32.

    Wire: for the ``k`` sampled atoms, ``u_i * sigma_i / p_i`` (``m x k`` float32) and
    ``v_i`` (``k x n`` float32)::

        nbytes = 4 * k * (m + n) + header bytes
    """

    def __init__(self, budget: int = 4, seed: int = 0) -> None:
        super().__init__(seed)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"atomo: budget must be a positive int (expected atoms per tensor), got {budget!r}")
        self.budget = budget

    def encode(self, x: torch.Tensor) -> Payload:
        check_gradient(x, self.name)
        m, n = matrix_view_shape(tuple(x.shape))
        gen = self._next_generator(x.device)
        if m * n == 0:
            u = v = x.new_zeros(0, dtype=torch.float32)
            return make_payload(self.codec_id, x.dtype, x.shape, (0,), (u, v))
        matrix = x.detach().reshape(m, n).float()
        u, sigma, vh = torch.linalg.svd(matrix, full_matrices=False)
        p = atomo_probabilities(sigma, self.budget)
        keep = torch.rand(p.shape, generator=gen, device=p.device) < p
        idx = keep.nonzero().view(-1)
        coef = sigma[idx] / p[idx]
        u_kept = (u[:, idx] * coef).contiguous()
        v_kept = vh[idx, :].contiguous()
        return make_payload(self.codec_id, x.dtype, x.shape, (idx.numel(),), (u_kept, v_kept))

    def decode(self, payload: Payload) -> torch.Tensor:
        return factor_product(self.parse(payload), payload.tensors, "atoms", ("u", "v"), right_by_rows=False)
