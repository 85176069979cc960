"""Pack unsigned integer codes of any width into bytes, and back (vectorised, any device).

Wire layout of ``pack_bits(codes, bits)`` for ``n`` codes -- always exactly
``ceil(n * bits / 8)`` bytes, every bit used:

1. ``k = (bits - 1) // 8`` byte planes of ``n`` bytes: plane ``p`` holds byte ``p``
   (bits ``8p .. 8p+7``) of every code (none when ``bits <= 8``);
2. the remaining ``r = bits - 8k`` high bits of every code (``1 <= r <= 8``):

   * in chunks of :data:`CHUNK` codes, each ``CHUNK * r / 8`` bytes: the chunk's codes
     form ``g = 8 / gcd(r, 8)`` lanes of ``CHUNK / g`` consecutive codes; word ``j``
     (``g * r`` bits, i.e. ``w = g * r / 8`` bytes) holds code ``j`` of lane ``l`` at
     bits ``l*r .. l*r + r - 1``; the chunk is ``w`` byte planes of ``CHUNK / g`` bytes
     -- plane ``q`` holds byte ``q`` of every word. (``r = 8``: the bytes as they are;
     ``r = 4``: byte ``j`` = code ``j`` + 16 * code ``j + 2048``.)
   * the last ``n % CHUNK`` codes as a little-endian bit stream: code ``i`` at bits
     ``i*r .. i*r + r - 1``, bit ``b`` of the stream being bit ``b % 8`` of byte
     ``b // 8``; unused high bits of the last byte are zero.

Lanes rather than neighbouring codes share a byte so that every step is an
elementwise op on contiguous slices (several times faster on CPU than strided
ones), and a chunk or byte plane of codes ``i .. j`` (``i`` a multiple of
:data:`CHUNK`) is a contiguous byte range, so codecs can pack and unpack block by block
(:func:`pack_bits_into`, ``unpack_bits(start=, stop=)``). No Python loop runs over
values; it runs on CPU and CUDA alike.

Usage::

    packed = pack_bits(codes, 12)                     # uint8, ceil(codes.numel() * 12 / 8) bytes
    codes2 = unpack_bits(packed, 12, codes.numel())   # int64, codes.flatten() again
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "CHUNK", "MAX_BITS", "index_bits", "packed_nbytes", "pack_bits", "pack_bits_into", "unpack_bits",
    "layout_planes", "layout_word",
]

MAX_BITS = 62
"""Widest code :func:`pack_bits` accepts (quantizers use 1..16; packed indices may need more)."""

CHUNK = 4096
"""Codes per chunk of the sub-byte part of the layout (a multiple of 8; part of the wire format)."""


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that :func:`pack_bits` produces for ``n`` codes of ``bits`` bits: ``ceil(n * bits / 8)``."""
    return (n * bits + 7) // 8


def index_bits(n: int) -> int:
    """Bits of one position in ``[0, n)``: ``max(1, ceil(log2(n)))``."""
    return max(1, (n - 1).bit_length())


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in [1, {MAX_BITS}], got {bits!r}")


def layout_word(r: int) -> tuple[int, int, torch.dtype]:
    """``(g, w, dtype)``: ``g`` codes of ``r <= 8`` bits fill exactly ``w`` bytes, held in ``dtype``."""
    g = 8 // math.gcd(r, 8)
    w = g * r // 8
    return g, w, torch.uint8 if w == 1 else torch.int32 if w <= 4 else torch.int64


