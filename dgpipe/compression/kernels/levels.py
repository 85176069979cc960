"""The codebook steps: scaled values -> index of the nearest of ``2**bits`` levels -> packed codes, and back.

- :func:`nearest_level`: the reference assignment (``torch.bucketize`` on the midpoints
  between neighbouring levels; or stochastic rounding between the two neighbours);
- :func:`level_codes`: the packed indices of values in wire order;
- :func:`level_values`: ``levels[code] * scale[group]``;
- :func:`row_rms`: the per-group scale, each row's root mean square, summed in a fixed
  order (a pairwise fold) that every backend repeats exactly;
- :func:`level_rows` / :func:`level_rows_values`: a whole token-grouped message -- rotation,
  :func:`row_rms`, the scale's rounding, :func:`level_codes` -- in one compiled pass per
  row on CPU (:mod:`.rows`, compiled C) or one launch on a GPU (:mod:`.triton_rows`), and its
  decode; None where that does not apply (the codec then runs the steps one by one: the reference).

Compiled on CPU (:mod:`.compiled`) and GPU (:mod:`.triton_codes`) for codes of up to
:data:`.compiled.MAX_LEVEL_BITS` bits: the whole chunks there, the ``n % CHUNK`` tail
here; the same bytes (golden payloads).

Reference: Lloyd-Max quantization (Max, IRE Trans. IT 1960; Lloyd, IEEE Trans. IT 1982):
the nearest level is the MSE-optimal assignment for fixed levels.
"""

from __future__ import annotations

import numpy as np
import torch

from . import compiled
from . import rows as row_pass
from .backend import empty
from .dispatch import choose, kernels_of
from .bitpack import CHUNK, pack_bits, packed_nbytes, unpack_bits
from .uniform import divide, in_groups, pack_tail, values_tail

