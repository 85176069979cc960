"""Compiled C loops of the codebook codec's token groups: rotation, RMS scale, levels and packing in one pass per row.

The step-by-step codebook encode with token groups (:mod:`..codecs.codebook`) is a
chain of whole-tensor passes: random signs, padding, the Walsh-Hadamard butterflies, the
rows' sums of squares, the scale's rounding, the division, the level assignment and the
bit-packing -- each a pass over memory and a call. Here one compiled loop (``rows.c``,
built with the package as the optional extension ``_rows``) takes each row (a token's
vector) through all of them while it is in the first-level cache, and the decode likewise
(unpack, ``level * scale``, the inverse butterflies, the signs):

- :func:`encode_rows`: ``x`` ``(rows, d)`` -> packed codes and per-row scales;
- :func:`decode_rows`: packed codes and scales -> ``(rows, d)``.

Each performs the same floating-point operations, in the same order, as the reference steps
(:meth:`..steps.hadamard.HadamardRotation.forward`, :func:`.levels.row_rms`,
:func:`..steps.grouping.round_meta`, :func:`.levels.level_codes`, and their inverses), so
payloads and decoded tensors are **bit-identical** to them (golden payloads; tested on
random and adversarial tensors). Rows stay in row-major order: the butterflies of strides 1
to 8 run inside a vector register with lane permutations, the longer ones on whole
vectors; the level of a value is found by a binary search over the midpoints held in a
register (``bits`` comparisons, the same count as one comparison per midpoint). The C source
uses the vector extensions of GCC and clang, built on x86-64 as AVX-512, AVX2 and baseline variants
(target attributes, one picked per call by the CPU's features; GCC 11+, clang 14+, x86-64 and aarch64)
and is compiled with ``-ffp-contract=fast``: the only
products a fused multiply-add can take are exact ones (a value times +-1, a float32 squared in
float64), so it rounds as the separate operations do (see the head of ``rows.c``).

Threads: the encode splits the code stream into parts of whole chunks (:func:`.backend.team`;
the last part also takes the ``n % CHUNK`` tail, which the caller packs), a row that straddles
two parts is rotated by both; the decode splits the rows. The parts run on torch's OpenMP threads
(``team.h``).

Where the extension was not built (no C compiler at install time), the first use says so once
(:data:`.backend.MISSING`, a ``RuntimeWarning``); then, and where the input holds inf/NaN, the functions
return None and the caller runs the reference steps (which raise the error).

Reference: the Hadamard rotation as in QuaRot (Ashkboos et al., 2024); the fast
Walsh-Hadamard transform (Fino and Algazi, 1976); Lloyd-Max levels (Max 1960, Lloyd 1982);
the single-pass structure is ours.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from . import backend
from .backend import team
from .dispatch import choose
from .bitpack import CHUNK, packed_nbytes

__all__ = ["MAX_BITS", "META_DTYPES", "SIGNATURES", "available", "applies", "decode_rows", "encode_rows",
           "open_library"]

MAX_BITS = 4
"""Widest code of the kernels (16 levels: the midpoints fit one vector register)."""

META_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Scale dtypes the kernels round to."""

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
SIGNATURES = {
    "dgpipe_encode_rows": [_P, _P, _L, _L, _L, _L, ctypes.c_float, _P, _I, _I, _I, ctypes.c_double, _L, _P, _P, _P,
                           _L, _I],
    "dgpipe_decode_rows": [_P, _I, _P, _P, _L, _L, _L, ctypes.c_float, _P, _P, _L, _P, _L, _L, _L, _I],
}
"""ctypes argument types of the entry points of ``rows.c`` (both return an int: 0 done, 1 a row refused, 2 out of
memory), the parts and threads of :func:`.backend.team` last."""


def open_library(path: str) -> ctypes.CDLL:
    """The kernels of the shared library at ``path`` (built from ``rows.c``), with their ctypes signatures.

    Raises:
        OSError: ``path`` is not a loadable library.
    """
    return backend.prepare(ctypes.CDLL(path), SIGNATURES)


def _load():
    """The compiled library (ctypes), or None where the extension was not built (:func:`.backend.library`)."""
    return backend.library("_rows", SIGNATURES)


def available() -> bool:
    """Whether the compiled extension is installed (built from ``rows.c`` with the package)."""
    return _load() is not None


def _meta_format(meta_dtype: torch.dtype) -> tuple[int, int, float]:
    """``(explicit mantissa bits, least normal exponent, largest finite value)`` of the scale dtype;
    ``(0, 0, 0.0)`` for float32, which needs no rounding."""
    if meta_dtype == torch.float32:
        return 0, 0, 0.0
    info = torch.finfo(meta_dtype)
    return round(-math.log2(info.eps)), round(math.log2(info.tiny)), info.max


