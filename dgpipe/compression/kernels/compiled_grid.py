"""Compiled CPU passes (C, ``codes.c``) that find a codec's grid before its values are coded: a tensor's range
(:func:`value_range`), sort quantization's boundary sample sorted (:func:`sort_sample`), the buckets' extrema of a
sampled split (:func:`bucket_extrema`), and a sampled split's whole grid -- with its codes, for a small message,
in the same call (:func:`sampled_grid`).

The same float32 operations, in the same order, as the reference steps (:mod:`.uniform`, :mod:`.buckets`), so
grids and payloads are bit-identical to them; the protocol (None where a pass does not apply, its kernel failed
or the extension was not built) is :mod:`.compiled`'s.

Reference: the radix sort is the textbook LSD radix sort of IEEE-754 keys (Knuth, TAOCP vol. 3, 5.2.5).
"""

from __future__ import annotations

import numpy as np

from .backend import MIN_VALUES, team
from .bitpack import CHUNK, packed_nbytes
from .compiled import MAX_BITS, MAX_SPLIT_BITS, run_kernel

__all__ = ["MIN_SORT_VALUES", "sort_sample", "value_range", "bucket_extrema", "sampled_grid"]

MIN_SORT_VALUES = 2048
"""Smallest sample :func:`sort_sample` takes: below it numpy's sort is as fast (measured: 7 vs 8 us at
1,024 values, 11 vs 18 at 2,048)."""


def sort_sample(x: np.ndarray, positions: np.ndarray | None) -> np.ndarray | None:
    """``np.sort(x[positions])`` (or of all of ``x``) as an LSD radix sort of the float32 bits: three
    passes of 11-bit digits, 2-3x numpy's sort on the 2k-16k values of sort quantization's boundary
    sample, and no input is a bad case (ties, constants).

    Args:
        x: 1-D float32, contiguous.
        positions: int64 indices into ``x`` (the sample), or None for all of ``x``.

    Returns:
        float32 ``(m,)`` ascending, or None where the kernel does not apply (fewer than
        :data:`MIN_SORT_VALUES` values, or off: the caller sorts with numpy).
        Equal to numpy's result value for value, except that the order among equal values may differ:
        ``-0.0`` before ``+0.0``, and NaN (any sign bit) at the end for a positive, the start for a
        negative sign (numpy puts NaN last).
    """
    m = x.size if positions is None else positions.size
    if m < MIN_SORT_VALUES or x.dtype != np.float32 or not x.flags.c_contiguous:
        return None
    pos = None if positions is None else np.ascontiguousarray(positions, np.int64)
    out = np.empty(m, np.float32)
    ok = run_kernel("sort_sample", (), (x.ctypes.data, None if pos is None else pos.ctypes.data, m, out.ctypes.data))
    return out if ok else None


