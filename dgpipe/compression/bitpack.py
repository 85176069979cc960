"""Pack unsigned integer codes of any width into bytes, and back (vectorised, any device).

Wire layout of ``pack_bits(codes, bits)`` for ``n`` codes, always exactly
``ceil(n * bits / 8)`` bytes:

* ``bits <= 8``: a little-endian bit stream -- code ``i`` occupies bits
  ``[i * bits, (i + 1) * bits)`` of the stream, bit ``k`` of the stream being bit
  ``k % 8`` of byte ``k // 8``; unused high bits of the last byte are zero.
* ``bits > 8``: the low byte of every code (``n`` bytes), followed by the remaining
  high ``bits - 8`` bits of every code packed by the same rule (recursively). The
  total is still ``n + ceil(n * (bits - 8) / 8) == ceil(n * bits / 8)`` bytes.

Everything is a handful of whole-tensor torch ops -- shifts and ORs over blocks of
``g = 8 / gcd(bits, 8)`` codes, which fill exactly ``g * bits / 8`` bytes (one uint8,
int32 or int64 word) -- with no Python loop over values, so it runs on CPU and CUDA alike.

Usage::

    packed = pack_bits(codes, 12)             # uint8, ceil(codes.numel() * 12 / 8) bytes
    codes2 = unpack_bits(packed, 12, codes.numel())   # int64, codes.flatten() again
"""

from __future__ import annotations

import math
import sys

import torch

__all__ = ["MAX_BITS", "packed_nbytes", "pack_bits", "unpack_bits"]

MAX_BITS = 62
"""Widest code :func:`pack_bits` accepts (quantizers use 1..16; packed indices may need more)."""

_LITTLE = sys.byteorder == "little"


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that :func:`pack_bits` produces for ``n`` codes of ``bits`` bits: ``ceil(n * bits / 8)``."""
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in [1, {MAX_BITS}], got {bits!r}")


def _block(bits: int) -> tuple[int, int, torch.dtype]:
    """``(g, nbytes, word dtype)``: ``g`` codes of ``bits`` bits fill exactly ``nbytes`` bytes."""
    g = 8 // math.gcd(bits, 8)
    nbytes = g * bits // 8
    return g, nbytes, torch.uint8 if nbytes == 1 else torch.int32 if nbytes <= 4 else torch.int64


def _pack_low(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack 1-D non-negative codes (``n > 0``) of ``bits <= 8`` bits into the little-endian bit stream."""
    n = codes.numel()
    if bits == 8:
        return codes.to(torch.uint8)
    g, wbytes, wdtype = _block(bits)
    if n % g:
        codes = torch.nn.functional.pad(codes, (0, g - n % g))
    c = codes.view(-1, g)
    word = torch.empty(c.shape[0], dtype=wdtype, device=c.device).copy_(c[:, 0])
    for j in range(1, g):
        word |= c[:, j].to(wdtype) << (j * bits)
    if wdtype == torch.uint8:
        return word[: packed_nbytes(n, bits)]
    b = word.view(torch.uint8).view(-1, word.element_size())
    b = b if _LITTLE else b.flip(1)
    return b[:, :wbytes].reshape(-1)[: packed_nbytes(n, bits)]


def _unpack_low(packed: torch.Tensor, bits: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_pack_low`: ``n`` codes as 1-D ``dtype``."""
    if bits == 8:
        return packed.to(dtype)
    g, wbytes, wdtype = _block(bits)
    m = (n + g - 1) // g  # words
    if wdtype == torch.uint8:
        word = packed
    else:
        buf = torch.zeros(m, torch.empty(0, dtype=wdtype).element_size(), dtype=torch.uint8, device=packed.device)
        buf[:, :wbytes] = torch.nn.functional.pad(packed, (0, m * wbytes - packed.numel())).view(m, wbytes)
        word = (buf if _LITTLE else buf.flip(1).contiguous()).view(wdtype).view(-1)
    out = torch.empty(m, g, dtype=dtype, device=packed.device)
    mask = (1 << bits) - 1
    for j in range(g):
        torch.bitwise_and(word >> (j * bits), mask, out=out[:, j])
    return out.view(-1)[:n]


def pack_bits(codes: torch.Tensor, bits: int, *, check: bool = True) -> torch.Tensor:
    """Pack unsigned integer ``codes`` of ``bits`` bits each into bytes.

    Args:
        codes: integer tensor (any integer dtype, any shape, any device) with values
            in ``[0, 2**bits)``; read in row-major (``flatten``) order.
        bits: code width, 1..62 (:data:`MAX_BITS`).
        check: verify the value range (one min/max reduction; on CUDA it
            synchronises). Codecs whose codes are in range by construction pass False.

    Returns:
        1-D ``torch.uint8`` tensor of ``ceil(codes.numel() * bits / 8)`` bytes on
        ``codes.device`` (layout in the module docstring).

    Raises:
        ValueError: ``bits`` outside 1..62, ``codes`` not an integer tensor, or (with
            ``check``) a code outside ``[0, 2**bits)``.
    """
    _check_bits(bits)
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"pack_bits needs an integer tensor, got {codes.dtype}")
    codes = codes.reshape(-1)
    if codes.dtype in (torch.uint16, torch.uint32, torch.uint64):  # no shift kernels for these
        codes = codes.to(torch.int64)
    if check and codes.numel():
        lo, hi = torch.aminmax(codes)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= 1 << bits:
            raise ValueError(f"codes must lie in [0, 2**{bits}) = [0, {1 << bits}); got values in [{lo}, {hi}]")
    if codes.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=codes.device)
    if bits <= 8:
        return _pack_low(codes, bits)
    n = codes.numel()
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=codes.device)
    torch.bitwise_and(codes, 0xFF, out=out[:n])
    if bits == 16:
        torch.bitwise_right_shift(codes, 8, out=out[n:])
    else:
        out[n:] = pack_bits(codes >> 8, bits - 8, check=False)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int, *, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes of ``bits`` bits.

    Args:
        packed: 1-D ``torch.uint8`` tensor of exactly ``ceil(n * bits / 8)`` bytes.
        bits: code width, 1..62.
        n: number of codes.
        dtype: integer dtype of the result (``torch.int32`` is faster as an index on CPU).

    Returns:
        1-D tensor of ``n`` codes in ``[0, 2**bits)``, ``dtype``, on ``packed.device``.

    Raises:
        ValueError: bad ``bits``/``n``/``dtype``, or ``packed`` not uint8 of the right length.
    """
    _check_bits(bits)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if dtype not in (torch.int32, torch.int64) or (dtype == torch.int32 and bits > 31):
        raise ValueError(f"dtype must be torch.int64 (or torch.int32 for bits <= 31), got {dtype}")
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != packed_nbytes(n, bits):
        raise ValueError(
            f"packed must be 1-D uint8 of ceil({n} * {bits} / 8) = {packed_nbytes(n, bits)} bytes, "
            f"got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    if bits <= 8:
        return _unpack_low(packed, bits, n, dtype)
    out = unpack_bits(packed[n:], bits - 8, n, dtype=dtype)
    out <<= 8
    out |= packed[:n]
    return out
