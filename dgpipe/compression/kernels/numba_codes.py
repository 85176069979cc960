"""Compiled CPU loops (Numba) of the per-value codec steps: values read once, packed codes written once.

The reference steps (:mod:`.uniform`, :mod:`.buckets`, :mod:`.levels`, :mod:`.fwht`)
run a chain of whole-block torch ops -- subtract, divide, round, clamp, convert, add the
bucket, shift and add the lanes of :mod:`.bitpack` -- each a pass over memory. Here each
of those chains is one compiled loop (Numba, which ships LLVM in its wheel: nothing to
compile by hand on a fresh machine), specialised per code width and bucket count so that
the inner loops are unrolled and vectorised:

- :func:`encode_uniform` / :func:`decode_uniform`: ``round((x - lo[g]) / div[g])`` clamped,
  for groups ``g`` of ``group_len`` consecutive values, bit-packed; and the inverse;
- :func:`encode_buckets` / :func:`decode_buckets`: sort quantization's codes
  ``bucket * 2**Q + level`` (each value's bucket by comparison with the ``2**S - 1``
  boundaries), for ``S <= 4``; and the inverse;
- :func:`encode_levels` / :func:`decode_levels`: the codebook codec's nearest level
  (one comparison per midpoint, ``bits <= 4``) and ``level * scale``;
- :func:`fwht`: the Walsh-Hadamard butterflies of the rotation, in place, row by row.

Each performs the same float32 operations, in the same order, as the reference, so
payloads and decoded tensors are **bit-identical** to it (golden payloads; tested on
random and adversarial tensors). The per-bucket grid is picked without a gather (which
the vectoriser refuses) as ``sum_j table[j] * e_j``: the indicators ``e_j`` are exact 0/1
floats and only one is 1, so the sum is the table entry itself.

Protocol (inside :mod:`dgpipe.compression.kernels` only): each function writes the whole
chunks of its output and returns True, or returns False where it does not apply (or its
kernel failed, :func:`.backend.run`); the step that called it then runs the reference.
The ``n % CHUNK`` tail is the calling step's.

Reference: the vectorisation tricks are ours; the layout is :mod:`.bitpack`'s.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import backend
from .backend import MIN_VALUES, parts
from .bitpack import CHUNK, layout_planes, layout_word

__all__ = [
    "MAX_SPLIT_BITS", "MAX_LEVEL_BITS", "jit", "grouped_parts", "build_grouped_decode", "stream_part", "chunk_packers",
    "build_encode_uniform",
    "build_decode_uniform", "build_encode_buckets", "build_decode_buckets", "encode_uniform", "decode_uniform",
    "encode_buckets", "decode_buckets", "encode_levels", "decode_levels", "fwht",
]

MAX_SPLIT_BITS = 4
"""Largest split-bit count of the compiled sort-quantization kernels (16 buckets)."""

MAX_LEVEL_BITS = 4
"""Widest code of the compiled codebook kernels (16 levels: one comparison per midpoint)."""


def stream_part(stream: np.ndarray, bits: int, n: int, c0: int) -> tuple[np.ndarray, int]:
    """``(view, rest)``: the packed stream of ``n`` codes of ``bits`` bits seen from chunk ``c0`` on,
    for the packers of :func:`chunk_packers` counting chunks from there."""
    k, r = layout_planes(bits)
    chunk_bytes = CHUNK * r // 8
    start = c0 * (CHUNK if k else chunk_bytes)  # the low-byte plane comes first when there is one
    return stream[start:], k * n + c0 * chunk_bytes - start


def grouped_parts(packed: torch.Tensor, bits: int, a: np.ndarray, b: np.ndarray, table: np.ndarray,
                   group_len: int, y: torch.Tensor) -> list[tuple]:
    """The argument tuples of a :func:`build_grouped_decode` kernel, one per :func:`_parts`."""
    n, packed, y = y.numel(), packed.numpy(), y.numpy()
    return [(*stream_part(packed, bits, n, c0), a, b, table, group_len, c0 * CHUNK, y[c0 * CHUNK : c1 * CHUNK], c1 - c0)
            for c0, c1 in parts(n // CHUNK)]


def jit(inline: bool = False):
    """Numba's ``njit`` as the kernels use it; ``inline``: inlined into its caller at Numba IR level
    (a call between compiled functions would keep the callee's loop from being vectorised)."""
    import numba  # imported on first use: a missing Numba is a fallback, not an import error

    return numba.njit(boundscheck=False, error_model="numpy", nogil=True, inline="always" if inline else "never")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


# --- packing one chunk of codes (the bitpack layout) ---------------------------------------------


def chunk_packers(bits: int):
    """Numba functions ``pack(codes, out, rest, c)`` / ``unpack(packed, codes, rest, c)`` for chunk ``c``.

    ``codes``: float32 ``(CHUNK,)`` buffer of integral codes (exact below ``2**24``; 16-bit
    codes at most); ``out``/``packed``: the uint8 stream of the codes from chunk 0 on, or a
    view of it from a chunk on (:func:`stream_part`); ``rest``: where in it the planes after
    the low bytes start (``n`` for a stream of ``n`` codes over 8 bits, 0 up to 8). Integer
    arithmetic would be widened to int64 by Numba and lose the vectorisation, so the
    bytes are cut from the codes with exact float operations (products and quotients by
    powers of two, ``floor``) where the word fits a float32 (``w == 1``: 1, 2, 4, 8-bit
    tops), and with int64 words otherwise. Constants of the layout are closure
    constants, so the lane and plane loops unroll.
    """
    njit = jit(inline=True)
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


def build_encode_uniform(bits: int):
    njit = jit()
    pack = chunk_packers(bits)[0]
    top = np.float32((1 << bits) - 1)
    zero = np.float32(0)

    @jit(inline=True)
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
            (:func:`..steps.grid.grid_meta`); group ``i // group_len`` holds value ``i``.
        bits: code width, 1..16.
        group_len: values per group (``n`` for one group).
        out: uint8 ``(ceil(n * bits / 8),)``: the stream of :func:`.bitpack.pack_bits`;
            codes ``0 .. n - n % CHUNK`` are written, the tail is left to the caller.

    Returns:
        True if done; False where it does not apply (the calling step runs the reference).
    """
    n = x.numel()
    if n < MIN_VALUES or not x.is_cpu:
        return False
    x, lo, div, out = _np(x), _np(lo.reshape(-1)), _np(div.reshape(-1)), out.numpy()
    return backend.run(("encode_uniform", bits), lambda: build_encode_uniform(bits),
                 [(x[c0 * CHUNK : c1 * CHUNK], lo, div, group_len, c0 * CHUNK, *stream_part(out, bits, n, c0), c1 - c0)
                  for c0, c1 in parts(n // CHUNK)])


def build_grouped_decode(bits: int, values):
    """A decode kernel ``(packed, rest, a, b, table, group_len, start, y, chunks)``: unpack each chunk of
    ``packed``, then ``values(codes, a[g], b[g], table, y)`` on each run of one group ``g`` (an inlined Numba
    function); ``y`` (a view of the output from value ``start`` on) and ``packed`` (:func:`stream_part`)
    from the same chunk on."""
    njit = jit()
    unpack = chunk_packers(bits)[1]

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


def build_decode_uniform(bits: int):
    @jit(inline=True)
    def values(codes, lo, step, table, y):
        for u in range(y.shape[0]):
            y[u] = lo + codes[u] * step

    return build_grouped_decode(bits, values)


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
        True if done; False where it does not apply.
    """
    n = y.numel()
    if n < MIN_VALUES or not y.is_cpu:
        return False
    return backend.run(("decode_uniform", bits), lambda: build_decode_uniform(bits),
                 grouped_parts(packed, bits, _np(lo.reshape(-1)), _np(step.reshape(-1)), np.zeros(1, np.float32),
                                group_len, y))


# --- sort quantization: 2**S buckets by comparison with S - 1 boundaries ----------------------------


def build_encode_buckets(quant_bits: int, split_bits: int):
    njit = jit()
    pack = chunk_packers(quant_bits + split_bits)[0]
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
    :func:`.buckets.bucket_codes`.

    Args:
        x: 1-D float32 CPU values.
        bounds: float32 ``(2**S - 1,)`` boundaries, ``1 <= S <= 4``.
        mins, div: float32 ``(2**S,)`` per-bucket grid start and divisor.
        quant_bits: Q.
        out: uint8 stream of ``x.numel()`` codes of ``Q + S`` bits (tail left to the caller).

    Returns:
        True if done; False where it does not apply.
    """
    n, s = x.numel(), (bounds.numel() + 1).bit_length() - 1
    if n < MIN_VALUES or s > MAX_SPLIT_BITS or not x.is_cpu:
        return False
    x, bounds, mins, div, out = _np(x), _np(bounds), _np(mins), _np(div), out.numpy()
    return backend.run(("encode_buckets", quant_bits, s), lambda: build_encode_buckets(quant_bits, s),
                 [(x[c0 * CHUNK : c1 * CHUNK], bounds, mins, div, *stream_part(out, quant_bits + s, n, c0), c1 - c0)
                  for c0, c1 in parts(n // CHUNK)])


def build_decode_buckets(quant_bits: int, split_bits: int):
    njit = jit()
    unpack = chunk_packers(quant_bits + split_bits)[1]
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


def decode_buckets(packed: torch.Tensor, quant_bits: int, mins: torch.Tensor, step: torch.Tensor,
                   y: torch.Tensor) -> bool:
    """Inverse of :func:`encode_buckets`: ``y = mins[b] + level * step[b]`` for the whole chunks.

    Args:
        packed: uint8 stream of ``n = y.numel()`` codes of ``Q + S`` bits.
        quant_bits: Q.
        mins, step: float32 ``(2**S,)`` as sent, ``S <= 4``.
        y: float32 ``(n,)`` output; values ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where it does not apply.
    """
    n, s = y.numel(), mins.numel().bit_length() - 1
    if n < MIN_VALUES or s > MAX_SPLIT_BITS or not y.is_cpu:
        return False
    packed, mins, step, y = packed.numpy(), _np(mins), _np(step), y.numpy()
    return backend.run(("decode_buckets", quant_bits, s), lambda: build_decode_buckets(quant_bits, s),
                 [(*stream_part(packed, quant_bits + s, n, c0), mins, step, y[c0 * CHUNK : c1 * CHUNK], c1 - c0)
                  for c0, c1 in parts(n // CHUNK)])


# --- codebook: the nearest of 2**bits sorted levels ------------------------------------------------

def _build_encode_levels(bits: int):
    njit = jit()
    pack = chunk_packers(bits)[0]
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
            (``torch.bucketize(v, mids)`` is the reference's index).
        bits: 1..:data:`MAX_LEVEL_BITS`.
        out: uint8 stream of ``v.numel()`` codes (the tail is left to the caller).

    Returns:
        True if done; False where it does not apply.
    """
    n = v.numel()
    if n < MIN_VALUES or bits > MAX_LEVEL_BITS or not v.is_cpu:
        return False
    v, mids, out = _np(v), _np(mids), out.numpy()
    return backend.run(("encode_levels", bits), lambda: _build_encode_levels(bits),
                 [(v[c0 * CHUNK : c1 * CHUNK], mids, *stream_part(out, bits, n, c0), c1 - c0)
                  for c0, c1 in parts(n // CHUNK)])


def _build_decode_levels(bits: int):
    @jit(inline=True)
    def values(codes, scale, unused, table, y):
        for u in range(y.shape[0]):
            y[u] = table[np.int64(codes[u])] * scale

    return build_grouped_decode(bits, values)


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
        True if done; False where it does not apply.
    """
    n = y.numel()
    if n < MIN_VALUES or bits > MAX_LEVEL_BITS or not y.is_cpu:
        return False
    scale = _np(scale.reshape(-1))
    return backend.run(("decode_levels", bits), lambda: _build_decode_levels(bits),
                 grouped_parts(packed, bits, scale, scale, _np(table), group_len, y))


# --- the Walsh-Hadamard transform of the rotation ---------------------------------------------------


def _build_fwht():
    njit = jit()

    @njit
    def kernel(y, b, scale):
        # in place, row by row: the butterflies of .fwht.fwht in the same order
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
    """:func:`.fwht.fwht` of a float32 CPU tensor ``(..., b)`` (same bits), or None where it does not apply."""
    b = x.shape[-1]
    if x.numel() < MIN_VALUES or x.dtype != torch.float32 or not x.is_cpu:
        return None
    y = x.detach().contiguous().clone()
    if not backend.run(("fwht",), _build_fwht, [(y.view(-1).numpy(), b, np.float32(1.0 / math.sqrt(b)))]):
        return None
    return y
