"""Fused CPU kernels for the hot quantizers: values read once, packed codes written once.

The eager codecs (:mod:`.quantize`, :mod:`.sortquant`, :mod:`.codebook`) run a chain of whole-block
torch ops -- subtract, divide, round, clamp, convert, add the bucket, shift and add
the lanes of :mod:`.bitpack` -- each a pass over memory. Here each of those chains is
one compiled loop (Numba, which ships LLVM in its wheel: nothing to compile by hand on a
fresh machine), specialised per code width and bucket count so that the inner loops
are unrolled and vectorised:

- :func:`encode_uniform`: ``round((x - lo[g]) / div[g])`` clamped, for groups ``g`` of
  ``group_len`` consecutive values (one group: per-tensor ``quant``), bit-packed;
- :func:`sort_sample`: the sort of sort quantization's boundary sample, as a radix sort;
  :func:`sampled_grid`: that sort, the boundaries, the extrema pass and the steps in one
  call, where the kernels run on one thread (small messages);
- :func:`bucket_extrema` and :func:`encode_buckets`: sort quantization's two passes over
  the values (each value's bucket by comparison with the ``2**S - 1`` boundaries, then
  the min and the per-bucket maxima, then ``bucket * 2**Q + level``), for ``S <= 4``;
- :func:`decode_uniform` and :func:`decode_buckets`: unpack and ``lo + code * step``;
- a small CPU message in **one call** (:func:`one_call`: whole chunks, one thread's share):
  :func:`uniform_message` (per-tensor ``quant``'s grid and codes after the range),
  :func:`sampled_grid` with ``pack`` (sort quantization's grid and codes) and
  :func:`message_values` (either's decode). A pipeline's messages are small and each is
  coded after a stage's compute has evicted the caches, where every separate step -- a
  torch or numpy call, a kernel launch -- costs 15-25 us: one call is most of the saving;
- :func:`encode_levels` and :func:`decode_levels`: the codebook codec's nearest level
  (one comparison per midpoint, ``bits <= 4``) and ``level * scale``;
- :func:`fwht`: the Walsh-Hadamard butterflies of the rotation, in place, row by row.

Each performs the same float32 operations, in the same order, as the eager path, so
payloads and decoded tensors are **bit-identical** to it (tested on random and
adversarial tensors): it is a faster implementation of the same wire format, not a
codec of its own. The per-bucket grid is picked without a gather (which the vectoriser
refuses) as ``sum_j table[j] * e_j``: the indicators ``e_j`` are exact 0/1 floats and
only one is 1, so the sum is the table entry itself.

Scope: CPU tensors of at least :data:`MIN_VALUES` values and rounding to nearest; the
kernels take the values in wire order (:meth:`.grouping.Grouping.sent`, where group ``i``
is the values ``i * group_len ..`` for every grouping), so grouped and rotated codecs
use them too (the rotation, the per-group ranges and the scaling stay torch ops). The
packed chunks of the :mod:`.bitpack` layout come from here and the ``n % CHUNK`` tail
codes from the eager path. Stochastic rounding, sort quantization with ``S > 4`` or
grouped (it sorts each group) and codebooks above 4 bits stay eager. The functions
return False/None where they do not apply, and the caller runs the eager path.

GPU: CUDA tensors go to the Triton twins of these kernels (:mod:`.fused_triton`, same
bytes; :func:`gpu_kernels`), any number of buckets, and for a sampled split the
per-bucket maxima (:func:`bucket_maxima`); without Triton they stay eager.

Threads: a kernel runs on ``torch.get_num_threads()`` threads, as an eager torch op
would -- each on its own run of whole chunks (the kernels release the GIL), none under
:data:`MIN_CHUNKS_PER_THREAD` chunks; the parts are disjoint (the min and maxima are
combined after), so payloads do not depend on the number of threads (tested).

Switch: on by default; ``DGPIPE_FUSED=0`` in the environment or :func:`set_enabled`
turns it off (the benchmarks measure both in one run). Each kernel compiles on first
use of its bit width (about 0.5-1.5 s), once for all lengths; if Numba is missing or a
compilation fails, one ``RuntimeWarning`` is issued and the eager path is used from then
on.

Reference: the vectorisation tricks are ours; the layout is :mod:`.bitpack`'s and the
arithmetic that of :mod:`.quantize`, :mod:`.sortquant`, :mod:`.codebook` and
:mod:`.hadamard`.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from .bitpack import CHUNK, layout_planes, layout_word, packed_nbytes

__all__ = [
    "MIN_VALUES",
    "MIN_CHUNKS_PER_THREAD",
    "MAX_SPLIT_BITS",
    "enabled",
    "set_enabled",
    "wanted",
    "encode_uniform",
    "decode_uniform",
    "RADIX_BITS",
    "MIN_SORT_VALUES",
    "sort_sample",
    "bucket_extrema",
    "sampled_grid",
    "bucket_maxima",
    "gpu_kernels",
    "encode_buckets",
    "decode_buckets",
    "one_call",
    "uniform_message",
    "message_values",
    "MAX_LEVEL_BITS",
    "encode_levels",
    "decode_levels",
    "fwht",
]

MIN_VALUES = 2 * CHUNK
"""Smallest tensor (values) the fused kernels take; below it the eager path is as fast."""

MAX_SPLIT_BITS = 4
"""Largest split-bit count of the fused sort-quantization kernels (16 buckets)."""

ENV = "DGPIPE_FUSED"

_state = {"enabled": os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off"), "failed": False}
_kernels: dict[tuple, Callable] = {}


def enabled() -> bool:
    """Whether the fused kernels are used (on unless ``DGPIPE_FUSED=0``, :func:`set_enabled` or a failure)."""
    return _state["enabled"] and not _state["failed"]


def set_enabled(flag: bool) -> bool:
    """Turn the fused kernels on or off for this process; returns the previous setting."""
    previous = _state["enabled"]
    _state["enabled"] = bool(flag)
    return previous


def wanted(t: torch.Tensor, n: int | None = None) -> bool:
    """Whether the fused kernels would take ``t`` (on, a CPU tensor or one :func:`gpu_kernels` takes, at least
    :data:`MIN_VALUES` values: ``t.numel()``, or ``n`` for a packed stream of ``n`` codes); callers check it
    before allocating outputs."""
    if (t.numel() if n is None else n) < MIN_VALUES:
        return False
    return gpu_kernels(t) is not None or (enabled() and t.is_cpu)


def _applies(*tensors: torch.Tensor) -> bool:
    return enabled() and all(t.is_cpu for t in tensors)


def gpu_kernels(t: torch.Tensor):
    """The Triton kernels (:mod:`.fused_triton`) if they take ``t`` -- a CUDA tensor, or a CPU one after
    :func:`.fused_triton.run_on_cpu` -- and the switch is on; else None (on CPU this module's Numba kernels
    run). Each public kernel here hands such tensors to its twin there."""
    if not _state["enabled"] or (not t.is_cuda and "dgpipe.compression.fused_triton" not in sys.modules):
        return None
    from . import fused_triton  # imported on first use: importing Triton takes a while

    return fused_triton if fused_triton.available(t) else None


MIN_CHUNKS_PER_THREAD = 32
"""Fewest chunks (of :data:`.bitpack.CHUNK` values) a thread is given: smaller parts cost more to hand out than to run."""

_pool: dict = {}


def _parts(chunks: int) -> list[tuple[int, int]]:
    """Chunk ranges ``[c0, c1)`` of the threads a kernel over ``chunks`` chunks runs on:
    ``torch.get_num_threads()`` equal parts (the intra-op threads an eager torch op would use),
    fewer where a part would be under :data:`MIN_CHUNKS_PER_THREAD` chunks."""
    t = max(1, min(torch.get_num_threads(), chunks // MIN_CHUNKS_PER_THREAD))
    return [(chunks * i // t, chunks * (i + 1) // t) for i in range(t)]


def _workers(k: int) -> ThreadPoolExecutor:
    """A pool of at least ``k`` threads (the kernels release the GIL), created on first use and after a fork."""
    pool = _pool.get("pool")
    if pool is None or _pool["size"] < k:
        if pool is not None:
            pool.shutdown(wait=False)
        pool = _pool["pool"] = ThreadPoolExecutor(max_workers=k, thread_name_prefix="dgpipe-fused")
        _pool["size"] = k
    return pool


if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=_pool.clear)


def _call(key: tuple, build: Callable[[], Callable], calls: list[tuple]) -> bool:
    """Run kernel ``key`` (built by ``build`` on first use) on each argument tuple of ``calls`` at
    once (the first on the calling thread, the others on the pool); False if it cannot run.

    The calls of one kernel cover disjoint parts of its input and output (:func:`_parts`), so
    the result does not depend on the number of threads.
    """
    try:
        kernel = _kernels.get(key)
        if kernel is None:
            kernel = _kernels[key] = build()
        first, *rest = calls
        others = [_workers(len(rest)).submit(kernel, *args) for args in rest]
        try:
            kernel(*first)
        finally:
            for f in others:
                f.result()
        return True
    except Exception as e:  # Numba missing, a typing or LLVM error: fall back for good, say so once
        _state["failed"] = True
        warnings.warn(f"dgpipe: fused codec kernels unavailable ({type(e).__name__}: {e}); "
                      "using the eager torch path", RuntimeWarning, stacklevel=3)
        return False


def _stream_part(stream: np.ndarray, bits: int, n: int, c0: int) -> tuple[np.ndarray, int]:
    """``(view, rest)``: the packed stream of ``n`` codes of ``bits`` bits seen from chunk ``c0`` on,
    for the packers of :func:`_chunk_packers` counting chunks from there."""
    k, r = layout_planes(bits)
    chunk_bytes = CHUNK * r // 8
    start = c0 * (CHUNK if k else chunk_bytes)  # the low-byte plane comes first when there is one
    return stream[start:], k * n + c0 * chunk_bytes - start


def _grouped_parts(packed: torch.Tensor, bits: int, a: np.ndarray, b: np.ndarray, table: np.ndarray,
                   group_len: int, y: torch.Tensor) -> list[tuple]:
    """The argument tuples of a :func:`_build_grouped_decode` kernel, one per :func:`_parts`."""
    n, packed, y = y.numel(), packed.numpy(), y.numpy()
    return [(*_stream_part(packed, bits, n, c0), a, b, table, group_len, c0 * CHUNK, y[c0 * CHUNK : c1 * CHUNK], c1 - c0)
            for c0, c1 in _parts(n // CHUNK)]


def _njit(inline: bool = False):
    """Numba's ``njit`` as the kernels use it; ``inline``: inlined into its caller at Numba IR level
    (a call between compiled functions would keep the callee's loop from being vectorised)."""
    import numba  # imported on first use: a missing Numba is a fallback, not an import error

    return numba.njit(boundscheck=False, error_model="numpy", nogil=True, inline="always" if inline else "never")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


# --- packing one chunk of codes (the bitpack layout) ---------------------------------------------


def _chunk_packers(bits: int):
    """Numba functions ``pack(codes, out, rest, c)`` / ``unpack(packed, codes, rest, c)`` for chunk ``c``.

    ``codes``: float32 ``(CHUNK,)`` buffer of integral codes (exact below ``2**24``; 16-bit
    codes at most); ``out``/``packed``: the uint8 stream of the codes from chunk 0 on, or a
    view of it from a chunk on (:func:`_stream_part`); ``rest``: where in it the planes after
    the low bytes start (``n`` for a stream of ``n`` codes over 8 bits, 0 up to 8). Integer
    arithmetic would be widened to int64 by Numba and lose the vectorisation, so the
    bytes are cut from the codes with exact float operations (products and quotients by
    powers of two, ``floor``) where the word fits a float32 (``w == 1``: 1, 2, 4, 8-bit
    tops), and with int64 words otherwise. Constants of the layout are closure
    constants, so the lane and plane loops unroll.
    """
    njit = _njit(inline=True)
    k, r = layout_planes(bits)
    g, w = layout_word(r)[:2]
    cg, chunk_bytes = CHUNK // g, CHUNK * r // 8
    f256, inv256, fr, mask = np.float32(256), np.float32(1 / 256), np.float32(1 << r), (1 << r) - 1
    lane_mul = tuple(np.float32(2.0 ** (lane * r)) for lane in range(g))
    lane_div = tuple(np.float32(2.0 ** -(lane * r)) for lane in range(g + 1))

    @njit
    def pack(codes, out, rest, c):
        i0 = c * CHUNK
        if k:  # bits > 8: the low byte to plane 0, the top r bits stay
            for t in range(CHUNK):
                v = codes[t]
                top = np.floor(v * inv256)
                out[i0 + t] = np.uint8(v - top * f256)
                codes[t] = top
        base = (rest if k else 0) + c * chunk_bytes  # a constant 0: index provably >= 0, no wraparound code
        if g == 1:
            for t in range(CHUNK):
                out[base + t] = np.uint8(codes[t])
        elif w == 1:
            for j in range(cg):
                byte = codes[j]
                for lane in range(1, g):
                    byte += codes[lane * cg + j] * lane_mul[lane]
                out[base + j] = np.uint8(byte)
        else:
            for j in range(cg):
                word = np.int64(0)
                for lane in range(g):
                    word |= np.int64(codes[lane * cg + j]) << (lane * r)
                for q in range(w):
                    out[base + q * cg + j] = np.uint8((word >> (8 * q)) & 255)

    @njit
    def unpack(packed, codes, rest, c):
        i0 = c * CHUNK
        base = (rest if k else 0) + c * chunk_bytes  # a constant 0: index provably >= 0, no wraparound code
        if g == 1:
            for t in range(CHUNK):
                codes[t] = np.float32(packed[base + t])
        elif w == 1:
            for j in range(cg):
                byte = np.float32(packed[base + j])
                for lane in range(g):
                    codes[lane * cg + j] = np.floor(byte * lane_div[lane]) - fr * np.floor(byte * lane_div[lane + 1])
        else:
            for j in range(cg):
                word = np.int64(0)
                for q in range(w):
                    word |= np.int64(packed[base + q * cg + j]) << (8 * q)
                for lane in range(g):
                    codes[lane * cg + j] = np.float32((word >> (lane * r)) & mask)
        if k:
            for t in range(CHUNK):
                codes[t] = codes[t] * f256 + np.float32(packed[i0 + t])

    return pack, unpack


# --- uniform quantization, per tensor or per run of group_len values -------------------------------


def _build_encode_uniform(bits: int):
    njit = _njit()
    pack = _chunk_packers(bits)[0]
    top = np.float32((1 << bits) - 1)
    zero = np.float32(0)

    @_njit(inline=True)
    def levels(x, a, d, codes):
        for u in range(x.shape[0]):
            v = np.rint((x[u] - a) / d)
            codes[u] = min(max(v, zero), top)

    @njit
    def kernel(x, lo, div, group_len, start, out, rest, chunks):
        codes = np.empty(CHUNK, np.float32)
        for c in range(chunks):
            i0 = c * CHUNK
            t = 0
            while t < CHUNK:  # runs of one group inside the chunk
                grp = (start + i0 + t) // group_len
                stop = min(CHUNK, (grp + 1) * group_len - start - i0)
                levels(x[i0 + t : i0 + stop], lo[grp], div[grp], codes[t:stop])
                t = stop
            pack(codes, out, rest, c)

    return kernel


def encode_uniform(
    x: torch.Tensor, lo: torch.Tensor, div: torch.Tensor, bits: int, group_len: int, out: torch.Tensor
) -> bool:
    """Codes ``clamp(round((x - lo[g]) / div[g]), 0, 2**bits - 1)`` of the whole chunks of ``x``, packed into ``out``.

    Args:
        x: 1-D float32 CPU values, ``n`` of them, in wire order.
        lo, div: float32 ``(n_groups,)`` grid start and divisor of each group
            (:func:`.quantize.grid_meta`); group ``i // group_len`` holds value ``i``.
        bits: code width, 1..16.
        group_len: values per group (``n`` for one group).
        out: uint8 ``(ceil(n * bits / 8),)``: the stream of :func:`.bitpack.pack_bits`;
            codes ``0 .. n - n % CHUNK`` are written, the tail is left to the caller.

    Returns:
        True if done; False where the fused path does not apply (caller: eager path).
    """
    n, gpu = x.numel(), gpu_kernels(x)
    if gpu is not None and n >= MIN_VALUES:
        return gpu.encode_uniform(x, lo, div, bits, group_len, out)
    if n < MIN_VALUES or not _applies(x, out):
        return False
    x, lo, div, out = _np(x), _np(lo.reshape(-1)), _np(div.reshape(-1)), out.numpy()
    return _call(("encode_uniform", bits), lambda: _build_encode_uniform(bits),
                 [(x[c0 * CHUNK : c1 * CHUNK], lo, div, group_len, c0 * CHUNK, *_stream_part(out, bits, n, c0), c1 - c0)
                  for c0, c1 in _parts(n // CHUNK)])


def _build_grouped_decode(bits: int, values):
    """A decode kernel ``(packed, rest, a, b, table, group_len, start, y, chunks)``: unpack each chunk of
    ``packed``, then ``values(codes, a[g], b[g], table, y)`` on each run of one group ``g`` (an inlined Numba
    function); ``y`` (a view of the output from value ``start`` on) and ``packed`` (:func:`_stream_part`)
    from the same chunk on."""
    njit = _njit()
    unpack = _chunk_packers(bits)[1]

    @njit
    def kernel(packed, rest, a, b, table, group_len, start, y, chunks):
        codes = np.empty(CHUNK, np.float32)
        for c in range(chunks):
            unpack(packed, codes, rest, c)
            i0 = c * CHUNK
            t = 0
            while t < CHUNK:
                grp = (start + i0 + t) // group_len
                stop = min(CHUNK, (grp + 1) * group_len - start - i0)
                values(codes[t:stop], a[grp], b[grp], table, y[i0 + t : i0 + stop])
                t = stop

    return kernel


def _build_decode_uniform(bits: int):
    @_njit(inline=True)
    def values(codes, lo, step, table, y):
        for u in range(y.shape[0]):
            y[u] = lo + codes[u] * step

    return _build_grouped_decode(bits, values)


def decode_uniform(
    packed: torch.Tensor, bits: int, lo: torch.Tensor, step: torch.Tensor, group_len: int, y: torch.Tensor
) -> bool:
    """Inverse of :func:`encode_uniform`: ``y[i] = lo[g] + code[i] * step[g]`` for the whole chunks.

    Args:
        packed: uint8 stream of ``n = y.numel()`` codes of ``bits`` bits.
        lo, step: float32 ``(n_groups,)``, as sent.
        group_len: values per group.
        y: float32 ``(n,)`` output; values ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where the fused path does not apply.
    """
    n, gpu = y.numel(), gpu_kernels(y)
    if gpu is not None and n >= MIN_VALUES:
        return gpu.decode_uniform(packed, bits, lo, step, group_len, y)
    if n < MIN_VALUES or not _applies(packed, y):
        return False
    return _call(("decode_uniform", bits), lambda: _build_decode_uniform(bits),
                 _grouped_parts(packed, bits, _np(lo.reshape(-1)), _np(step.reshape(-1)), np.zeros(1, np.float32),
                                group_len, y))


# --- sort quantization: 2**S buckets by comparison with S - 1 boundaries ----------------------------


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

    @_njit(inline=True)
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

    @_njit()
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
    if m < MIN_SORT_VALUES or not enabled() or x.dtype != np.float32 or not x.flags.c_contiguous:
        return None
    pos = np.empty(0, np.int64) if positions is None else positions
    out = np.empty(m, np.float32)
    return out if _call(("sort_sample",), _build_sort_sample, [(x, pos, out)]) else None


def _build_bucket_extrema(split_bits: int):
    njit = _njit()
    nb = (1 << split_bits) - 1
    one, zero = np.float32(1), np.float32(0)

    @_njit(inline=True)
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
            number of boundaries ``<= v`` (:class:`.sortquant.BucketIndex`).
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
    if x.size < MIN_VALUES or s > MAX_SPLIT_BITS or not enabled():
        return None
    n, nb = x.size, bounds.size
    # Bucket b > 0 reaches below[b] (a value in it) and its min bounds[b - 1] (where the caller's
    # max(maxs, mins) puts an empty bucket anyway); the top bucket reaches the sampled max. Bucket 0
    # reaches below[0]: when none was sampled (-inf), its values are all < low and flagged as such,
    # and its window is low (finite: an infinite one times a 0 indicator would be NaN).
    lows = np.empty(nb + 1, np.float32)
    lows[0], lows[1:nb], lows[nb] = low, bounds[:-1], high
    np.maximum(lows[:nb], below, out=lows[:nb])
    ends = [(c0 * CHUNK, c1 * CHUNK) for c0, c1 in _parts(n // CHUNK)]
    ends[-1] = (ends[-1][0], n)  # the last part takes the tail
    ext = np.empty((len(ends), nb + 2), np.float32)  # a row per part: the known min and maxima
    ext[:, 0], ext[:, 1], ext[:, 2:] = low, below[0], lows[1:]
    if not _call(("bucket_extrema", s), lambda: _build_bucket_extrema(s),
                 [(x[i:j], bounds, lows, low, ext[k]) for k, (i, j) in enumerate(ends)]):
        return None
    if len(ends) == 1:
        return ext[0, 0], ext[0, 1:]
    return ext[:, 0].min(), ext[:, 1:].max(0)  # min and max propagate a part's NaN


def _build_sampled_grid(split_bits: int, quant_bits: int):
    sort, extrema = _radix_sorter(), _build_bucket_extrema(split_bits)
    encode = _build_encode_buckets(quant_bits, split_bits)
    nb = (1 << split_bits) - 1
    zero, one, ninf = np.float32(0), np.float32(1), np.float32(-np.inf)
    steps, half_max = np.float32((1 << quant_bits) - 1), np.float32(2.0**127)

    @_njit()
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
    if (x.size < MIN_VALUES or positions.size < MIN_SORT_VALUES or s > MAX_SPLIT_BITS or not enabled()
            or len(_parts(x.size // CHUNK)) > 1 or not x.flags.c_contiguous):
        return None
    grid = np.empty((4, 1 << s), np.float32)
    sample = np.empty(positions.size, np.float32)
    bits = quant_bits + s
    packed = np.empty(packed_nbytes(x.size, bits) if pack else 0, np.uint8)
    chunks = x.size // CHUNK if pack else 0
    ok = _call(("sampled_grid", s, quant_bits), lambda: _build_sampled_grid(s, quant_bits),
               [(x, positions, ranks, sample, grid, *_stream_part(packed, bits, x.size, 0), chunks)])
    return (grid, packed if pack else None) if ok else None


def bucket_maxima(x: torch.Tensor, bounds: torch.Tensor, mins: torch.Tensor) -> torch.Tensor | None:
    """Sort quantization's per-bucket maxima of a sampled split on the GPU (:func:`.fused_triton.bucket_maxima`);
    None on CPU, where :func:`bucket_extrema` finds them with the min, or where the kernels do not apply."""
    gpu = gpu_kernels(x)
    return None if gpu is None or x.numel() < MIN_VALUES else gpu.bucket_maxima(x, bounds, mins)


def _build_encode_buckets(quant_bits: int, split_bits: int):
    njit = _njit()
    pack = _chunk_packers(quant_bits + split_bits)[0]
    nb = (1 << split_bits) - 1
    levels, top = np.float32(1 << quant_bits), np.float32((1 << quant_bits) - 1)
    one, zero = np.float32(1), np.float32(0)

    @njit
    def kernel(x, bounds, mins, div, out, rest, chunks):
        codes = np.empty(CHUNK, np.float32)
        for c in range(chunks):
            xs = x[c * CHUNK : (c + 1) * CHUNK]
            for t in range(CHUNK):
                v = xs[t]
                m, d, b, prev = zero, zero, zero, one
                for j in range(nb + 1):
                    cur = np.float32(v >= bounds[j]) if j < nb else zero
                    e = prev - cur  # 1 in v's bucket only
                    m += mins[j] * e
                    d += div[j] * e
                    b += cur
                    prev = cur
                q = np.rint((v - m) / d)
                codes[t] = min(max(q, zero), top) + b * levels
            pack(codes, out, rest, c)

    return kernel


def encode_buckets(
    x: torch.Tensor, bounds: torch.Tensor, mins: torch.Tensor, div: torch.Tensor, quant_bits: int, out: torch.Tensor
) -> bool:
    """Sort-quantization codes ``bucket * 2**Q + level`` of the whole chunks of ``x``, packed into ``out``.

    ``level = clamp(round((x - mins[b]) / div[b]), 0, 2**Q - 1)`` as in
    :func:`.sortquant.bucket_codes`.

    Args:
        x: 1-D float32 CPU values.
        bounds: float32 ``(2**S - 1,)`` boundaries, ``1 <= S <= 4``.
        mins, div: float32 ``(2**S,)`` per-bucket grid start and divisor.
        quant_bits: Q.
        out: uint8 stream of ``x.numel()`` codes of ``Q + S`` bits (tail left to the caller).

    Returns:
        True if done; False where the fused path does not apply.
    """
    n, s, gpu = x.numel(), (bounds.numel() + 1).bit_length() - 1, gpu_kernels(x)
    if gpu is not None and n >= MIN_VALUES:
        return gpu.encode_buckets(x, bounds, mins, div, quant_bits, out)
    if n < MIN_VALUES or s > MAX_SPLIT_BITS or not _applies(x, out):
        return False
    x, bounds, mins, div, out = _np(x), _np(bounds), _np(mins), _np(div), out.numpy()
    return _call(("encode_buckets", quant_bits, s), lambda: _build_encode_buckets(quant_bits, s),
                 [(x[c0 * CHUNK : c1 * CHUNK], bounds, mins, div, *_stream_part(out, quant_bits + s, n, c0), c1 - c0)
                  for c0, c1 in _parts(n // CHUNK)])


def _build_decode_buckets(quant_bits: int, split_bits: int):
    njit = _njit()
    unpack = _chunk_packers(quant_bits + split_bits)[1]
    nb, zero = 1 << split_bits, np.float32(0)
    levels, inv_levels = np.float32(1 << quant_bits), np.float32(2.0 ** -quant_bits)

    @njit
    def kernel(packed, rest, mins, step, y, chunks):
        codes = np.empty(CHUNK, np.float32)
        for c in range(chunks):
            unpack(packed, codes, rest, c)
            ys = y[c * CHUNK : (c + 1) * CHUNK]
            for t in range(CHUNK):
                b = np.floor(codes[t] * inv_levels)
                m, s = zero, zero
                for j in range(nb):
                    e = np.float32(b == np.float32(j))
                    m += mins[j] * e
                    s += step[j] * e
                ys[t] = m + (codes[t] - b * levels) * s

    return kernel


def decode_buckets(packed: torch.Tensor, quant_bits: int, mins: torch.Tensor, step: torch.Tensor, y: torch.Tensor) -> bool:
    """Inverse of :func:`encode_buckets`: ``y = mins[b] + level * step[b]`` for the whole chunks.

    Args:
        packed: uint8 stream of ``n = y.numel()`` codes of ``Q + S`` bits.
        quant_bits: Q.
        mins, step: float32 ``(2**S,)`` as sent, ``S <= 4``.
        y: float32 ``(n,)`` output; values ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where the fused path does not apply.
    """
    n, s, gpu = y.numel(), mins.numel().bit_length() - 1, gpu_kernels(y)
    if gpu is not None and n >= MIN_VALUES:
        return gpu.decode_buckets(packed, quant_bits, mins, step, y)
    if n < MIN_VALUES or s > MAX_SPLIT_BITS or not _applies(packed, y):
        return False
    packed, mins, step, y = packed.numpy(), _np(mins), _np(step), y.numpy()
    return _call(("decode_buckets", quant_bits, s), lambda: _build_decode_buckets(quant_bits, s),
                 [(*_stream_part(packed, quant_bits + s, n, c0), mins, step, y[c0 * CHUNK : c1 * CHUNK], c1 - c0)
                  for c0, c1 in _parts(n // CHUNK)])


# --- a small message in one call -------------------------------------------------------------------


def one_call(t: torch.Tensor, n: int | None = None) -> bool:
    """Whether a message of ``n`` values (default ``t.numel()``; ``t`` its values or its code stream) is
    coded in one compiled call (:func:`uniform_message`, :func:`message_values`): kernels on, a CPU
    tensor that the Triton kernels do not take (:func:`gpu_kernels`), whole chunks, at least
    :data:`MIN_VALUES`, and one thread's share of values (:func:`_parts`)."""
    n = t.numel() if n is None else n
    return (t.is_cpu and n % CHUNK == 0 and n >= MIN_VALUES and enabled() and gpu_kernels(t) is None
            and len(_parts(n // CHUNK)) == 1)


def _build_uniform_message(bits: int):
    encode = _build_encode_uniform(bits)
    steps, zero, one = np.float32((1 << bits) - 1), np.float32(0), np.float32(1)

    @_njit()
    def kernel(x, lo, hi, meta, div, out, rest, chunks):
        a, b = np.float32(lo), np.float32(hi)  # exact: float32 values
        step = (b - a) / steps  # quantize.grid_meta's float32 operations
        meta[0], meta[1] = a, step
        div[0] = step if step > zero else one
        encode(x, meta[:1], div, x.shape[0], 0, out, rest, chunks)

    return kernel


def uniform_message(x: torch.Tensor, lo: float, hi: float, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-tensor uniform quantization's metadata and packed codes in one compiled call: the grid
    of :func:`.quantize.grid_meta` (float32 ``step = (hi - lo) / (2**bits - 1)``) and the codes of
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
    ok = _call(("uniform_message", bits), lambda: _build_uniform_message(bits),
               [(x.detach().numpy(), lo, hi, meta, div, *_stream_part(out, bits, n, 0), n // CHUNK)])
    return (torch.from_numpy(meta), torch.from_numpy(out)) if ok else None


def _build_message_values(quant_bits: int, split_bits: int):
    nb = 1 << split_bits
    if split_bits:
        decode = _build_decode_buckets(quant_bits, split_bits)

        @_njit()
        def kernel(packed, rest, meta, y, chunks):
            decode(packed, rest, meta[:nb], meta[nb:], y, chunks)

        return kernel
    decode, unused = _build_decode_uniform(quant_bits), np.zeros(1, np.float32)

    @_njit()
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
    ok = _call(("message_values", quant_bits, split_bits), lambda: _build_message_values(quant_bits, split_bits),
               [(*_stream_part(packed.numpy(), quant_bits + split_bits, n, 0), meta.numpy(), y, n // CHUNK)])
    return torch.from_numpy(y) if ok else None


# --- codebook: the nearest of 2**bits sorted levels ------------------------------------------------

MAX_LEVEL_BITS = 4
"""Widest code of the fused codebook kernels (16 levels: one comparison per midpoint)."""


def _build_encode_levels(bits: int):
    njit = _njit()
    pack = _chunk_packers(bits)[0]
    nm = (1 << bits) - 1

    @njit
    def kernel(v, mids, out, rest, chunks):
        codes = np.empty(CHUNK, np.float32)
        for c in range(chunks):
            vs = v[c * CHUNK : (c + 1) * CHUNK]
            for t in range(CHUNK):
                x = vs[t]
                k = np.float32(0)
                for j in range(nm):
                    k += np.float32(x > mids[j])  # torch.bucketize(x, mids): boundaries below x
                codes[t] = k
            pack(codes, out, rest, c)

    return kernel


def encode_levels(v: torch.Tensor, mids: torch.Tensor, bits: int, out: torch.Tensor) -> bool:
    """Index of the nearest level, ``#{j : v > mids[j]}``, of the whole chunks of ``v``, packed into ``out``.

    Args:
        v: 1-D float32 CPU values (scaled), wire order.
        mids: float32 ``(2**bits - 1,)`` ascending midpoints between neighbouring levels
            (``torch.bucketize(v, mids)`` is the eager path's index).
        bits: 1..:data:`MAX_LEVEL_BITS`.
        out: uint8 stream of ``v.numel()`` codes (the tail is left to the caller).

    Returns:
        True if done; False where the fused path does not apply.
    """
    n, gpu = v.numel(), gpu_kernels(v)
    if gpu is not None and n >= MIN_VALUES and bits <= MAX_LEVEL_BITS:
        return gpu.encode_levels(v, mids, bits, out)
    if n < MIN_VALUES or bits > MAX_LEVEL_BITS or not _applies(v, out):
        return False
    v, mids, out = _np(v), _np(mids), out.numpy()
    return _call(("encode_levels", bits), lambda: _build_encode_levels(bits),
                 [(v[c0 * CHUNK : c1 * CHUNK], mids, *_stream_part(out, bits, n, c0), c1 - c0)
                  for c0, c1 in _parts(n // CHUNK)])


def _build_decode_levels(bits: int):
    @_njit(inline=True)
    def values(codes, scale, unused, table, y):
        for u in range(y.shape[0]):
            y[u] = table[np.int64(codes[u])] * scale

    return _build_grouped_decode(bits, values)


def decode_levels(packed: torch.Tensor, bits: int, table: torch.Tensor, scale: torch.Tensor, group_len: int,
                  y: torch.Tensor) -> bool:
    """Inverse of :func:`encode_levels` with scales: ``y[i] = table[code[i]] * scale[i // group_len]`` (whole chunks).

    Args:
        packed: uint8 stream of ``n = y.numel()`` codes of ``bits`` bits.
        table: float32 ``(2**bits,)`` levels.
        scale: float32 ``(n_groups,)`` per-group scales, wire order.
        group_len: values per group.
        y: float32 ``(n,)`` output, wire order; values ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where the fused path does not apply.
    """
    n, gpu = y.numel(), gpu_kernels(y)
    if gpu is not None and n >= MIN_VALUES and bits <= MAX_LEVEL_BITS:
        return gpu.decode_levels(packed, bits, table, scale, group_len, y)
    if n < MIN_VALUES or bits > MAX_LEVEL_BITS or not _applies(packed, y):
        return False
    scale = _np(scale.reshape(-1))
    return _call(("decode_levels", bits), lambda: _build_decode_levels(bits),
                 _grouped_parts(packed, bits, scale, scale, _np(table), group_len, y))


# --- the Walsh-Hadamard transform of the rotation ---------------------------------------------------


def _build_fwht():
    njit = _njit()

    @njit
    def kernel(y, b, scale):
        # in place, row by row: the butterflies of .hadamard.fwht in the same order
        for r in range(y.shape[0] // b):
            row = y[r * b : (r + 1) * b]
            h = 1
            while h < b:
                for i in range(0, b, 2 * h):
                    lo = row[i : i + h]
                    hi = row[i + h : i + 2 * h]
                    for j in range(h):
                        a, c = lo[j], hi[j]
                        lo[j] = a + c
                        hi[j] = a - c
                h *= 2
            for j in range(b):
                row[j] *= scale

    return kernel


def fwht(x: torch.Tensor) -> torch.Tensor | None:
    """:func:`.hadamard.fwht` of a float32 CPU tensor ``(..., b)`` (same bits), or None where it does not apply."""
    b = x.shape[-1]
    if x.numel() < MIN_VALUES or x.dtype != torch.float32 or not _applies(x):
        return None
    y = x.detach().contiguous().clone()
    if not _call(("fwht",), _build_fwht, [(y.view(-1).numpy(), b, np.float32(1.0 / math.sqrt(b)))]):
        return None
    return y
