"""Compiled CPU loops (Numba) of the codebook codec's token groups: rotation, RMS scale, levels and packing in one pass.

The step-by-step codebook encode with token groups (:mod:`..codecs.codebook`) is a
chain of whole-tensor passes: random signs, padding, the Walsh-Hadamard butterflies, the
rows' sums of squares, the scale's rounding, the division, the level assignment and the
bit-packing -- each a pass over memory and a call. Here one compiled loop takes a tile of
:data:`TILE` rows (tokens' vectors) through all of them while it is in cache, and the
decode likewise (unpack, ``level * scale``, the inverse butterflies, the signs). In the
tile the rows lie side by side (transposed in and out), so that each step is a vector
operation across rows, whatever the width of the butterflies:

- :func:`encode_rows`: ``x`` ``(rows, d)`` -> packed codes and per-row scales;
- :func:`decode_rows`: packed codes and scales -> ``(rows, d)``.

Each performs the same floating-point operations, in the same order, as the reference steps
(:meth:`..steps.hadamard.HadamardRotation.forward`, :func:`.levels.row_rms`,
:func:`..steps.grouping.round_meta`, :func:`.levels.level_codes`, and their inverses), so
payloads and decoded tensors are **bit-identical** to them (golden payloads; tested on
random and adversarial tensors). The per-row RMS is the one reduction, and
:func:`.levels.row_rms` defines its order (a float64 pairwise fold), so that it can be
repeated here exactly.

Threads: the encode splits the code stream into runs of whole chunks (:func:`.backend.parts`;
the last run also takes the ``n % CHUNK`` tail, which the caller packs), a row that straddles
two runs is rotated by both; the decode splits the rows.

Same protocol as :mod:`.numba_codes`: None where a function does not apply, or where its
kernel failed (:func:`.backend.run`) or the input holds inf/NaN; the caller then runs the
reference steps (which raise the error).

Reference: the Hadamard rotation as in QuaRot (Ashkboos et al., 2024); Lloyd-Max levels
(Max 1960, Lloyd 1982); the single-pass structure is ours.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import backend
from .backend import parts
from .bitpack import CHUNK, packed_nbytes
from .numba_codes import MAX_LEVEL_BITS, chunk_packers, jit

__all__ = ["TILE", "META_DTYPES", "applies", "encode_rows", "decode_rows"]

META_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Scale dtypes the kernels round to (in this order: the kernels' ``meta`` constant)."""



def _meta_format(meta: int) -> tuple[int, int, float]:
    """``(explicit mantissa bits, least normal exponent, largest finite value)`` of :data:`META_DTYPES`
    ``[meta]`` (unused for float32, which needs no rounding)."""
    info = torch.finfo(META_DTYPES[meta])
    return round(-math.log2(info.eps)), round(math.log2(info.tiny)), info.max


TILE = 16
"""Rows a kernel takes at once: their values sit side by side (value ``j`` of the ``TILE`` rows in a
row of the tile), so every step -- butterflies, sums, division, level comparisons -- is a vector
operation over ``TILE`` rows, whatever the width of the butterflies. (It reaches the kernels as an
argument, not a compile-time constant: with a constant trip count LLVM unrolls the loops over the
rows of a tile and leaves them scalar -- measured 5x slower.)"""


def _unrolled(bits: int):
    """Inlined Numba functions ``codes_of(v, div, mids)`` (``v[t] = #{m : v[t] / div > mids[m]}`` in place)
    and ``levels_of(codes, table)`` (``codes[t] = table[codes[t]]`` in place) for ``2**bits`` levels.

    The ``2**bits - 1`` midpoints and the ``2**bits`` levels are loaded into scalars before the loop,
    written out one by one: read from an array inside the loop, LLVM cannot prove that the stores
    do not change them and leaves the loop scalar (measured 10x slower); a gather ``table[code]``
    is not vectorised either. Numba has no way to unroll a loop into scalars, so the source is
    generated here for each width.
    """
    n = 1 << bits
    mids = "".join(f"    m{i} = mids[{i}]\n" for i in range(n - 1))
    count = " + ".join(f"np.float32(x > m{i})" for i in range(n - 1))  # torch.bucketize(x, mids)
    levels = "".join(f"    t{i} = table[{i}]\n" for i in range(n))
    select = "".join(f"        y = t{i} if c == np.float32({i}) else y\n" for i in range(1, n))
    source = (f"def codes_of(v, div, mids):\n{mids}    for t in range(v.shape[0]):\n"
              f"        x = v[t] / div\n        v[t] = {count}\n\n"
              f"def levels_of(codes, table):\n{levels}    for t in range(codes.shape[0]):\n"
              f"        c, y = codes[t], t0\n{select}        codes[t] = y\n")
    scope: dict = {}
    exec(compile(source, f"<dgpipe numba_rows, {bits} bits>", "exec"), {"np": np}, scope)
    njit = jit(inline=True)
    return njit(scope["codes_of"]), njit(scope["levels_of"])


