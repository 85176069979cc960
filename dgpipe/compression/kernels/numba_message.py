"""Compiled CPU loops (Numba) of sort quantization's grid, and a small message in one call.

- :func:`sort_sample`: the sort of sort quantization's boundary sample, as a radix sort;
- :func:`bucket_extrema`: the min and the per-bucket maxima in one pass over the values
  (each value's bucket by comparison with the ``2**S - 1`` boundaries), for ``S <= 4``;
- a small CPU message in **one call** (:func:`one_call`: whole chunks, one thread's
  share): :func:`uniform_message` (per-tensor ``quant``'s grid and codes after the range),
  :func:`sampled_grid` with ``pack`` (sort quantization's grid and codes) and
  :func:`message_values` (either's decode). A pipeline's messages are small and each is
  coded after a stage's compute has evicted the caches, where every separate step -- a
  torch or numpy call, a kernel launch -- costs 15-25 us: one call is most of the saving.

Same float32 operations, in the same order, as the reference steps (:mod:`.buckets`,
:mod:`.uniform`), so the same bytes (golden payloads). Same protocol as
:mod:`.numba_codes`: None or False where a function does not apply (or its kernel
failed); the calling step then runs the reference.

Reference: the radix sort is the textbook LSD radix sort of IEEE-754 keys (Knuth, TAOCP
vol. 3, 5.2.5); the vectorisation tricks are ours.
"""

from __future__ import annotations

import numpy as np
import torch

from . import backend
from .backend import MIN_VALUES, parts
from .bitpack import CHUNK, packed_nbytes
from .numba_codes import (MAX_SPLIT_BITS, build_decode_buckets, build_decode_uniform, build_encode_buckets,
                          build_encode_uniform, jit, stream_part)

__all__ = [
    "RADIX_BITS", "MIN_SORT_VALUES", "sort_sample", "bucket_extrema", "sampled_grid", "one_call", "uniform_message",
    "message_values",
]

RADIX_BITS = 11
"""Bits per digit of :func:`sort_sample`'s radix sort: three passes over 32-bit keys, 2,048 counters each."""

MIN_SORT_VALUES = 2048
"""Smallest sample :func:`sort_sample` takes: below it numpy's sort is as fast (measured: 7 vs 8 us at
1,024 values, 11 vs 18 at 2,048)."""


def _radix_sorter():
    """An inlined Numba function ``sort(x, pos, out)``: ``out[:] = sorted x[pos]`` (all of ``x`` for an empty
    ``pos``), an LSD radix sort of the float32 bits (:func:`sort_sample`)."""
    sign = np.uint32(1 << 31)
    mask = np.uint32((1 << RADIX_BITS) - 1)
    shifts = (0, RADIX_BITS, 2 * RADIX_BITS)

    @jit(inline=True)
    def sort(x, pos, out):
        # keys: float32 bits made unsigned-monotone (negatives flipped, positives' sign bit set)
        m = out.shape[0]
        keys = np.empty(m, np.uint32)
        tmp = np.empty(m, np.uint32)
        hist = np.zeros((3, mask + 1), np.int64)
        xb = x.view(np.uint32)
        for i in range(m):
            u = xb[pos[i]] if pos.shape[0] else xb[i]
            k = ~u if u & sign else u | sign
            keys[i] = k
            for p in range(3):
                hist[p, (k >> shifts[p]) & mask] += 1
        for p in range(3):  # least significant digit first; each pass is stable
            h = hist[p]
            if h[(keys[0] >> shifts[p]) & mask] == m:
                continue  # one digit for all keys: the pass would move nothing
            total = 0
            for b in range(mask + 1):
                c = h[b]
                h[b] = total
                total += c
            for i in range(m):
                k = keys[i]
                d = (k >> shifts[p]) & mask
                tmp[h[d]] = k
                h[d] += 1
            keys, tmp = tmp, keys
        ob = out.view(np.uint32)
        for i in range(m):
            k = keys[i]
            ob[i] = k ^ sign if k & sign else ~k

    return sort


def _build_sort_sample():
    sort = _radix_sorter()

    @jit()
    def kernel(x, pos, out):
        sort(x, pos, out)

    return kernel


