"""Pack unsigned integer codes of any width into bytes, and back (vectorised, any device).

Wire layout of ``pack_bits(codes, bits)`` for ``n`` codes, always exactly
``ceil(n * bits / 8)`` bytes:

* ``bits <= 8``: a little-endian bit stream -- code ``i`` occupies bits
  ``[i * bits, (i + 1) * bits)`` of the stream, bit ``k`` of the stream being bit
  ``k % 8`` of byte ``k // 8``; unused high bits of the last byte are zero.
* ``bits > 8``: ``k = (bits - 1) // 8`` planes of ``n`` bytes -- plane ``p`` holds
  byte ``p`` (bits ``8p .. 8p+7``) of every code -- followed by the remaining high
  ``r = bits - 8k`` bits of every code as a bit stream by the rule above. The total is
  still ``k * n + ceil(n * r / 8) == ceil(n * bits / 8)`` bytes, and the bytes of codes
  ``i .. j`` (``i`` a multiple of 8) are contiguous ranges of each part, so codecs can
  pack and unpack block by block (:func:`pack_bits_into`, ``unpack_bits(start=, stop=)``).

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

__all__ = ["MAX_BITS", "index_bits", "packed_nbytes", "pack_bits", "pack_bits_into", "unpack_bits"]

MAX_BITS = 62
"""Widest code :func:`pack_bits` accepts (quantizers use 1..16; packed indices may need more)."""

_LITTLE = sys.byteorder == "little"


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that :func:`pack_bits` produces for ``n`` codes of ``bits`` bits: ``ceil(n * bits / 8)``."""
    return (n * bits + 7) // 8


def index_bits(n: int) -> int:
    """Bits of one position in ``[0, n)``: ``max(1, ceil(log2(n)))``."""
    return max(1, (n - 1).bit_length())


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


def _planes(bits: int) -> tuple[int, int]:
    """``(k, r)``: ``bits`` = ``k`` whole low bytes (planes of ``n`` bytes) + an ``r``-bit stream, ``1 <= r <= 8``."""
    k = (bits - 1) // 8
    return k, bits - 8 * k


def _as_codes(codes: torch.Tensor, bits: int, check: bool) -> torch.Tensor:
    """``codes`` validated and flattened (uint16/32/64 widened to int64: torch has no shifts for them)."""
    _check_bits(bits)
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"pack_bits needs an integer tensor, got {codes.dtype}")
    codes = codes.reshape(-1)
    if codes.dtype in (torch.uint16, torch.uint32, torch.uint64):
        codes = codes.to(torch.int64)
    if check and codes.numel():
        lo, hi = (int(v) for v in torch.aminmax(codes))
        if lo < 0 or hi >= 1 << bits:
            raise ValueError(f"codes must lie in [0, 2**{bits}) = [0, {1 << bits}); got values in [{lo}, {hi}]")
    return codes


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
    codes = _as_codes(codes, bits, check)
    n = codes.numel()
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=codes.device)
    pack_bits_into(out, codes, bits, n, 0, check=False)
    return out


def pack_bits_into(
    out: torch.Tensor, codes: torch.Tensor, bits: int, n: int, start: int, *, check: bool = True
) -> None:
    """Write the codes ``start .. start + len(codes)`` of a stream of ``n`` codes into ``out``.

    Lets a codec pack block by block, while each block is in cache; the bytes are
    those :func:`pack_bits` gives for the whole stream.

    Args:
        out: 1-D ``torch.uint8`` of ``ceil(n * bits / 8)`` bytes (the whole stream).
        codes: integer tensor (flattened) with values in ``[0, 2**bits)``.
        bits: code width, 1..62.
        n: length of the whole stream.
        start: position of ``codes[0]`` in the stream; a multiple of 8.
        check: verify the value range of ``codes``.

    Raises:
        ValueError: bad ``bits``/``codes``, ``start`` not a multiple of 8, the block
            not inside ``[0, n)``, or ``out`` of the wrong size or dtype.
    """
    codes = _as_codes(codes, bits, check)
    m = codes.numel()
    if start % 8 or start < 0 or start + m > n:
        raise ValueError(
            f"start must be a multiple of 8 with start + len(codes) <= n, got start={start}, len={m}, n={n}"
        )
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != packed_nbytes(n, bits):
        raise ValueError(f"out must be 1-D uint8 of {packed_nbytes(n, bits)} bytes, got {out.dtype}{tuple(out.shape)}")
    if m == 0:
        return
    k, r = _planes(bits)
    for p in range(k):  # whole-byte planes: byte p of every code
        torch.bitwise_and(codes >> (8 * p) if p else codes, 0xFF, out=out[p * n + start : p * n + start + m])
    rest = _pack_low(codes >> (8 * k) if k else codes, r)
    o = k * n + start * r // 8
    out[o : o + rest.numel()] = rest


def unpack_bits(
    packed: torch.Tensor,
    bits: int,
    n: int,
    *,
    start: int = 0,
    stop: int | None = None,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: codes ``start .. stop`` (default all ``n``) of the stream.

    Args:
        packed: 1-D ``torch.uint8`` tensor of exactly ``ceil(n * bits / 8)`` bytes.
        bits: code width, 1..62.
        n: number of codes in the stream.
        start, stop: the range of codes wanted (``start`` a multiple of 8), so that a
            codec can decode block by block.
        dtype: ``torch.int64``, or ``torch.int32`` for ``bits <= 31``.

    Returns:
        1-D tensor of ``stop - start`` codes in ``[0, 2**bits)``, ``dtype``, on ``packed.device``.

    Raises:
        ValueError: bad ``bits``/``n``/range/``dtype``, or ``packed`` not uint8 of the right length.
    """
    _check_bits(bits)
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n or start % 8:
        raise ValueError(
            f"need 0 <= start <= stop <= n with start a multiple of 8, got start={start}, stop={stop}, n={n}"
        )
    if dtype not in (torch.int32, torch.int64) or (dtype == torch.int32 and bits > 31):
        raise ValueError(f"dtype must be torch.int64 (or torch.int32 for bits <= 31), got {dtype}")
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != packed_nbytes(n, bits):
        raise ValueError(
            f"packed must be 1-D uint8 of ceil({n} * {bits} / 8) = {packed_nbytes(n, bits)} bytes, "
            f"got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    k, r = _planes(bits)
    m = stop - start
    o = k * n + start * r // 8
    out = _unpack_low(packed[o : o + packed_nbytes(m, r)], r, m, dtype)
    for p in reversed(range(k)):
        out <<= 8
        out |= packed[p * n + start : p * n + stop]
    return out