def applies(bits: int, t: torch.Tensor, meta_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernels take codes of ``bits`` bits on ``t``'s device with scales in ``meta_dtype``:
    the C backend for ``t`` (:func:`.dispatch.choose`, at any size: one compiled call costs less than the
    dozen torch calls of the steps even on a small message), the extension built (else
    :data:`.backend.MISSING`, once), ``bits <= MAX_BITS``, a dtype of :data:`META_DTYPES`."""
    return bits <= MAX_BITS and meta_dtype in META_DTYPES and choose(t, least=1) == "c" and available()


def _encode(*args) -> None:
    """The C encode on ``args[:-1]``; sets ``args[-1][0]`` (a flag array) where it refuses a row."""
    rc = _load().dgpipe_encode_rows(*args[:-1])
    if rc == 1:
        args[-1][0] = 1
    elif rc:
        raise (MemoryError if rc == 2 else RuntimeError)(f"dgpipe_encode_rows returned {rc}")


def _decode(*args) -> None:
    """The C decode on ``args``."""
    rc = _load().dgpipe_decode_rows(*args)
    if rc:
        raise (MemoryError if rc == 2 else RuntimeError)(f"dgpipe_decode_rows returned {rc}")


def encode_rows(x: torch.Tensor, signs: torch.Tensor | None, width: int, block: int, mids: torch.Tensor, bits: int,
                meta_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, np.ndarray] | None:
    """Per row of ``x``: rotate, scale by the row's RMS, code to the nearest level, pack -- in one pass.

    Args:
        x: float32 ``(rows, d)`` CPU, contiguous, ``rows, d >= 1``.
        signs: float32 ``(d,)`` random signs of the rotation, or None for no rotation (then
            ``width == block == d``).
        width: the rotated width (``d`` or the next power of two); ``block``: the Hadamard block.
        mids: float32 ``(2**bits - 1,)`` midpoints between neighbouring levels, ascending.
        bits: 1..:data:`MAX_BITS`.
        meta_dtype: dtype the scales are sent in (:data:`META_DTYPES`), rounded up as
            :func:`..steps.grouping.round_meta` does.

    Returns:
        ``(packed, scales, tail)``: the uint8 stream of ``rows * width`` codes with its whole
        chunks written, the float32 ``(rows,)`` scales (values of ``meta_dtype``), and the
        ``n % CHUNK`` tail codes (uint8) for the caller to pack. None where it does not apply, its
        kernel failed, or a row holds inf/NaN or its scale overflows ``meta_dtype``.

    Raises:
        Nothing: a kernel failure (out of memory) is one ``RuntimeWarning`` and None (:func:`.backend.run`).
    """
    if not applies(bits, x, meta_dtype):
        return None
    rows, d = x.shape
    n = rows * width
    full = n - n % CHUNK
    out = np.empty(packed_nbytes(n, bits), np.uint8)
    scales, tail = np.empty(rows, np.float32), np.empty(n - full, np.uint8)
    xs = x.detach()
    mids = mids.contiguous()
    refused = np.zeros(1, np.int64)
    args = (xs.data_ptr(), None if signs is None else signs.data_ptr(), rows, d, width, block, 1.0 / math.sqrt(block),
            mids.data_ptr(), bits, *_meta_format(meta_dtype), full, out.ctypes.data, scales.ctypes.data,
            tail.ctypes.data, *team(n // CHUNK), refused)
    if not backend.run(("encode_rows", "c"), lambda: _encode, args) or refused[0]:
        return None
    return torch.from_numpy(out), torch.from_numpy(scales), tail


def decode_rows(packed: torch.Tensor, bits: int, table: torch.Tensor, scales: torch.Tensor, tail: np.ndarray,
                rows: int, d: int, signs: torch.Tensor | None, width: int, block: int) -> torch.Tensor | None:
    """Inverse of :func:`encode_rows`: ``table[code] * scale[row]``, then the inverse rotation, per row.

    Args:
        packed: uint8 stream of ``rows * width`` codes of ``bits`` bits.
        table: float32 ``(2**bits,)`` levels.
        scales: float32 ``(rows,)`` per-row scales as sent.
        tail: uint8 ``(rows * width % CHUNK,)``: the last codes, unpacked.
        rows, d, signs, width, block: as for :func:`encode_rows`.

    Returns:
        float32 ``(rows, d)``; None if its kernel failed. The caller checks :func:`applies` first (before
        unpacking the tail).
    """
    n = rows * width
    y = np.empty((rows, d), np.float32)
    table, scales = table.contiguous(), scales.contiguous()
    tail = np.ascontiguousarray(tail, np.uint8)
    args = (packed.data_ptr(), bits, table.data_ptr(), scales.data_ptr(), d, width, block, 1.0 / math.sqrt(block),
            None if signs is None else signs.data_ptr(), tail.ctypes.data, n - n % CHUNK, y.ctypes.data, 0, rows,
            *team(n // CHUNK))
    if not backend.run(("decode_rows", "c"), lambda: _decode, args):
        return None
    return torch.from_numpy(y)
