"""Fused GPU kernels (Triton) of the codebook codec's token groups: rotation, RMS scale, levels and packing.

The GPU twin of :mod:`.rows` (compiled C on CPU). The steps of a token-grouped codebook encode --
random signs, padding, the Walsh-Hadamard butterflies, each row's sum of squares, the scale's
rounding, the division, the level assignment, the bit-packing -- are some sixty launches of
whole-tensor kernels on a GPU; here they are one, and so is the decode:

- :func:`encode_rows`: ``x`` ``(rows, d)`` -> packed codes and per-row scales, one program per chunk of
  the packed stream (:mod:`.bitpack`'s layout). A program first takes the rows its chunk touches
  (:func:`_encode_shape`), a block of rows at a time: signs, butterflies, the rotated rows stored
  (a scratch tensor), then each row's sum of squares in float64 folded in :func:`.levels.row_rms`'s
  order, its square root and the scale rounded up to the metadata dtype; then, after a barrier, it
  codes its chunk, each
  value divided by its row's scale and given the index of its nearest level, and packs it. A row
  that two chunks share is rotated and scaled by both programs, to the same bits.
- :func:`decode_rows`: per block of rows, each code read from the packed stream (whole chunks or the
  tail), ``level * scale``, the butterflies, the signs -- one kernel.

Same float operations in the same order as the reference steps (:meth:`..steps.hadamard.
HadamardRotation.forward`, :func:`.levels.row_rms`, :func:`..steps.grouping.round_meta`,
:func:`.levels.level_codes` and their inverses), IEEE-rounded (float32 division ``div_rn``; the
float64 division and square root, which PTX has only correctly rounded; no fused multiply-add:
:data:`.triton_codes.COMPILE_OPTIONS`), so the bytes are the reference's (tested under Triton's
interpreter without a GPU, compiled with one).

Nothing is read back to the host: a row holding inf/NaN gets a scale that is not finite, and so does
a scale past the metadata dtype's range; the decoder refuses such a payload
(:func:`.uniform.finite_grid`), where the steps would have raised in the encoder.

Scope: CUDA tensors (or CPU ones under :func:`.triton_codes.run_on_cpu`), float32, codes of up to
:data:`MAX_BITS` bits, rotated widths whose odd factor is at most :data:`MAX_ODD` (every power of two,
and ``3 * 2**k``, ``5 * 2**k``, ... -- 384, 576, 768, 960); elsewhere each function returns None and
the caller runs the steps.

Reference: the rotation as in QuaRot (Ashkboos et al., 2024); the fast Walsh-Hadamard transform
(Fino and Algazi, 1976); Lloyd-Max levels (Max 1960, Lloyd 1982); Triton (Tillet et al., MAPL 2019).
"""

from __future__ import annotations

import functools
import math

import torch

from .bitpack import CHUNK, layout_planes, layout_word, pack_bits_into, packed_nbytes
from .triton_codes import launch, available, triton

__all__ = ["MAX_BITS", "MAX_ODD", "applies", "encode_rows", "decode_rows"]

MAX_BITS = 4
"""Widest code (16 levels, one comparison per midpoint)."""

MAX_ODD = 15
"""Largest odd factor of a rotated width (its pairwise fold is unrolled)."""

_META = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_VALUES_PER_PROGRAM = 4096

