"""Compiled CPU loops (C, ``codes.c``) of the per-value codec steps: values read once, packed codes written once.

The reference steps (:mod:`.uniform`, :mod:`.buckets`, :mod:`.levels`, :mod:`.fwht`) run a chain
of whole-block torch ops -- subtract, divide, round, clamp, convert, add the bucket, shift and add
the lanes of :mod:`.bitpack` -- each a pass over memory. Here each chain is one C loop (built
with the package as the extension ``_codes``, loaded with ctypes), specialised per code width and
bucket count so that the inner loops unroll and vectorise:

- :func:`encode_uniform` / :func:`decode_uniform`: ``round((x - lo[g]) / div[g])`` clamped, for
  groups ``g`` of ``group_len`` consecutive values, bit-packed; and the inverse;
- :func:`encode_buckets` / :func:`decode_buckets`: sort quantization's codes ``bucket * 2**Q +
  level`` (each value's bucket by comparison with the ``2**S - 1`` boundaries), ``S <= 4``;
- :func:`encode_levels` / :func:`decode_levels`: the codebook codec's nearest level (``bits <= 4``)
  and ``level * scale``;
- :func:`fwht`: the Walsh-Hadamard butterflies of the rotation, row by row;
- the passes that find a grid -- the value range, sort quantization's boundary sample and its extrema, a
  sampled split's grid -- are in :mod:`.compiled_grid`;
- a small CPU message in **one call** (:func:`one_call`): :func:`uniform_message`,
  :func:`.compiled_grid.sampled_grid` with ``pack`` and :func:`message_values`. A pipeline's messages are small
  and each is coded after a stage's compute has evicted the caches, where every separate step --
  a torch or numpy call -- costs 15-25 us: one call is most of the saving.

Each performs the same float32 operations, in the same order, as the reference, so payloads and
decoded tensors are **bit-identical** to it (golden payloads; tested on random and adversarial
tensors).

Protocol (inside :mod:`dgpipe.compression.kernels` only): each function writes the whole chunks of
its output and returns True (or its result), or returns False (None) where it does not apply, its
kernel failed (:func:`.backend.run`) or the extension was not built (:func:`.backend.library`: one
notice per process); the step that called it then runs the reference. The ``n % CHUNK`` tail is the
calling step's.

Reference: the radix sort is the textbook LSD radix sort of IEEE-754 keys (Knuth, TAOCP vol. 3,
5.2.5); the vectorisation and the layout are ours (:mod:`.bitpack`).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from . import backend
from .backend import MIN_VALUES, team
from .bitpack import CHUNK, packed_nbytes

__all__ = [
    "MAX_SPLIT_BITS", "MAX_LEVEL_BITS", "MAX_BITS", "SIGNATURES", "open_library", "available", "run_kernel",
    "encode_uniform", "decode_uniform", "encode_buckets", "decode_buckets", "encode_levels", "decode_levels", "fwht",
    "one_call", "uniform_message", "message_values",
]

MAX_SPLIT_BITS = 4
"""Largest split-bit count of the compiled sort-quantization kernels (16 buckets)."""

MAX_LEVEL_BITS = 4
"""Widest code of the compiled codebook kernels (16 levels: one comparison per midpoint)."""

MAX_BITS = 16
"""Widest code of the compiled kernels."""

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_TEAM = [_L, _L, _L, _I]  # units [p0, p1), parts, threads (team.h)
SIGNATURES = {
    "dgpipe_encode_uniform": [_P, _P, _P, _L, _L, _I, _P, *_TEAM],
    "dgpipe_decode_uniform": [_P, _I, _P, _P, _L, _L, _P, *_TEAM],
    "dgpipe_encode_buckets": [_P, _P, _P, _P, _I, _I, _L, _P, *_TEAM],
    "dgpipe_decode_buckets": [_P, _I, _I, _P, _P, _L, _P, *_TEAM],
    "dgpipe_encode_levels": [_P, _P, _I, _L, _P, *_TEAM],
    "dgpipe_decode_levels": [_P, _I, _P, _P, _L, _L, _P, *_TEAM],
    "dgpipe_fwht": [_P, _L, _F, *_TEAM],
    "dgpipe_sort_sample": [_P, _P, _L, _P],
    "dgpipe_value_range": [_P, _L, _P, _L, _I],
    "dgpipe_bucket_extrema": [_P, _L, _P, _I, _P, _L, _I],
    "dgpipe_sampled_grid": [_P, _L, _P, _L, _P, _I, _I, _P, _P, _L, _P],
    "dgpipe_uniform_message": [_P, _L, _F, _F, _I, _P, _P],
    "dgpipe_message_values": [_P, _I, _I, _P, _L, _P],
}
"""ctypes argument types of the entry points of ``codes.c`` (all return an int: 0 done, 1 not specialised
for the widths asked, 2 out of memory). A kernel over chunks or rows takes the range ``[p0, p1)`` and the
parts and threads of :func:`.backend.team` last."""


def open_library(path: str) -> ctypes.CDLL:
    """The kernels of the shared library at ``path`` (built from ``codes.c``), with their ctypes signatures.

    Raises:
        OSError: ``path`` is not a loadable library.
    """
    return backend.prepare(ctypes.CDLL(path), SIGNATURES)


def available() -> bool:
    """Whether the extension ``_codes`` was built (:func:`.backend.library`; the notice where not)."""
    return backend.library("_codes", SIGNATURES) is not None


def _kernel(name: str):
    """The C function ``dgpipe_<name>`` as a kernel of :func:`.backend.run`: raises where it returns non-zero."""
    fn = getattr(backend.library("_codes", SIGNATURES), "dgpipe_" + name)

    def call(*args) -> None:
        rc = fn(*args)
        if rc:
            raise (MemoryError if rc == 2 else ValueError)(f"dgpipe_{name} returned {rc}")

    return call


def run_kernel(name: str, key: tuple, args: tuple) -> bool:
    """Run ``dgpipe_<name>`` on ``args`` (:func:`.backend.run`, which builds it once)."""
    return available() and backend.run((name, *key), lambda: _kernel(name), args)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 1-D float32 tensor (the kernels read raw memory)."""
    return t.detach().reshape(-1).to(torch.float32).contiguous()


