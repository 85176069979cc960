"""The codebook steps: scaled values -> index of the nearest of ``2**bits`` levels -> packed codes, and back.

- :func:`nearest_level`: the reference assignment (``torch.bucketize`` on the midpoints
  between neighbouring levels; or stochastic rounding between the two neighbours);
- :func:`level_codes`: the packed indices of values in wire order;
- :func:`level_values`: ``levels[code] * scale[group]``.

Compiled on CPU (:mod:`.numba_codes`) and GPU (:mod:`.triton_codes`) for codes of up to
:data:`.numba_codes.MAX_LEVEL_BITS` bits: the whole chunks there, the ``n % CHUNK`` tail
here; the same bytes (golden payloads).

Reference: Lloyd-Max quantization (Max, IRE Trans. IT 1960; Lloyd, IEEE Trans. IT 1982):
the nearest level is the MSE-optimal assignment for fixed levels.
"""

from __future__ import annotations

import torch

from . import numba_codes
from .backend import choose, empty, kernels_of
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .uniform import in_groups, pack_tail, values_tail

__all__ = ["nearest_level", "level_codes", "level_values"]


def nearest_level(v: torch.Tensor, levels: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """Index (int32) of the level nearest to each value of ``v``, or, with ``stochastic``, of the lower or
    upper neighbouring level with probabilities that make the decoded value unbiased (between the levels).

    Args:
        v: float32, any shape.
        levels: 1-D ascending float32, at least 2 values.
    """
    if not stochastic:
        return torch.bucketize(v, (levels[1:] + levels[:-1]) / 2).to(torch.int32)
    i = (torch.bucketize(v, levels, right=True) - 1).clamp_(0, levels.numel() - 2)
    lo, hi = levels[i], levels[i + 1]
    up = torch.rand_like(v) < ((v - lo) / (hi - lo)).clamp_(0, 1)
    return (i + up).to(torch.int32)


def level_codes(v: torch.Tensor, levels: torch.Tensor, bits: int, stochastic: bool = False) -> torch.Tensor:
    """Packed :func:`nearest_level` indices of ``v``.

    Args:
        v: 1-D float32 scaled values, wire order, ``n >= 1``.
        levels: float32 ``(2**bits,)`` ascending.
        bits: code width, 1..16.
        stochastic: stochastic rounding (the reference runs it).

    Returns:
        uint8 ``(ceil(n * bits / 8),)`` on ``v``'s device.
    """
    backend = "torch" if stochastic or bits > numba_codes.MAX_LEVEL_BITS else choose(v)
    if backend != "torch":
        n = v.numel()
        out = empty(packed_nbytes(n, bits), torch.uint8, v)
        if kernels_of(backend).encode_levels(v, (levels[1:] + levels[:-1]) / 2, bits, out):
            return pack_tail(out, n, bits, lambda start: nearest_level(v[start:], levels, False))
    return pack_bits(nearest_level(v, levels, stochastic), bits, check=False)


def level_values(packed: torch.Tensor, bits: int, n: int, levels: torch.Tensor, scale: torch.Tensor,
                 group_len: int) -> torch.Tensor:
    """``levels[code] * scale[group]`` of ``n >= 1`` codes (1-D float32, wire order).

    Args:
        packed: uint8 stream of ``n`` codes of ``bits`` bits.
        levels: float32 ``(2**bits,)``.
        scale: float32 ``(n_groups,)`` per-group scales; group ``i // group_len`` holds value ``i``.
    """
    scale = scale.reshape(-1)
    backend = "torch" if bits > numba_codes.MAX_LEVEL_BITS else choose(packed, n)
    if backend != "torch":
        y = empty(n, torch.float32, packed)
        if kernels_of(backend).decode_levels(packed, bits, levels, scale, group_len, y):
            return values_tail(y, lambda start: levels[unpack_bits(packed, bits, n, start=start)]
                               * scale[torch.arange(start, n, device=packed.device) // group_len])
    values = in_groups(levels[unpack_bits(packed, bits, n, dtype=torch.int64)], group_len)
    return (values * scale[:, None]).reshape(-1)[:n]