def _tile_steps(meta: int):
    """Inlined Numba functions of a tile of ``L`` rows, ``tile[j * L + l]`` = value ``j`` of row ``l``:
    ``butterflies(tile, L, width, block, inv_sqrt)`` and ``scales_of(tile, L, width, s64, scales)``."""
    njit = jit(inline=True)
    mant, emin, top = _meta_format(meta)

    @njit
    def butterflies(tile, L, width, block, inv_sqrt):
        # the butterflies of .fwht.fwht in the same order, block by block, then the orthonormal factor;
        # two stages per pass over the tile where they pair up (the same operations on each value)
        for b0 in range(0, width, block):
            h = 1
            while 2 * h < block:
                for i in range(b0, b0 + block, 4 * h):
                    p, q = tile[i * L : (i + h) * L], tile[(i + h) * L : (i + 2 * h) * L]  # views: LLVM vectorises
                    u, v = tile[(i + 2 * h) * L : (i + 3 * h) * L], tile[(i + 3 * h) * L : (i + 4 * h) * L]
                    for j in range(h * L):
                        a, b, c, e = p[j], q[j], u[j], v[j]
                        a, b = a + b, a - b  # stage h
                        c, e = c + e, c - e
                        p[j], u[j] = a + c, a - c  # stage 2h
                        q[j], v[j] = b + e, b - e
                h *= 4
            if h < block:
                for i in range(b0, b0 + block, 2 * h):
                    p, q = tile[i * L : (i + h) * L], tile[(i + h) * L : (i + 2 * h) * L]
                    for j in range(h * L):
                        a, b = p[j], q[j]
                        p[j], q[j] = a + b, a - b
        for j in range(width * L):
            tile[j] *= inv_sqrt

    @njit
    def ceil_meta(t):
        # the smallest value of the metadata dtype >= t (round_meta rounding up); inf if none
        if meta == 0 or not 0 < t < np.inf:
            return t
        e = max(math.frexp(np.float64(t))[1] - 1, emin)
        ulp = math.ldexp(1.0, e - mant)
        r = math.ceil(np.float64(t) / ulp) * ulp
        return np.float32(r) if r <= top else np.float32(np.inf)

    @njit
    def scales_of(tile, L, width, s64, scales):
        # .levels.row_rms per row (float64 squares, the same pairwise fold), rounded up to the meta dtype
        h = (width + 1) // 2
        lo, hi = tile[: (width - h) * L], tile[h * L : width * L]
        for j in range((width - h) * L):
            a, c = np.float64(lo[j]), np.float64(hi[j])
            s64[j] = a * a + c * c
        for j in range((width - h) * L, h * L):  # the middle value of an odd width: no partner yet
            a = np.float64(tile[j])
            s64[j] = a * a
        m = h
        while m > 1:
            h = (m + 1) // 2
            lo, hi = s64[: (m - h) * L], s64[h * L : m * L]
            for j in range((m - h) * L):
                lo[j] += hi[j]
            m = h
        for l in range(L):
            scales[l] = ceil_meta(np.float32(np.sqrt(s64[l] / np.float64(width))))

    return butterflies, scales_of