def sort_sample(x: np.ndarray, positions: np.ndarray | None) -> np.ndarray | None:
    """``np.sort(x[positions])`` (or of all of ``x``) as an LSD radix sort of the float32 bits: three
    passes of :data:`RADIX_BITS`-bit digits, 2-3x numpy's sort on the 2k-16k values of sort
    quantization's boundary sample, and no input is a bad case (ties, constants).

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
    pos = np.empty(0, np.int64) if positions is None else positions
    out = np.empty(m, np.float32)
    return out if backend.run(("sort_sample",), _build_sort_sample, [(x, pos, out)]) else None


def _build_bucket_extrema(split_bits: int):
    njit = jit()
    nb = (1 << split_bits) - 1
    one, zero = np.float32(1), np.float32(0)

    @jit(inline=True)
    def update(v, bounds, ext):
        """Fold ``v`` into ``ext = [min, max of bucket 0, ...]``; True if ``v`` is NaN."""
        b = 0
        for j in range(nb):
            b += v >= bounds[j]
        ext[1 + b] = max(ext[1 + b], v)
        ext[0] = min(ext[0], v)
        return v != v

    @njit
    def kernel(x, bounds, lows, low, ext):
        # ext starts at values the min and maxima are known to reach: only values above
        # lows[b] of their bucket b can raise its maximum, and only values below low can
        # lower the min. A vectorised pass flags them (and NaN; lows[b] picked by exact 0/1
        # indicators, as in encode_buckets), a scalar pass folds the flagged few in; ties
        # at those values (the zeros of a ReLU, a saturated top) are never flagged.
        flags = np.zeros(CHUNK, np.uint8)
        words = flags.view(np.uint64)
        n = x.shape[0]
        nan = False
        for c in range(n // CHUNK):
            xs = x[c * CHUNK : (c + 1) * CHUNK]
            for t in range(CHUNK):
                v = xs[t]
                w, prev = zero, one
                for j in range(nb + 1):
                    cur = np.float32(v >= bounds[j]) if j < nb else zero
                    w += lows[j] * (prev - cur)
                    prev = cur
                flags[t] = np.uint8(v > w) | np.uint8(v < low) | np.uint8(v != v)
            for q in range(CHUNK // 8):
                if words[q] == 0:
                    continue
                for t in range(q * 8, q * 8 + 8):
                    if flags[t]:
                        nan |= update(xs[t], bounds, ext)
        for i in range(n // CHUNK * CHUNK, n):
            nan |= update(x[i], bounds, ext)
        if nan:
            ext[0] = np.nan

    return kernel


def bucket_extrema(x: np.ndarray, bounds: np.ndarray, below: np.ndarray, low: np.float32,
                   high: np.float32) -> tuple[np.float32, np.ndarray] | None:
    """The min of ``x`` and the max of each bucket, in one pass over ``x`` (which replaces ``torch.aminmax``).

    Takes and gives numpy (a view of the CPU tensor): a small message's time goes to
    per-call overheads, and numpy's are a fraction of torch's.

    Args:
        x: 1-D float32 values.
        bounds: float32 ``(2**S - 1,)`` non-decreasing boundaries; ``bucket(v)`` is the
            number of boundaries ``<= v`` (:class:`.buckets.BucketIndex`).
        below: float32 ``(2**S - 1,)``: for each boundary the largest sampled value below it,
            or ``-inf`` (none): bucket ``b``'s maximum is at least ``below[b]`` where that lies
            in bucket ``b``, and at least its min ``bounds[b - 1]`` otherwise, so only values
            from there up are candidates.
        low, high: float32 min and max of values of ``x`` (of the sample the boundaries
            come from, so the max lies in the top bucket): only values below the first can
            lower the min, only values above the second raise the top bucket's max.

    Returns:
        ``(lo, maxs)``: float32 min of ``x`` (NaN if ``x`` holds a NaN) and float32
        ``(2**S,)`` maxima, such that ``max(maxs, (lo, *bounds))`` is each bucket's max as
        :class:`.sortquant.SortQuantizer` sends it (an empty bucket's: its min); zeros as found
        (the caller makes them ``+0.0``). None where the fused path does not apply (``S > 4``,
        small ``x``, switched off).
    """
    s = (bounds.size + 1).bit_length() - 1
    if x.size < MIN_VALUES or s > MAX_SPLIT_BITS:
        return None
    n, nb = x.size, bounds.size
    # Bucket b > 0 reaches below[b] (a value in it) and its min bounds[b - 1] (where the caller's
    # max(maxs, mins) puts an empty bucket anyway); the top bucket reaches the sampled max. Bucket 0
    # reaches below[0]: when none was sampled (-inf), its values are all < low and flagged as such,
    # and its window is low (finite: an infinite one times a 0 indicator would be NaN).
    lows = np.empty(nb + 1, np.float32)
    lows[0], lows[1:nb], lows[nb] = low, bounds[:-1], high
    np.maximum(lows[:nb], below, out=lows[:nb])
    ends = [(c0 * CHUNK, c1 * CHUNK) for c0, c1 in parts(n // CHUNK)]
    ends[-1] = (ends[-1][0], n)  # the last part takes the tail
    ext = np.empty((len(ends), nb + 2), np.float32)  # a row per part: the known min and maxima
    ext[:, 0], ext[:, 1], ext[:, 2:] = low, below[0], lows[1:]
    if not backend.run(("bucket_extrema", s), lambda: _build_bucket_extrema(s),
                 [(x[i:j], bounds, lows, low, ext[k]) for k, (i, j) in enumerate(ends)]):
        return None
    if len(ends) == 1:
        return ext[0, 0], ext[0, 1:]
    return ext[:, 0].min(), ext[:, 1:].max(0)  # min and max propagate a part's NaN


def _build_sampled_grid(split_bits: int, quant_bits: int):
    sort, extrema = _radix_sorter(), _build_bucket_extrema(split_bits)
    encode = build_encode_buckets(quant_bits, split_bits)
    nb = (1 << split_bits) - 1
    zero, one, ninf = np.float32(0), np.float32(1), np.float32(-np.inf)
    steps, half_max = np.float32((1 << quant_bits) - 1), np.float32(2.0**127)

    @jit()
    def kernel(x, pos, ranks, s, grid, out, rest, chunks):
        # the steps of sortquant._cpu_bucket_grid (sampled) and sortquant._bucket_steps, in one call;
        # then encode_buckets over the first ``chunks`` chunks where the range is finite
        sort(x, pos, s)
        m = s.shape[0]
        bounds = np.empty(nb, np.float32)
        lows = np.empty(nb + 1, np.float32)
        ext = np.empty(nb + 2, np.float32)
        lows[0], lows[nb] = s[0], s[m - 1]
        for j in range(nb):
            bound = s[ranks[j]] + zero  # a zero as +0.0
            bounds[j] = bound
            grid[0, j + 1] = bound
            if j + 1 < nb:
                lows[j + 1] = bound
            a, b = 0, m  # np.searchsorted(s, bound): the first sampled value >= bound
            while a < b:
                mid = (a + b) // 2
                if s[mid] < bound:
                    a = mid + 1
                else:
                    b = mid
            below = s[max(a - 1, 0)]  # the largest sampled value below the boundary, if any
            below = below if below < bound else ninf
            lows[j] = max(lows[j], below)
            if j == 0:
                ext[1] = below
        ext[0] = s[0]
        ext[2:] = lows[1:]
        extrema(x, bounds, lows, s[0], ext)
        grid[0, 0] = ext[0] + zero  # the min, a zero as +0.0
        grid[3, 0], grid[3, 1] = ext[0], ext[nb + 1]  # the range, for the caller's check
        for j in range(nb + 1):
            top = max(ext[1 + j], grid[0, j]) + zero
            step = (top - grid[0, j]) / steps
            grid[1, j] = step
            grid[2, j] = step if step > zero else one
        if abs(ext[0]) < half_max and abs(ext[nb + 1]) < half_max:  # else the caller raises (NaN fails too)
            encode(x, grid[0, 1:], grid[0], grid[2], out, rest, chunks)

    return kernel


def sampled_grid(x: np.ndarray, positions: np.ndarray, ranks: np.ndarray, quant_bits: int,
                 pack: bool = False) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Sort quantization's whole grid of a sampled split in one call -- the sample's radix sort
    (:func:`sort_sample`), its boundaries, the extrema pass (:func:`bucket_extrema`) and the steps --
    and with ``pack`` in the same call the codes of the whole chunks (:func:`encode_buckets`),
    when the kernels run on one thread (:func:`_parts`: a tensor under 64 chunks, as a pipeline's
    messages are, or one intra-op thread). A small message's encode costs mostly per call, not
    per value -- after a stage's compute has evicted the caches each separate step (a torch or
    numpy call, a kernel launch) costs some 15-25 us -- so one call for all of it halves it.

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
    if (x.size < MIN_VALUES or positions.size < MIN_SORT_VALUES or s > MAX_SPLIT_BITS
            or len(parts(x.size // CHUNK)) > 1 or not x.flags.c_contiguous):
        return None
    grid = np.empty((4, 1 << s), np.float32)
    sample = np.empty(positions.size, np.float32)
    bits = quant_bits + s
    packed = np.empty(packed_nbytes(x.size, bits) if pack else 0, np.uint8)
    chunks = x.size // CHUNK if pack else 0
    ok = backend.run(("sampled_grid", s, quant_bits), lambda: _build_sampled_grid(s, quant_bits),
               [(x, positions, ranks, sample, grid, *stream_part(packed, bits, x.size, 0), chunks)])
    return (grid, packed if pack else None) if ok else None


def one_call(t: torch.Tensor, n: int | None = None) -> bool:
    """Whether a message of ``n`` values (default ``t.numel()``; ``t`` its values or its code stream) is
    coded in one compiled call (:func:`uniform_message`, :func:`message_values`): a CPU tensor, whole
    chunks, at least :data:`.backend.MIN_VALUES`, and one thread's share of values (:func:`.backend.parts`)."""
    n = t.numel() if n is None else n
    return t.is_cpu and n % CHUNK == 0 and n >= MIN_VALUES and len(parts(n // CHUNK)) == 1


def _build_uniform_message(bits: int):
    encode = build_encode_uniform(bits)
    steps, zero, one = np.float32((1 << bits) - 1), np.float32(0), np.float32(1)

    @jit()
    def kernel(x, lo, hi, meta, div, out, rest, chunks):
        a, b = np.float32(lo), np.float32(hi)  # exact: float32 values
        step = (b - a) / steps  # steps.grid.grid_meta's float32 operations
        meta[0], meta[1] = a, step
        div[0] = step if step > zero else one
        encode(x, meta[:1], div, x.shape[0], 0, out, rest, chunks)

    return kernel


def uniform_message(x: torch.Tensor, lo: float, hi: float, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-tensor uniform quantization's metadata and packed codes in one compiled call: the grid
    of :func:`..steps.grid.grid_meta` (float32 ``step = (hi - lo) / (2**bits - 1)``) and the codes of
    :func:`encode_uniform`, so the same bytes. A small message's encode costs mostly per call (see
    :func:`sampled_grid`).

    Args:
        x: 1-D float32 CPU values, contiguous, whole chunks.
        lo, hi: the min and max of ``x`` (float32 values as Python floats; the caller checked that
            the range is finite).
        bits: code width.

    Returns:
        ``(meta, packed)``: float32 ``(2,)`` ``[lo, step]`` as sent and the uint8 code stream; None where
        the call does not apply (off, not CPU, not whole chunks, more than one thread's share of values).
    """
    if not one_call(x) or not x.is_contiguous():
        return None
    n = x.numel()
    meta, div = np.empty(2, np.float32), np.empty(1, np.float32)
    out = np.empty(packed_nbytes(n, bits), np.uint8)
    ok = backend.run(("uniform_message", bits), lambda: _build_uniform_message(bits),
               [(x.detach().numpy(), lo, hi, meta, div, *stream_part(out, bits, n, 0), n // CHUNK)])
    return (torch.from_numpy(meta), torch.from_numpy(out)) if ok else None


def _build_message_values(quant_bits: int, split_bits: int):
    nb = 1 << split_bits
    if split_bits:
        decode = build_decode_buckets(quant_bits, split_bits)

        @jit()
        def kernel(packed, rest, meta, y, chunks):
            decode(packed, rest, meta[:nb], meta[nb:], y, chunks)

        return kernel
    decode, unused = build_decode_uniform(quant_bits), np.zeros(1, np.float32)

    @jit()
    def uniform(packed, rest, meta, y, chunks):
        decode(packed, rest, meta[:1], meta[1:], unused, y.shape[0], 0, y, chunks)

    return uniform


def message_values(packed: torch.Tensor, quant_bits: int, split_bits: int, meta: torch.Tensor,
                   n: int) -> torch.Tensor | None:
    """The ``n`` decoded values of a one-group message in one compiled call: sort quantization's
    ``mins[b] + level * step[b]`` (:func:`decode_buckets`), or with ``split_bits = 0`` uniform
    quantization's ``lo + code * step`` (:func:`decode_uniform`) -- the same kernels, so the same
    values. A small message's decode costs mostly per call (see :func:`sampled_grid`): here the
    metadata is split inside the kernel and nothing else is converted or checked per tensor.

    Args:
        packed: uint8 CPU stream of ``n`` codes of ``Q + S`` bits.
        quant_bits, split_bits: Q and S (``S <= 4``).
        meta: float32 ``(2 * 2**S,)``, ``cat(mins, step)`` as sent.
        n: number of codes.

    Returns:
        float32 ``(n,)``, or None where the call does not apply (off, not CPU, not whole chunks, other
        metadata dtypes, more than one thread's share of values): the caller decodes step by step.

    Raises:
        ValueError: ``packed`` or ``meta`` of another size (the compiled kernel checks no bounds; the
            decoders check the header's sizes before).
    """
    if not one_call(packed, n) or split_bits > MAX_SPLIT_BITS or meta.dtype != torch.float32:
        return None
    if packed.numel() != packed_nbytes(n, quant_bits + split_bits) or meta.numel() != 2 << split_bits:
        raise ValueError(f"message_values: {packed.numel()} code bytes and {meta.numel()} metadata values for "
                         f"{n} codes of {quant_bits}+{split_bits} bits")  # the kernel does not check bounds
    y = np.empty(n, np.float32)
    ok = backend.run(("message_values", quant_bits, split_bits), lambda: _build_message_values(quant_bits, split_bits),
               [(*stream_part(packed.numpy(), quant_bits + split_bits, n, 0), meta.numpy(), y, n // CHUNK)])
    return torch.from_numpy(y) if ok else None