__all__ = ["nearest_level", "level_codes", "level_values", "row_rms", "level_rows", "level_rows_values"]


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
    backend = "torch" if stochastic or bits > compiled.MAX_LEVEL_BITS else choose(v)
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
    backend = "torch" if bits > compiled.MAX_LEVEL_BITS else choose(packed, n)
    if backend != "torch":
        y = empty(n, torch.float32, packed)
        if kernels_of(backend).decode_levels(packed, bits, levels, scale, group_len, y):
            return values_tail(y, lambda start: levels[unpack_bits(packed, bits, n, start=start)]
                               * scale[torch.arange(start, n, device=packed.device) // group_len])
    values = in_groups(levels[unpack_bits(packed, bits, n, dtype=torch.int64)], group_len)
    return (values * scale[:, None]).reshape(-1)[:n]


def row_rms(rows: torch.Tensor) -> torch.Tensor:
    """Root mean square of each row, ``sqrt(sum(row^2) / len)``, in float64 and rounded to float32.

    The squares of float32 values are exact in float64 and cannot overflow; their sum is a
    pairwise fold in a fixed order -- while ``m > 1`` values remain, add the upper
    ``m - ceil(m/2)`` to the lower ones -- so that it does not depend on the SIMD width or
    thread count of a library's reduction, and a compiled kernel repeats it bit for bit
    (:mod:`.rows`, :mod:`.triton_rows`); the division by the width is IEEE everywhere
    (:func:`.uniform.divide`). The square root is taken in float64 and rounded to float32: torch's
    float32 square root on CPU is not correctly rounded (measured: 17% of results 1 ulp off on an
    AVX-512 machine); its float64 one is off by an ulp of float64 at most, which moves the float32
    result only with a chance of about ``2**-29`` per row.

    Args:
        rows: float32 ``(n_groups, group_len)``.

    Returns:
        float32 ``(n_groups, 1)``; inf or NaN where a row holds inf or NaN.
    """
    sq = rows.double().square()
    m = sq.shape[1]
    while m > 1:
        h = (m + 1) // 2
        sq[:, : m - h] += sq[:, h:m]
        m = h
    return divide(sq[:, :1], rows.shape[1]).sqrt().float()


def _rotation_args(rotation, d: int, device: torch.device) -> tuple:
    """``(signs, width, block)`` of a :class:`..steps.hadamard.HadamardRotation` (None: no rotation), the signs
    on ``device``."""
    return (None, d, d) if rotation is None else (rotation.signs_on(device), rotation.width, rotation.block)


def level_rows(x: torch.Tensor, rotation, levels: torch.Tensor, bits: int,
               meta_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A token-grouped codebook message in one compiled pass per row: each row of ``x`` rotated,
    scaled by its :func:`row_rms` rounded up to ``meta_dtype``, coded to the nearest level and packed.

    The same bytes as the steps one by one (rotation, :func:`row_rms`,
    :func:`..steps.grouping.round_meta`, :func:`level_codes`; golden payloads).

    Args:
        x: float32 ``(rows, d)``, contiguous.
        rotation: a :class:`..steps.hadamard.HadamardRotation` of width ``d`` (its ``signs``,
            ``width``, ``block``), or None.
        levels: float32 ``(2**bits,)`` ascending.
        bits: code width.
        meta_dtype: dtype of the scales on the wire.

    Returns:
        ``(packed, scales)``: uint8 ``(ceil(rows * width * bits / 8),)`` and ``meta_dtype``
        ``(rows,)``; None where it does not apply (:func:`.rows.applies`: kernels off, more than
        :data:`.rows.MAX_BITS` bits, another scale dtype, the compiled extension not built; on a GPU
        :func:`.triton_rows.applies`) or, on CPU, the input holds inf/NaN or a scale overflows ``meta_dtype``
        (the steps then raise the error; on a GPU the scales sent are not finite and the decoder refuses
        them).
    """
    if not x.is_contiguous():
        return None
    signs, width, block = _rotation_args(rotation, x.shape[1], x.device)
    if choose(x, least=1) == "triton":
        from . import triton_rows

        if not triton_rows.applies(bits, x, meta_dtype, width, block):
            return None
        return triton_rows.encode_rows(x, signs, width, block, levels, bits, meta_dtype)
    done = row_pass.encode_rows(x, signs, width, block, (levels[1:] + levels[:-1]) / 2, bits, meta_dtype)
    if done is None:
        return None
    packed, scales, tail = done
    n = x.shape[0] * width
    pack_tail(packed, n, bits, lambda start: torch.from_numpy(tail).to(torch.int32))
    return packed, scales.to(meta_dtype)


def level_rows_values(packed: torch.Tensor, bits: int, levels: torch.Tensor, scales: torch.Tensor, rows: int, d: int,
                      rotation) -> torch.Tensor | None:
    """Inverse of :func:`level_rows`: ``levels[code] * scale[row]``, then the inverse rotation, per row.

    Args:
        packed: uint8 stream of ``rows * width`` codes of ``bits`` bits.
        levels: float32 ``(2**bits,)``.
        scales: ``(rows,)`` per-row scales as sent (any float dtype).
        rows, d, rotation: as for :func:`level_rows`.

    Returns:
        float32 ``(rows, d)``, the same bits as :func:`level_values` and the inverse rotation; None
        where it does not apply.
    """
    signs, width, block = _rotation_args(rotation, d, packed.device)
    if choose(packed, rows * width, least=1) == "triton":
        from . import triton_rows

        if not triton_rows.applies(bits, packed, scales.dtype, width, block):
            return None
        return triton_rows.decode_rows(packed, bits, levels.float(), scales.reshape(-1), rows, d, signs, width, block)
    if not row_pass.applies(bits, packed):
        return None
    n = rows * width
    full = n - n % CHUNK
    tail = unpack_bits(packed, bits, n, start=full, dtype=torch.int32).to(torch.uint8).numpy() if full < n else \
        np.empty(0, np.uint8)
    return row_pass.decode_rows(packed, bits, levels.float().contiguous(), scales.float().reshape(-1).contiguous(),
                                tail, rows, d, signs, width, block)
