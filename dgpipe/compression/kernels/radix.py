"""Fixed-length packing of codes whose level count is not a power of two.

``count`` levels carry ``log2(count)`` bits of information per value, but a whole-bit code
width rounds that up (5 levels in 3 bits). Here ``k`` consecutive codes form one base-``count``
number, ``word = sum(code[k*j + i] * count**i)``, which fits in ``b = bit_length(count**k - 1)``
bits; the words are bit-packed at ``b`` bits (:func:`.bitpack.pack_bits`). ``(k, b)`` is the
pair with ``b <= 31`` and the fewest bits per code (ties: the smaller ``k``) -- part of the wire
format (:func:`radix_layout`):

=====  ==========  ===============
count  k codes in  bits per code
=====  ==========  ===============
3      17 in 27    1.588
5      3 in 7      2.333
6      5 in 13     2.6
7      11 in 31    2.818
2**m   1 in m      m (plain :func:`.bitpack.pack_bits`)
=====  ==========  ===============

The last word is completed with zero codes. Vectorised torch ops, any device; the digits of a
word come back with one integer division and one remainder per code.
"""

from __future__ import annotations

import functools

import torch

from .bitpack import pack_bits, packed_nbytes, unpack_bits

__all__ = ["MAX_COUNT", "radix_layout", "radix_nbytes", "pack_radix", "unpack_radix"]

MAX_COUNT = 1 << 16
"""Most levels a radix-packed code may have."""

_WORD_BITS = 31  # a word fits int32, so that unpacking runs in int32


@functools.lru_cache(maxsize=None)
def radix_layout(count: int) -> tuple[int, int]:
    """``(k, b)``: ``k`` codes of ``count`` levels per word of ``b`` bits (module docstring).

    Raises:
        ValueError: ``count`` not an int in ``[2, MAX_COUNT]``.
    """
    if isinstance(count, bool) or not isinstance(count, int) or not 2 <= count <= MAX_COUNT:
        raise ValueError(f"count must be an int in [2, {MAX_COUNT}], got {count!r}")
    best = (1, (count - 1).bit_length())
    k = 2
    while (b := (count**k - 1).bit_length()) <= _WORD_BITS:
        if b * best[0] < best[1] * k:
            best = (k, b)
        k += 1
    return best


def radix_nbytes(n: int, count: int) -> int:
    """Bytes of :func:`pack_radix` for ``n`` codes of ``count`` levels: ``ceil(ceil(n / k) * b / 8)``."""
    k, b = radix_layout(count)
    return packed_nbytes(-(-n // k), b)


def pack_radix(codes: torch.Tensor, count: int) -> torch.Tensor:
    """Pack codes in ``[0, count)`` ``k`` to a ``b``-bit word (module docstring).

    Args:
        codes: integer tensor, any shape (read in ``flatten`` order), values in ``[0, count)``
            (not checked: codecs make them in range).
        count: number of levels, 2..65536.

    Returns:
        1-D uint8 of :func:`radix_nbytes` bytes on ``codes``' device.
    """
    k, b = radix_layout(count)
    codes = codes.reshape(-1).to(torch.int64)
    if k == 1:
        return pack_bits(codes, b, check=False)
    n = codes.numel()
    m = -(-n // k)
    if m * k != n:
        codes = torch.cat((codes, codes.new_zeros(m * k - n)))
    powers = count ** torch.arange(k, dtype=torch.int64, device=codes.device)
    return pack_bits((codes.view(m, k) * powers).sum(dim=1), b, check=False)


def unpack_radix(packed: torch.Tensor, count: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_radix`: the ``n`` codes, int64 1-D on ``packed``'s device.

    Raises:
        ValueError: ``packed`` not 1-D uint8 of :func:`radix_nbytes` bytes.
    """
    k, b = radix_layout(count)
    if k == 1:
        return unpack_bits(packed, b, n)
    words = unpack_bits(packed, b, -(-n // k), dtype=torch.int32)
    powers = count ** torch.arange(k, dtype=torch.int32, device=packed.device)
    return (words[:, None] // powers % count).reshape(-1)[:n].to(torch.int64)
