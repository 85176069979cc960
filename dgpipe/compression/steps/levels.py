"""Codebooks: the levels (``2**bits`` of them, or any count) a codebook quantizer rounds scaled values to.

- :func:`normal_levels`: the Lloyd-Max quantizer of the standard normal distribution (Max,
  "Quantizing for minimum distortion", IRE Trans. IT 1960; Lloyd, IEEE Trans. IT 1982),
  computed once per bit width from the normal density in closed form: the MSE-optimal
  fixed codebook for Gaussian data, which a Hadamard rotation makes of a vector with
  outlier features;
- :func:`fit_levels`: a Lloyd-Max (1-D k-means) codebook fitted to a tensor's values.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["FIT_SAMPLE", "FIT_ITERATIONS", "FIT_SEED", "normal_levels", "normal_codebook", "normal_codebook_on",
           "fit_levels"]

FIT_SAMPLE = 1 << 16
"""Most values a fitted codebook is computed from."""
FIT_ITERATIONS = 12
FIT_SEED = 0xC0DE


def normal_levels(bits: int) -> torch.Tensor:
    """Lloyd-Max levels of ``N(0, 1)`` for ``2**bits`` levels: :func:`normal_codebook` of ``2**bits``."""
    return normal_codebook(1 << bits)


@functools.lru_cache(maxsize=None)
def normal_codebook(count: int, iterations: int = 200) -> torch.Tensor:
    """Lloyd-Max levels of ``N(0, 1)`` for ``count >= 2`` levels: 1-D float32 ``(count,)``, ascending.

    Alternates the two optimality conditions in float64 -- cell edges halfway between
    levels, each level the conditional mean of its cell,
    ``(phi(a) - phi(b)) / (Phi(b) - Phi(a))`` -- from the asymptotically optimal start
    (quantiles of ``N(0, 3)``). 2 levels give ``+-0.7979`` (``sqrt(2/pi)``); 4 levels
    ``+-0.4528, +-1.5104``; 3 levels ``0, +-1.2240`` (Max's table). An odd count has a level at 0.
    """
    n = count
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    levels = torch.special.ndtri(p) * 3**0.5
    for _ in range(iterations):
        inf = torch.tensor([float("inf")], dtype=torch.float64)
        edges = torch.cat((-inf, (levels[1:] + levels[:-1]) / 2, inf))
        pdf = torch.exp(-0.5 * edges.clamp(-40, 40) ** 2) / (2 * torch.pi) ** 0.5
        mass = torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1])
        levels = torch.where(mass > 0, (pdf[:-1] - pdf[1:]) / mass.clamp(min=1e-300), levels)
    if n % 2:  # the middle level of a symmetric density, exactly
        levels[n // 2] = 0.0
    return levels.to(torch.float32)


def normal_codebook_on(count: int, device: torch.device | str) -> torch.Tensor:
    """:func:`normal_codebook` on ``device``, copied there once (the same tensor each time: do not modify it)."""
    device = torch.device(device)
    return normal_codebook(count) if device.type == "cpu" else _device_codebook(count, device)


@functools.lru_cache(maxsize=64)
def _device_codebook(count: int, device: torch.device) -> torch.Tensor:
    return normal_codebook(count).to(device)


def fit_levels(v: torch.Tensor, count: int) -> torch.Tensor:
    """A Lloyd-Max codebook of ``count`` levels fitted to the values ``v`` (1-D float32, non-empty).

    Up to :data:`FIT_SAMPLE` values (a fixed-seed sample), :data:`FIT_ITERATIONS`
    Lloyd iterations from :func:`normal_codebook`; a level whose cell is empty keeps its
    value. The sample is sorted once, so each cell is a run of it: the cell means come from
    float64 prefix sums, in the same order on every device (a scatter-add on CUDA adds in
    whatever order its atomics land, and two encodes of one tensor would differ).
    Returns 1-D float32, ascending.
    """
    if v.numel() > FIT_SAMPLE:
        gen = torch.Generator(device=v.device).manual_seed(FIT_SEED)
        v = v[torch.randint(v.numel(), (FIT_SAMPLE,), generator=gen, device=v.device)]
    v = v.sort().values
    prefix = torch.cat((v.new_zeros(1, dtype=torch.float64), v.double().cumsum(0)))
    last = torch.full((1,), v.numel(), device=v.device, dtype=torch.long)
    first = torch.zeros_like(last)
    levels = normal_codebook(count).to(v.device)
    for _ in range(FIT_ITERATIONS):
        # a value goes to the nearest level, ties down (bucketize against the midpoints):
        # cell k ends after the last value <= midpoint k
        ends = torch.searchsorted(v, (levels[1:] + levels[:-1]) / 2, right=True)
        bounds = torch.cat((first, ends, last))
        counts = bounds[1:] - bounds[:-1]
        means = (prefix[bounds[1:]] - prefix[bounds[:-1]]) / counts.clamp(min=1)
        levels = torch.where(counts > 0, means.float(), levels).sort().values
    return levels