def _chunks(n: int) -> tuple[int, int, int, int]:
    """The whole chunks of ``n`` values, ``[0, n // CHUNK)``, with their parts and threads (:func:`.backend.team`)."""
    return (0, n // CHUNK, *team(n // CHUNK))


# --- per-value steps over whole chunks -------------------------------------------------------------


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
    if n < MIN_VALUES or not x.is_cpu or bits > MAX_BITS:
        return False
    x, lo, div = _f32(x), _f32(lo), _f32(div)
    head = (x.data_ptr(), lo.data_ptr(), div.data_ptr(), group_len, n)
    return run_kernel("encode_uniform", (bits,), (*head, bits, out.data_ptr(), *_chunks(n)))


def decode_uniform(
    packed: torch.Tensor, bits: int, lo: torch.Tensor, step: torch.Tensor, group_len: int, y: torch.Tensor
) -> bool:
    """Inverse of :func:`encode_uniform`: ``y[i] = lo[g] + code[i] * step[g]`` for the whole chunks.

    Args:
        packed: uint8 stream of ``n = y.numel()`` codes of ``bits`` bits.
        lo, step: float32 ``(n_groups,)``, as sent.
        group_len: values per group.
        y: float32 ``(n,)`` contiguous output; values ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where it does not apply.
    """
    n = y.numel()
    if n < MIN_VALUES or not y.is_cpu or bits > MAX_BITS:
        return False
    packed, lo, step = packed.contiguous(), _f32(lo), _f32(step)
    head = (packed.data_ptr(), bits, lo.data_ptr(), step.data_ptr(), group_len, n)
    return run_kernel("decode_uniform", (bits,), (*head, y.data_ptr(), *_chunks(n)))


def encode_buckets(
    x: torch.Tensor, bounds: torch.Tensor, mins: torch.Tensor, div: torch.Tensor, quant_bits: int, out: torch.Tensor
) -> bool:
    """Sort-quantization codes ``bucket * 2**Q + level`` of the whole chunks of ``x``, packed into ``out``.

    ``level = clamp(round((x - mins[b]) / div[b]), 0, 2**Q - 1)`` as in :func:`.buckets.bucket_codes`.

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
    if n < MIN_VALUES or s > MAX_SPLIT_BITS or quant_bits + s > MAX_BITS or not x.is_cpu:
        return False
    x, bounds, mins, div = _f32(x), _f32(bounds), _f32(mins), _f32(div)
    head = (x.data_ptr(), bounds.data_ptr(), mins.data_ptr(), div.data_ptr(), quant_bits, s, n)
    return run_kernel("encode_buckets", (quant_bits, s), (*head, out.data_ptr(), *_chunks(n)))


def decode_buckets(packed: torch.Tensor, quant_bits: int, mins: torch.Tensor, step: torch.Tensor,
                   y: torch.Tensor) -> bool:
    """Inverse of :func:`encode_buckets`: ``y = mins[b] + level * step[b]`` for the whole chunks.

    Args:
        packed: uint8 stream of ``n = y.numel()`` codes of ``Q + S`` bits.
        quant_bits: Q.
        mins, step: float32 ``(2**S,)`` as sent, ``S <= 4``.
        y: float32 ``(n,)`` contiguous output; values ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where it does not apply.
    """
    n, s = y.numel(), mins.numel().bit_length() - 1
    if n < MIN_VALUES or s > MAX_SPLIT_BITS or quant_bits + s > MAX_BITS or not y.is_cpu:
        return False
    packed, mins, step = packed.contiguous(), _f32(mins), _f32(step)
    head = (packed.data_ptr(), quant_bits, s, mins.data_ptr(), step.data_ptr(), n)
    return run_kernel("decode_buckets", (quant_bits, s), (*head, y.data_ptr(), *_chunks(n)))


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
    v, mids = _f32(v), _f32(mids)
    head = (v.data_ptr(), mids.data_ptr(), bits, n)
    return run_kernel("encode_levels", (bits,), (*head, out.data_ptr(), *_chunks(n)))


def decode_levels(packed: torch.Tensor, bits: int, table: torch.Tensor, scale: torch.Tensor, group_len: int,
                  y: torch.Tensor) -> bool:
    """Inverse of :func:`encode_levels` with scales: ``y[i] = table[code[i]] * scale[i // group_len]`` (whole chunks).

    Args:
        packed: uint8 stream of ``n = y.numel()`` codes of ``bits`` bits.
        table: float32 ``(2**bits,)`` levels.
        scale: float32 ``(n_groups,)`` per-group scales, wire order.
        group_len: values per group.
        y: float32 ``(n,)`` contiguous output, wire order; values ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where it does not apply.
    """
    n = y.numel()
    if n < MIN_VALUES or bits > MAX_LEVEL_BITS or not y.is_cpu:
        return False
    packed, table, scale = packed.contiguous(), _f32(table), _f32(scale)
    head = (packed.data_ptr(), bits, table.data_ptr(), scale.data_ptr(), group_len, n)
    return run_kernel("decode_levels", (bits,), (*head, y.data_ptr(), *_chunks(n)))


def fwht(x: torch.Tensor) -> torch.Tensor | None:
    """:func:`.fwht.fwht` of a float32 CPU tensor ``(..., b)`` (same bits), or None where it does not apply."""
    b = x.shape[-1]
    if x.numel() < MIN_VALUES or x.dtype != torch.float32 or not x.is_cpu:
        return None
    y = x.detach().contiguous().clone()
    parts, threads = team(y.numel() // CHUNK)  # cut as the values' chunks would be
    args = (y.data_ptr(), b, 1.0 / math.sqrt(b), 0, y.numel() // b, parts, threads)
    return y if run_kernel("fwht", (), args) else None


# --- sort quantization's grid -------------------------------------------------------------------------


def one_call(t: torch.Tensor, n: int | None = None) -> bool:
    """Whether a message of ``n`` values (default ``t.numel()``; ``t`` its values or its code stream) is
    coded in one compiled call (:func:`uniform_message`, :func:`message_values`): a CPU tensor, whole
    chunks, at least :data:`.backend.MIN_VALUES`, and one thread's share of values (:func:`.backend.team`)."""
    n = t.numel() if n is None else n
    return t.is_cpu and n % CHUNK == 0 and n >= MIN_VALUES and team(n // CHUNK)[0] == 1


def uniform_message(x: torch.Tensor, lo: float, hi: float, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-tensor uniform quantization's metadata and packed codes in one compiled call: the grid
    of :func:`..steps.grid.grid_meta` (float32 ``step = (hi - lo) / (2**bits - 1)``) and the codes of
    :func:`encode_uniform`, so the same bytes.

    Args:
        x: 1-D float32 CPU values, contiguous, whole chunks.
        lo, hi: the min and max of ``x`` (float32 values as Python floats; the caller checked that
            the range is finite).
        bits: code width.

    Returns:
        ``(meta, packed)``: float32 ``(2,)`` ``[lo, step]`` as sent and the uint8 code stream; None where
        the call does not apply (off, not CPU, not whole chunks, more than one thread's share of values).
    """
    if not one_call(x) or not x.is_contiguous() or x.dtype != torch.float32 or bits > MAX_BITS:
        return None
    n = x.numel()
    meta, out = np.empty(2, np.float32), np.empty(packed_nbytes(n, bits), np.uint8)
    ok = run_kernel("uniform_message", (bits,), (x.data_ptr(), n, lo, hi, bits, meta.ctypes.data, out.ctypes.data))
    return (torch.from_numpy(meta), torch.from_numpy(out)) if ok else None


def message_values(packed: torch.Tensor, quant_bits: int, split_bits: int, meta: torch.Tensor,
                   n: int) -> torch.Tensor | None:
    """The ``n`` decoded values of a one-group message in one compiled call: sort quantization's
    ``mins[b] + level * step[b]`` (:func:`decode_buckets`), or with ``split_bits = 0`` uniform
    quantization's ``lo + code * step`` (:func:`decode_uniform`) -- the same loops, so the same values.

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
    if (not one_call(packed, n) or split_bits > MAX_SPLIT_BITS or quant_bits + split_bits > MAX_BITS
            or meta.dtype != torch.float32):
        return None
    if packed.numel() != packed_nbytes(n, quant_bits + split_bits) or meta.numel() != 2 << split_bits:
        raise ValueError(f"message_values: {packed.numel()} code bytes and {meta.numel()} metadata values for "
                         f"{n} codes of {quant_bits}+{split_bits} bits")  # the kernel does not check bounds
    packed, meta = packed.contiguous(), meta.contiguous()
    y = np.empty(n, np.float32)
    ok = run_kernel("message_values", (quant_bits, split_bits),
              (packed.data_ptr(), quant_bits, split_bits, meta.data_ptr(), n, y.ctypes.data))
    return torch.from_numpy(y) if ok else None