def value_range(x: np.ndarray) -> tuple[np.float32, np.float32] | None:
    """The min and the max of ``x`` in one pass (which replaces ``torch.aminmax``: twice its speed on 2
    threads on the 25.7 MB tensor, where a pass that only reads takes what this one does): the pass of
    :func:`bucket_extrema` with no boundary.

    Takes and gives numpy, as :func:`bucket_extrema`.

    Args:
        x: 1-D float32 contiguous values.

    Returns:
        ``(lo, hi)``: float32 min and max of ``x``, zeros with either sign (which zero a min keeps depends
        on the order of the values), both NaN where ``x`` holds a NaN; None where the fused path does
        not apply (small ``x``, switched off).
    """
    if x.size < MIN_VALUES or not x.flags.c_contiguous:
        return None
    k, threads = team(x.size // CHUNK)  # parts of whole chunks, the last one with the tail
    ext: np.ndarray = np.empty((k, 2), np.float32)  # a row per part: its min and max
    if not run_kernel("value_range", (), (x.ctypes.data, x.size, ext.ctypes.data, k, threads)):
        return None
    if k == 1:
        return np.float32(ext[0, 0]), np.float32(ext[0, 1])
    return np.float32(ext[:, 0].min()), np.float32(ext[:, 1].max())  # a part's NaN propagates


def bucket_extrema(x: np.ndarray, bounds: np.ndarray) -> tuple[np.float32, np.ndarray] | None:
    """The min of ``x`` and the max of each bucket, in one pass over ``x`` that only reads (which replaces
    ``torch.aminmax`` and a ``scatter_reduce``).

    Bucket ``b < 2**S - 1``'s max is the max of the values below boundary ``b`` where the bucket holds any
    (those of the buckets below are smaller than its min), else a value below its min; the top bucket's is
    the max of ``x``. So each lane keeps a running min and, per boundary, a running masked max. Takes and
    gives numpy (a view of the CPU tensor): a small message's time goes to per-call overheads, and numpy's
    are a fraction of torch's.

    Args:
        x: 1-D float32 contiguous values.
        bounds: float32 ``(2**S - 1,)`` non-decreasing boundaries; ``bucket(v)`` is the
            number of boundaries ``<= v`` (:class:`.buckets.BucketIndex`).

    Returns:
        ``(lo, maxs)``: float32 min of ``x`` and float32 ``(2**S,)`` maxima (``-inf`` where no value
        lies below a boundary; the min and the last, the max of ``x``, NaN where ``x`` holds a NaN), such that
        ``max(maxs, (lo, *bounds))`` is each bucket's max as :class:`.sortquant.SortQuantizer` sends it
        (an empty bucket's: its min); zeros as found (the caller makes them ``+0.0``). None where the
        fused path does not apply (``S > 4``, small ``x``, switched off).
    """
    s = (bounds.size + 1).bit_length() - 1
    if x.size < MIN_VALUES or s > MAX_SPLIT_BITS or not x.flags.c_contiguous:
        return None
    n = x.size
    bounds = np.ascontiguousarray(bounds, np.float32)
    k, threads = team(n // CHUNK)  # parts of whole chunks, the last one with the tail
    ext = np.empty((k, bounds.size + 2), np.float32)  # a row per part: its min and maxima
    if not run_kernel("bucket_extrema", (s,), (x.ctypes.data, n, bounds.ctypes.data, s, ext.ctypes.data, k, threads)):
        return None
    if k == 1:
        return ext[0, 0], ext[0, 1:]
    return ext[:, 0].min(), ext[:, 1:].max(0)  # min propagates a part's NaN


def sampled_grid(x: np.ndarray, positions: np.ndarray, ranks: np.ndarray, quant_bits: int,
                 pack: bool = False) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Sort quantization's whole grid of a sampled split in one call -- the sample's radix sort
    (:func:`sort_sample`), its boundaries, the extrema pass (:func:`bucket_extrema`) and the steps --
    and with ``pack`` in the same call the codes of the whole chunks (:func:`encode_buckets`),
    when the kernels run on one thread (:func:`.backend.team`: a tensor under 64 chunks, as a
    pipeline's messages are, or one intra-op thread). A small message's encode costs mostly per call,
    not per value, so one call for all of it halves it.

    Args:
        x: 1-D float32 values, contiguous.
        positions: int64 sample positions, at least :data:`MIN_SORT_VALUES` of them.
        ranks: int64 ``(2**S - 1,)`` ranks of the boundaries in the sorted sample, ``S <= 4``.
        quant_bits: Q (the step is ``(max - min) / (2**Q - 1)``).
        pack: also pack the codes of the whole chunks.

    Returns:
        ``(grid, packed)``: float32 ``(4, 2**S)`` grid, rows ``mins`` (``min, *boundaries``, zeros as
        +0.0), ``step`` (so rows 0-1 are the metadata sent), the divisor (``step``, or 1 where it is
        0), and the min and max of ``x`` in its first two entries (NaN if ``x`` holds one; the caller
        checks the range); the same float32 values as the separate steps. ``packed``: with ``pack``,
        the uint8 stream of ``x.size`` codes of ``Q + S`` bits with the whole chunks written (the
        tail, and all of it where the range is not finite, left to the caller), else None. None
        where the call does not apply (off, more than one thread's share of values, a smaller
        sample, ``S > 4``).
    """
    s = ranks.size.bit_length()
    if (x.size < MIN_VALUES or positions.size < MIN_SORT_VALUES or s > MAX_SPLIT_BITS or quant_bits + s > MAX_BITS
            or team(x.size // CHUNK)[0] > 1 or not x.flags.c_contiguous):
        return None
    positions, ranks = np.ascontiguousarray(positions, np.int64), np.ascontiguousarray(ranks, np.int64)
    grid = np.empty((4, 1 << s), np.float32)
    sample = np.empty(positions.size, np.float32)
    packed = np.empty(packed_nbytes(x.size, quant_bits + s) if pack else 0, np.uint8)
    chunks = x.size // CHUNK if pack else 0
    ok = run_kernel("sampled_grid", (s, quant_bits), (x.ctypes.data, x.size, positions.ctypes.data, positions.size,
                                                ranks.ctypes.data, s, quant_bits, sample.ctypes.data,
                                                grid.ctypes.data, chunks, packed.ctypes.data))
    return (grid, packed if pack else None) if ok else None


# --- a small message in one call ----------------------------------------------------------------------