def _pack_chunks(codes: torch.Tensor, r: int, out: torch.Tensor) -> None:
    """Chunks (``len(codes)`` a multiple of :data:`CHUNK`) of ``r``-bit codes into ``out`` (uint8)."""
    g, w, wdtype = layout_word(r)
    if g == 1:
        out.copy_(codes)
        return
    lanes = codes.view(-1, g, CHUNK // g)
    planes = out.view(-1, w, CHUNK // g)
    if w == 1:  # one byte per word: accumulate in place in out (the lanes' bits do not overlap)
        torch.add(lanes[:, 0], lanes[:, 1], alpha=1 << r, out=planes[:, 0])
        for lane in range(2, g):
            planes[:, 0].add_(lanes[:, lane], alpha=1 << (lane * r))
        return
    word = lanes[:, 0].to(wdtype, copy=True)
    for lane in range(1, g):
        word.add_(lanes[:, lane].to(wdtype), alpha=1 << (lane * r))
    for q in range(w):
        torch.bitwise_and(word >> (8 * q) if q else word, 0xFF, out=planes[:, q])


def _unpack_chunks(packed: torch.Tensor, r: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_pack_chunks`: the 1-D codes as ``dtype``."""
    g, w, wdtype = layout_word(r)
    if g == 1:
        return packed.to(dtype)
    planes = packed.view(-1, w, CHUNK // g)
    word = planes[:, 0].to(wdtype)
    for q in range(1, w):
        word |= planes[:, q].to(wdtype) << (8 * q)
    shifts = torch.arange(0, g * r, r, dtype=wdtype, device=packed.device).view(1, g, 1)
    lanes = word.unsqueeze(1) >> shifts
    lanes &= (1 << r) - 1
    return lanes.view(-1).to(dtype)


def _pack_stream(codes: torch.Tensor, r: int, out: torch.Tensor) -> None:
    """``m`` codes of ``r <= 8`` bits as the little-endian bit stream into ``out`` (``ceil(m*r/8)`` bytes)."""
    g, w, _ = layout_word(r)
    m = codes.numel()
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, -m % g)).view(-1, g)
    word = (c << torch.arange(0, g * r, r, device=c.device)).sum(1)  # the codes' bits do not overlap
    b = (word.unsqueeze(1) >> torch.arange(0, 8 * w, 8, device=c.device)) & 0xFF
    out.copy_(b.view(-1)[: out.numel()])


def _unpack_stream(packed: torch.Tensor, r: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_pack_stream`: ``m`` codes as 1-D ``dtype``."""
    g, w, _ = layout_word(r)
    words = -(-m // g)
    b = torch.nn.functional.pad(packed.to(torch.int64), (0, words * w - packed.numel())).view(words, w)
    word = (b << torch.arange(0, 8 * w, 8, device=b.device)).sum(1, keepdim=True)
    codes = (word >> torch.arange(0, g * r, r, device=b.device)) & ((1 << r) - 1)
    return codes.view(-1)[:m].to(dtype)


def layout_planes(bits: int) -> tuple[int, int]:
    """``(k, r)``: ``bits`` = ``k`` whole low bytes (planes of ``n`` bytes) + ``r`` high bits, ``1 <= r <= 8``."""
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


def _check_range(start: int, stop: int, n: int) -> None:
    if not 0 <= start <= stop <= n or start % CHUNK or (stop % CHUNK and stop != n):
        raise ValueError(
            f"a block of codes must start at a multiple of CHUNK = {CHUNK} and end at one or at the end "
            f"of the stream: got start={start}, stop={stop} for a stream of n={n}"
        )


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
        start: position of ``codes[0]`` in the stream: a multiple of :data:`CHUNK`; the
            block ends at a multiple of it too, or at the end of the stream.
        check: verify the value range of ``codes``.

    Raises:
        ValueError: bad ``bits``/``codes``, a block not aligned as above, or ``out`` of
            the wrong size or dtype.
    """
    codes = _as_codes(codes, bits, check)
    m = codes.numel()
    _check_range(start, start + m, n)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != packed_nbytes(n, bits):
        raise ValueError(f"out must be 1-D uint8 of {packed_nbytes(n, bits)} bytes, got {out.dtype}{tuple(out.shape)}")
    if m == 0:
        return
    k, r = layout_planes(bits)
    for p in range(k):  # whole-byte planes: byte p of every code
        torch.bitwise_and(codes >> (8 * p) if p else codes, 0xFF, out=out[p * n + start : p * n + start + m])
    o = k * n + start * r // 8
    if r == 8:  # the top byte is a plane too
        if k:  # shift in the codes' dtype, then narrow: with a uint8 out= CUDA would shift the narrowed codes
            out[o : o + m].copy_(codes >> (8 * k))
        else:
            out[o : o + m].copy_(codes)
        return
    rest = codes >> (8 * k) if k else codes
    full = m - m % CHUNK if start + m == n else m  # codes in whole chunks
    if full:
        _pack_chunks(rest[:full], r, out[o : o + full * r // 8])
    if full < m:
        _pack_stream(rest[full:], r, out[o + full * r // 8 : o + packed_nbytes(m, r)])


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
        start, stop: the range of codes wanted, so that a codec can decode block by
            block: ``start`` a multiple of :data:`CHUNK`, ``stop`` one too or ``n``.
        dtype: ``torch.int64``, or ``torch.int32`` for ``bits <= 31``.

    Returns:
        1-D tensor of ``stop - start`` codes in ``[0, 2**bits)``, ``dtype``, on ``packed.device``.

    Raises:
        ValueError: bad ``bits``/``n``/range/``dtype``, or ``packed`` not uint8 of the right length.
    """
    _check_bits(bits)
    stop = n if stop is None else stop
    _check_range(start, stop, n)
    if dtype not in (torch.int32, torch.int64) or (dtype == torch.int32 and bits > 31):
        raise ValueError(f"dtype must be torch.int64 (or torch.int32 for bits <= 31), got {dtype}")
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != packed_nbytes(n, bits):
        raise ValueError(
            f"packed must be 1-D uint8 of ceil({n} * {bits} / 8) = {packed_nbytes(n, bits)} bytes, "
            f"got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    k, r = layout_planes(bits)
    m = stop - start
    full = m - m % CHUNK if stop == n else m
    work = torch.int32 if bits <= 31 else torch.int64  # int32 arithmetic is much faster on CPU
    o = k * n + start * r // 8
    if full == m:
        out = _unpack_chunks(packed[o : o + full * r // 8], r, work)
    else:
        tail = _unpack_stream(packed[o + full * r // 8 : o + packed_nbytes(m, r)], r, m - full, work)
        out = torch.cat((_unpack_chunks(packed[o : o + full * r // 8], r, work), tail)) if full else tail
    for p in reversed(range(k)):
        out <<= 8
        out |= packed[p * n + start : p * n + stop]
    return out.to(dtype)