def _build_encode(bits: int, rotate: bool, meta: int):
    pack = chunk_packers(bits)[0]
    butterflies, scales_of = _tile_steps(meta)
    codes_of = _unrolled(bits)[0]
    zero, one = np.float32(0), np.float32(1)

    @jit()
    def kernel(x, signs, rows, d, width, block, inv_sqrt, mids, L, start, stop, full, out, scales, tail, bad):
        # the codes at positions [start, stop) of the stream of rows * width codes: chunks below `full`
        # packed into `out`, the others into `tail`; rows starting in [start, stop) have their scale set
        tile = np.empty(width * L, np.float32)
        s64 = np.empty(((width + 1) // 2) * L, np.float64)
        buf = np.empty(CHUNK + width * (L + 1), np.float32)  # codes in stream order from position `base` on
        scl, div = np.empty(L, np.float32), np.empty(L, np.float32)
        r = start // width
        base = r * width
        while r * width < stop:
            nr = min(L, rows - r)
            xt = x[r * d : (r + nr) * d]
            for j in range(d):  # transposed: a strided read, a contiguous write
                tj = tile[j * L : j * L + nr]
                sj = signs[j] if rotate else one
                for l in range(nr):
                    tj[l] = xt[l * d + j] * sj
                for l in range(nr, L):
                    tile[j * L + l] = zero
            for j in range(d * L, width * L):
                tile[j] = zero
            if rotate:
                butterflies(tile, L, width, block, inv_sqrt)
            scales_of(tile, L, width, s64, scl)
            for l in range(nr):
                if not scl[l] < np.inf:  # inf/NaN in the row, or a scale overflowing the meta dtype
                    bad[0] = 1
                    return
                if (r + l) * width >= start:
                    scales[r + l] = scl[l]
                div[l] = scl[l] if scl[l] > zero else one
            for l in range(nr):  # back to stream order (a strided read), then each row's codes
                o = (r + l) * width - base
                br = buf[o : o + width]
                for j in range(width):
                    br[j] = tile[j * L + l]
                codes_of(br, div[l], mids)
            end = min(stop, (r + nr) * width)
            c = max(start, base) // CHUNK  # the first chunk not yet packed (base: a row start <= start, or a chunk)
            while (c + 1) * CHUNK <= min(end, full):
                pack(buf[c * CHUNK - base : (c + 1) * CHUNK - base], out, 0, c)
                c += 1
            keep = max(start, c * CHUNK)  # codes from here on are not packed yet
            if (r + nr) * width >= stop:
                for i in range(max(keep, full), stop):
                    tail[i - full] = buf[i - base]
            elif keep > base:
                for i in range(keep, end):
                    buf[i - keep] = buf[i - base]
                base = keep
            r += nr

    return kernel


def _build_decode(bits: int, rotate: bool):
    unpack = chunk_packers(bits)[1]
    butterflies = _tile_steps(0)[0]
    levels_of = _unrolled(bits)[1]
    zero = np.float32(0)

    @jit()
    def kernel(packed, table, scales, d, width, block, inv_sqrt, signs, L, tail, full, r0, r1, y):
        tile = np.empty(width * L, np.float32)
        cap = CHUNK * max(8, 2 + (width * L) // CHUNK)
        buf = np.empty(cap, np.float32)  # levels of whole chunks (and the tail) from position `base` on
        base, have = -1, 0  # buf holds positions [base, base + have)
        for r in range(r0, r1, L):
            nr = min(L, r1 - r)
            first, end = r * width, (r + nr) * width
            c0 = first // CHUNK
            if not base <= first < base + have:
                base, have = c0 * CHUNK, 0
            elif end - base > cap:  # room for this tile: drop the chunks before its first
                o = c0 * CHUNK - base
                for i in range(have - o):
                    buf[i] = buf[o + i]
                base, have = c0 * CHUNK, have - o
            while base + have < end:
                p = base + have
                if p >= full:
                    for i in range(p, end):
                        buf[i - base] = tail[i - full]
                    levels_of(buf[have : end - base], table)
                    have = end - base
                else:
                    unpack(packed, buf[have : have + CHUNK], 0, p // CHUNK)
                    levels_of(buf[have : have + CHUNK], table)
                    have += CHUNK
            for j in range(width):  # transposed (a strided read) and scaled
                tj = tile[j * L : j * L + nr]
                sr = scales[r : r + nr]
                o = first + j - base
                for l in range(nr):
                    tj[l] = buf[o + l * width] * sr[l]
                for l in range(nr, L):
                    tile[j * L + l] = zero
            if rotate:
                butterflies(tile, L, width, block, inv_sqrt)
            for l in range(nr):
                yr = y[(r + l) * d : (r + l + 1) * d]
                for j in range(d):
                    yr[j] = tile[j * L + l] * signs[j] if rotate else tile[j * L + l]

    return kernel


def applies(bits: int, t: torch.Tensor, meta_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernels take codes of ``bits`` bits on ``t``'s device with scales in ``meta_dtype``:
    kernels on, a CPU tensor that the Triton kernels do not take (:func:`.backend.triton_takes`: the
    tests' interpreter mode), ``bits <= MAX_LEVEL_BITS``, a dtype of :data:`META_DTYPES`. Any size: one
    compiled call costs less than the dozen torch calls of the steps even on a small message."""
    return (backend.enabled() and t.is_cpu and bits <= MAX_LEVEL_BITS and meta_dtype in META_DTYPES
            and not backend.triton_takes(t))


def encode_rows(x: torch.Tensor, signs: torch.Tensor | None, width: int, block: int, mids: torch.Tensor, bits: int,
                meta_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, np.ndarray] | None:
    """Per row of ``x``: rotate, scale by the row's RMS, code to the nearest level, pack -- in one pass.

    Args:
        x: float32 ``(rows, d)`` CPU, contiguous, ``rows, d >= 1``.
        signs: float32 ``(d,)`` random signs of the rotation, or None for no rotation (then
            ``width == block == d``).
        width: the rotated width (``d`` or the next power of two); ``block``: the Hadamard block.
        mids: float32 ``(2**bits - 1,)`` midpoints between neighbouring levels.
        bits: 1..:data:`.numba_codes.MAX_LEVEL_BITS`.
        meta_dtype: dtype the scales are sent in (:data:`META_DTYPES`), rounded up as
            :func:`..steps.grouping.round_meta` does.

    Returns:
        ``(packed, scales, tail)``: the uint8 stream of ``rows * width`` codes with its whole
        chunks written, the float32 ``(rows,)`` scales (values of ``meta_dtype``), and the
        ``n % CHUNK`` tail codes (float32, integral) for the caller to pack. None where it does
        not apply, its kernel failed, or a row holds inf/NaN or its scale overflows ``meta_dtype``.
    """
    if not applies(bits, x, meta_dtype):
        return None
    rows, d = x.shape
    n = rows * width
    full = n - n % CHUNK
    meta = META_DTYPES.index(meta_dtype)
    out = np.empty(packed_nbytes(n, bits), np.uint8)
    scales, tail, bad = np.empty(rows, np.float32), np.empty(n - full, np.float32), np.zeros(1, np.int64)
    xs = x.detach().numpy().reshape(-1)
    sg = signs.numpy() if signs is not None else np.ones(1, np.float32)
    inv_sqrt = np.float32(1.0 / math.sqrt(block))
    runs = [[c0 * CHUNK, c1 * CHUNK] for c0, c1 in parts(n // CHUNK)]
    runs[-1][1] = n
    calls = [(xs, sg, rows, d, width, block, inv_sqrt, mids.numpy(), TILE, a, b, full, out, scales, tail, bad) for a, b in runs]
    if not backend.run(("encode_rows", bits, signs is not None, meta), lambda: _build_encode(bits, signs is not None, meta),
                       calls) or bad[0]:
        return None
    return torch.from_numpy(out), torch.from_numpy(scales), tail


def decode_rows(packed: torch.Tensor, bits: int, table: torch.Tensor, scales: torch.Tensor, tail: torch.Tensor,
                rows: int, d: int, signs: torch.Tensor | None, width: int, block: int) -> torch.Tensor | None:
    """Inverse of :func:`encode_rows`: ``table[code] * scale[row]``, then the inverse rotation, per row.

    Args:
        packed: uint8 stream of ``rows * width`` codes of ``bits`` bits.
        table: float32 ``(2**bits,)`` levels.
        scales: float32 ``(rows,)`` per-row scales as sent.
        tail: the last ``rows * width % CHUNK`` codes, unpacked (float32, integral).
        rows, d, signs, width, block: as for :func:`encode_rows`.

    Returns:
        float32 ``(rows, d)``; None if its kernel failed. The caller checks :func:`applies` first (before
        unpacking the tail).
    """
    n = rows * width
    y = np.empty((rows, d), np.float32)
    sg = signs.numpy() if signs is not None else np.ones(1, np.float32)
    inv_sqrt = np.float32(1.0 / math.sqrt(block))
    k = len(parts(n // CHUNK))
    args = (packed.numpy(), table.numpy(), scales.numpy(), d, width, block, inv_sqrt, sg, TILE, tail.numpy(), n - n % CHUNK)
    calls = [(*args, rows * i // k, rows * (i + 1) // k, y.reshape(-1)) for i in range(k)]
    if not backend.run(("decode_rows", bits, signs is not None), lambda: _build_decode(bits, signs is not None), calls):
        return None
    return torch.from_numpy(y)