if triton is not None:
    import triton.language as tl

    _CHUNK = tl.constexpr(CHUNK)

    @triton.jit
    def _fwht(y, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG: tl.constexpr):
        """The butterflies of :func:`.fwht.fwht` on each row of ``y`` ``(ROWS, BLOCK)`` (without the final
        scaling): for ``h = 1, 2, ..., BLOCK / 2``, ``(lo, hi) -> (lo + hi, lo - hi)`` for the pairs ``h`` apart."""
        for s in tl.static_range(LOG):
            p = tl.permute(tl.reshape(y, (ROWS * (BLOCK >> (s + 1)), 2, 1 << s)), (0, 2, 1))
            lo, hi = tl.split(p)
            y = tl.reshape(tl.permute(tl.join(lo + hi, lo - hi), (0, 2, 1)), (ROWS, BLOCK))
        return y

    @triton.jit
    def _fold_step(s, a, M: tl.constexpr, H: tl.constexpr, ODDP: tl.constexpr):
        """One step of the fold of :func:`.levels.row_rms` on ``s`` ``(RB, ODDP)``: ``s[:M-H] += s[H:M]``."""
        if M > 1:
            take = (a[None, :] == a[:, None] + H) & (a[None, :] < M)  # (ODDP, ODDP): [i, j] = j is i + H
            shifted = tl.sum(tl.where(take[None, :, :], s[:, None, :], 0.0), axis=2)  # one term, or none: exact
            s = s + shifted
        return s

    @triton.jit
    def _rotated_scales(x_ptr, signs_ptr, rot_ptr, scale_ptr, meta_ptr, r0, rows, d, WIDTH: tl.constexpr,
                        INV: tl.constexpr, RB: tl.constexpr, NBP: tl.constexpr, BLOCK: tl.constexpr,
                        LOG: tl.constexpr, ROTATE: tl.constexpr, K2: tl.constexpr, LOGK2: tl.constexpr,
                        ODD: tl.constexpr, ODDP: tl.constexpr, META: tl.constexpr):
        """Rows ``r0 .. r0 + RB - 1`` (those below ``rows``): signs and butterflies, the rotated rows stored in
        ``rot``, then each row's scale (float64 fold of its squares, square root, rounded up to the scale dtype)
        stored in ``scale`` (float32) and ``meta`` (as sent)."""
        rr = r0 + tl.arange(0, RB)[:, None, None]
        col = tl.arange(0, NBP)[None, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]
        live = (rr < rows) & (col < d)
        y = tl.load(x_ptr + rr * d + col, mask=live, other=0.0)
        if ROTATE:
            y = y * tl.load(signs_ptr + col, mask=col < d, other=0.0)
            y = tl.reshape(_fwht(tl.reshape(y, (RB * NBP, BLOCK)), RB * NBP, BLOCK, LOG) * INV, (RB, NBP, BLOCK))
        tl.store(rot_ptr + rr * WIDTH + col, y, mask=(rr < rows) & (col < WIDTH))
        tl.debug_barrier()  # the rotated rows, stored by all of this program's threads, are read back below
        r2 = r0 + tl.arange(0, RB)[:, None, None]
        a = tl.arange(0, ODDP)
        c2 = tl.arange(0, K2)[None, :, None] * ODD + a[None, None, :]
        v = tl.load(rot_ptr + r2 * WIDTH + c2, mask=(r2 < rows) & (a[None, None, :] < ODD), other=0.0).to(tl.float64)
        sq = v * v  # exact in float64
        for s in tl.static_range(LOGK2):  # s[:m/2] += s[m/2:m]: the halves of the power-of-two factor
            sq = tl.sum(tl.reshape(sq, (RB, 2, K2 >> (s + 1), ODDP)), axis=1)
        sq = tl.reshape(sq, (RB, ODDP))
        M2: tl.constexpr = (ODD + 1) // 2
        M3: tl.constexpr = (M2 + 1) // 2
        M4: tl.constexpr = (M3 + 1) // 2
        sq = _fold_step(sq, a, ODD, M2, ODDP)
        sq = _fold_step(sq, a, M2, M3, ODDP)
        sq = _fold_step(sq, a, M3, M4, ODDP)
        sq = _fold_step(sq, a, M4, (M4 + 1) // 2, ODDP)
        total = tl.sum(tl.where(a[None, :] == 0, sq, 0.0), axis=1)
        rms = tl.sqrt(total / WIDTH).to(tl.float32)  # float64: div.rn.f64 and sqrt.rn.f64 (IEEE, the only ones)
        r1 = r0 + tl.arange(0, RB)
        if META == 0:
            scale = rms
        else:
            m = rms.to(tl.bfloat16 if META == 1 else tl.float16)
            up = m.to(tl.int16, bitcast=True) + (m.to(tl.float32) < rms).to(tl.int16)  # round_meta: up, not down
            m = up.to(tl.bfloat16 if META == 1 else tl.float16, bitcast=True)
            tl.store(meta_ptr + r1, m, mask=r1 < rows)
            scale = m.to(tl.float32)
        tl.store(scale_ptr + r1, scale, mask=r1 < rows)

    @triton.jit
    def _chunk_codes(rot_ptr, scale_ptr, table_ptr, out_ptr, c, WIDTH: tl.constexpr, NM: tl.constexpr,
                     R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
        """Chunk ``c`` of the rotated values: each divided by its row's scale, its nearest level's index, the
        codes packed in the :mod:`.bitpack` layout and stored."""
        CG: tl.constexpr = _CHUNK // G
        lane = tl.arange(0, G)[:, None]
        i = c * _CHUNK + lane * CG + tl.arange(0, CG)[None, :]
        s = tl.load(scale_ptr + i // WIDTH)
        v = tl.math.div_rn(tl.load(rot_ptr + i), tl.where(s > 0, s, 1.0))
        codes = tl.zeros(v.shape, tl.int32)
        for j in tl.static_range(NM):  # torch.bucketize(v, mids): the midpoints (levels[1:] + levels[:-1]) / 2 below v
            mid = tl.math.div_rn(tl.load(table_ptr + j + 1) + tl.load(table_ptr + j), 2.0)
            codes += (v > mid).to(tl.int32)
        word = tl.sum(codes << (lane * R), axis=0)
        base = c * (_CHUNK * R // 8)
        j = tl.arange(0, CG)
        for q in tl.static_range(W):
            tl.store(out_ptr + base + q * CG + j, ((word >> (8 * q)) & 255).to(tl.uint8))

    @triton.jit(do_not_specialize=["rows", "d", "n"])
    def _encode_kernel(x_ptr, signs_ptr, rot_ptr, scale_ptr, meta_ptr, table_ptr, out_ptr, rows, d, n,
                       WIDTH: tl.constexpr, INV: tl.constexpr, RB: tl.constexpr, NBP: tl.constexpr,
                       BLOCK: tl.constexpr, LOG: tl.constexpr, ROTATE: tl.constexpr, K2: tl.constexpr,
                       LOGK2: tl.constexpr, ODD: tl.constexpr, ODDP: tl.constexpr, META: tl.constexpr,
                       NM: tl.constexpr, R: tl.constexpr, G: tl.constexpr, W: tl.constexpr, ROUNDS: tl.constexpr):
        """Program ``c``: the rows its chunk of rotated values touches (``ROUNDS`` blocks of ``RB`` rows from the
        chunk's first), rotated and scaled, then the chunk coded and packed, if it is whole (a partial last chunk
        is the reference's)."""
        c = tl.program_id(0).to(tl.int64)
        for k in range(ROUNDS):  # blocks of about CHUNK values, a tile the registers hold (a loop, not unrolled)
            _rotated_scales(x_ptr, signs_ptr, rot_ptr, scale_ptr, meta_ptr, c * _CHUNK // WIDTH + k * RB, rows, d,
                            WIDTH, INV, RB, NBP, BLOCK, LOG, ROTATE, K2, LOGK2, ODD, ODDP, META)
        tl.debug_barrier()  # the rows and scales this program's threads stored are read back by others of them
        if (c + 1) * _CHUNK <= n:
            _chunk_codes(rot_ptr, scale_ptr, table_ptr, out_ptr, c, WIDTH, NM, R, G, W)

    @triton.jit
    def _code_at(packed_ptr, i, live, full, nbytes, R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
        """The ``R``-bit code of value ``i`` (int64 indices, ``live`` mask) in the :mod:`.bitpack` stream:
        from its chunk's lane words below ``full``, from the tail's little-endian bit stream above."""
        CG: tl.constexpr = _CHUNK // G
        whole = live & (i < full)
        o = i % _CHUNK
        at = (i // _CHUNK) * (_CHUNK * R // 8) + o % CG
        word = tl.zeros(i.shape, tl.int32)
        for q in tl.static_range(W):
            word |= tl.load(packed_ptr + at + q * CG, mask=whole, other=0).to(tl.int32) << (8 * q)
        code = (word >> ((o // CG) * R).to(tl.int32)) & ((1 << R) - 1)
        bit = (i - full) * R
        byte = full * R // 8 + bit // 8
        rest = live & (i >= full)
        pair = tl.load(packed_ptr + byte, mask=rest, other=0).to(tl.int32) | \
            (tl.load(packed_ptr + byte + 1, mask=rest & (byte + 1 < nbytes), other=0).to(tl.int32) << 8)
        return tl.where(i < full, code, (pair >> (bit % 8).to(tl.int32)) & ((1 << R) - 1))

    @triton.jit(do_not_specialize=["rows", "d", "full", "nbytes"])
    def _decode_kernel(packed_ptr, table_ptr, scale_ptr, signs_ptr, y_ptr, rows, d, full, nbytes,
                       WIDTH: tl.constexpr, INV: tl.constexpr, RB: tl.constexpr, NBP: tl.constexpr,
                       BLOCK: tl.constexpr, LOG: tl.constexpr, ROTATE: tl.constexpr, R: tl.constexpr,
                       G: tl.constexpr, W: tl.constexpr):
        rr = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)[:, None, None]
        col = tl.arange(0, NBP)[None, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]
        live = (rr < rows) & (col < WIDTH)
        codes = _code_at(packed_ptr, rr * WIDTH + col, live, full, nbytes, R, G, W)
        y = tl.load(table_ptr + codes, mask=live, other=0.0) * \
            tl.load(scale_ptr + rr, mask=rr < rows, other=0.0).to(tl.float32)
        y = tl.where(live, y, 0.0)
        if ROTATE:
            y = tl.reshape(_fwht(tl.reshape(y, (RB * NBP, BLOCK)), RB * NBP, BLOCK, LOG) * INV, (RB, NBP, BLOCK))
            y = y * tl.load(signs_ptr + col, mask=col < d, other=0.0)
        tl.store(y_ptr + rr * d + col, y, mask=(rr < rows) & (col < d))


@functools.lru_cache(maxsize=64)
def _shape(width: int, block: int, rotate: bool) -> dict[str, int] | None:
    """The constexprs of a rotated width (``block``: the Hadamard block; without a rotation the rows are loaded
    in blocks of their largest power-of-two divisor); None if the width's odd factor is too large. One dict per
    width (do not modify it)."""
    k2 = width & -width
    odd = width // k2
    if odd > MAX_ODD:
        return None
    block = block if rotate else k2
    nbp = 1 << (width // block - 1).bit_length()
    return {"RB": max(1, _VALUES_PER_PROGRAM // (nbp * block)), "NBP": nbp, "BLOCK": block,
            "LOG": block.bit_length() - 1, "K2": k2, "LOGK2": k2.bit_length() - 1, "ODD": odd,
            "ODDP": 1 << (odd - 1).bit_length()}


def _encode_shape(shape: dict[str, int], width: int) -> dict[str, int]:
    """The constexprs of the one-pass encode: :func:`_shape`'s with the rows a chunk of :data:`.bitpack.CHUNK`
    rotated values touches, at most, rounded up to a power of two, taken as ``ROUNDS`` blocks of ``RB`` rows
    (:func:`_shape`'s block of about :data:`_VALUES_PER_PROGRAM` values, or fewer where fewer rows cover)."""
    most = CHUNK // width if CHUNK % width == 0 else (CHUNK - 1) // width + 2
    covering = 1 << (most - 1).bit_length()
    rb = min(shape["RB"], covering)
    return {**shape, "RB": rb, "ROUNDS": covering // rb}


def applies(bits: int, t: torch.Tensor, meta_dtype: torch.dtype, width: int, block: int) -> bool:
    """Whether these kernels take a message on ``t``'s device: Triton takes it (:func:`.triton_codes.available`),
    ``bits <= MAX_BITS``, scales of float32, bfloat16 or float16, and a rotated width they unroll."""
    return bits <= MAX_BITS and meta_dtype in _META and available(t) and _shape(width, block, True) is not None


def encode_rows(x: torch.Tensor, signs: torch.Tensor | None, width: int, block: int, levels: torch.Tensor, bits: int,
                meta_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of ``x``: rotate, scale by the row's RMS, code to the nearest level, pack -- in one launch.

    Args:
        x: float32 ``(rows, d)``, contiguous, on the GPU, ``rows, d >= 1``.
        signs: float32 ``(d,)`` random signs of the rotation on ``x``'s device, or None for no rotation
            (then ``width == block == d``, a power of two or a width of :func:`applies`).
        width: the rotated width (``d`` or the next power of two); ``block``: the Hadamard block.
        levels: float32 ``(2**bits,)`` ascending, on ``x``'s device (a value's code is the number of midpoints
            ``(levels[j] + levels[j + 1]) / 2`` below it).
        bits: 1..:data:`MAX_BITS`.
        meta_dtype: dtype the scales are sent in, rounded up as :func:`..steps.grouping.round_meta` does.

    Returns:
        ``(packed, scales)``: the uint8 stream of ``rows * width`` codes (the ``n % CHUNK`` tail packed by
        the reference) and the ``(rows,)`` scales in ``meta_dtype``; None where it does not apply or a
        kernel failed (one warning, :func:`.backend.failure`).
    """
    shape = _shape(width, block, signs is not None)
    if shape is None or not (available(x) and x.is_contiguous() and x.dtype == torch.float32):
        return None
    rows, d = x.shape
    n = rows * width
    dev = x.device
    rot = torch.empty(n, dtype=torch.float32, device=dev)
    scale = torch.empty(rows, dtype=torch.float32, device=dev)
    meta = scale if meta_dtype == torch.float32 else torch.empty(rows, dtype=meta_dtype, device=dev)
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=dev)
    r, (g, w) = layout_planes(bits)[1], layout_word(layout_planes(bits)[1])[:2]
    if not launch("encode_rows", _encode_kernel, (-(-n // CHUNK),), x, x if signs is None else signs, rot, scale,
                   meta, levels.contiguous(), out, rows, d, n, WIDTH=width, INV=1.0 / math.sqrt(block),
                   ROTATE=signs is not None, META=_META[meta_dtype], NM=(1 << bits) - 1, R=r, G=g, W=w,
                   **_encode_shape(shape, width)):
        return None
    full = n - n % CHUNK
    if full < n:  # the reference's tail (a bit stream, :mod:`.bitpack`)
        s = scale[torch.arange(full, n, device=dev) // width]
        v = rot[full:] / torch.where(s > 0, s, 1.0)
        mids = (levels[1:] + levels[:-1]) / 2
        pack_bits_into(out, torch.bucketize(v, mids).to(torch.int32), bits, n, full, check=False)
    return out, meta


def decode_rows(packed: torch.Tensor, bits: int, table: torch.Tensor, scales: torch.Tensor, rows: int, d: int,
                signs: torch.Tensor | None, width: int, block: int) -> torch.Tensor | None:
    """Inverse of :func:`encode_rows` in one launch: ``table[code] * scale[row]``, the inverse rotation, per row.

    Args:
        packed: uint8 stream of ``rows * width`` codes of ``bits`` bits, on the GPU.
        table: float32 ``(2**bits,)`` levels; scales: ``(rows,)`` as sent (float32, bfloat16 or float16);
            signs: float32 ``(d,)`` or None; all on ``packed``'s device.
        rows, d, width, block: as for :func:`encode_rows`.

    Returns:
        float32 ``(rows, d)``; None where it does not apply or the kernel failed.
    """
    shape = _shape(width, block, signs is not None)
    if shape is None or not available(packed) or scales.dtype not in _META:
        return None
    n = rows * width
    r = layout_planes(bits)[1]
    g, w = layout_word(r)[:2]
    y = torch.empty(rows, d, dtype=torch.float32, device=packed.device)
    grid = (-(-rows // shape["RB"]),)
    shape = {k: v for k, v in shape.items() if k in ("RB", "NBP", "BLOCK", "LOG")}
    if not launch("decode_rows", _decode_kernel, grid, packed, table.contiguous(), scales.contiguous(),
                   packed if signs is None else signs, y, rows, d, n - n % CHUNK, packed.numel(), WIDTH=width,
                   INV=1.0 / math.sqrt(block), ROTATE=signs is not None, R=r, G=g, W=w, **shape):
        return None
    return y
