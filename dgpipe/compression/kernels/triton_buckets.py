"""Sort quantization on the GPU (Triton): a sampled split's whole message in two launches, nothing read back to
the host; the bucket codes and values of any split; a sampled split's per-bucket maxima.

- :func:`encode_buckets` / :func:`decode_buckets`: codes ``bucket * 2**Q + level`` (the bucket by comparison
  with the boundaries) of the whole chunks, any number of buckets, and back;
- :func:`bucket_maxima`: per-bucket maxima (a partial max per program, then their max) where the codes are
  stochastic (the message then takes the steps);
- :func:`encode_sampled`: the whole message of a sampled split, below.

The reference (:func:`.buckets.bucket_grid`) sorts a fixed sample of the values, takes ``2**S - 1`` of its
values as the bucket boundaries, then needs the global min and each bucket's max -- a pass over all values --
before it can send the grid and code: some thirty launches on a GPU. Here, after the sample's gather and sort
(torch):

1. :func:`_sampled_parts_kernel`: program ``p`` reads blocks ``p, p + parts, ...`` of the values, puts each in its
   bucket (the boundaries read from the sorted sample at their ranks ``i * m // 2**S``) and keeps per bucket the
   max, with the min and a NaN flag: its row of the partial results.
2. :func:`_encode_sampled_kernel`: every program reduces the rows itself (no third launch), forms the grid --
   ``mins = (min, *boundaries)``, ``maxs = max(mins, bucket maxima)``, ``step = (maxs - mins) / (2**Q - 1)``,
   the divisor -- stores it (every program the same bits), and after a barrier codes its chunk
   ``bucket * 2**Q + level`` in the :mod:`.bitpack` layout, as :func:`encode_buckets`.

Same float32 operations as the reference (a zero as ``+0.0`` where it adds ``0.0``, IEEE division), so the same
bytes. A NaN anywhere makes every step NaN and an infinite value a step that is not finite: the decoder refuses
the grid (:func:`.uniform.finite_grid`).

Reference: sort quantization's split as in :mod:`.buckets`; the two-launch reduction as
:func:`.triton_codes.encode_message`; Triton (Tillet et al., MAPL 2019).
"""

from __future__ import annotations

import torch

from .bitpack import CHUNK, packed_nbytes
from .triton_codes import _layout, _run, available, launch, triton

__all__ = ["PART_TILE", "REDUCE_TILE", "tiles", "encode_sampled", "bucket_maxima", "encode_buckets", "decode_buckets"]

PART_TILE = 4096
"""Values times buckets a program of the first kernel holds per block (its block is ``PART_TILE / 2**S`` values,
at least 16)."""

REDUCE_TILE = 8192
"""Partial results (rows times buckets) every program of the second kernel reduces, at most: it bounds the number
of programs of the first."""

if triton is not None:
    import triton.language as tl

    from .triton_codes import _CHUNK, _ROUND, _lanes, _pack, _unpack

    @triton.jit
    def _bucket_of(v, bounds_ptr, NB: tl.constexpr):
        """Each value's bucket: the number of the ``NB`` boundaries ``<= v`` (int32)."""
        b = tl.zeros(v.shape, tl.int32)
        for j in tl.static_range(NB):
            b += (v >= tl.load(bounds_ptr + j)).to(tl.int32)
        return b

    @triton.jit(do_not_specialize=["n"])
    def _bucket_maxima_kernel(x_ptr, bounds_ptr, part_ptr, n, NB: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        i = c * _CHUNK + tl.arange(0, _CHUNK)
        v = tl.load(x_ptr + i, mask=i < n, other=float("-inf"))
        b = _bucket_of(v, bounds_ptr, NB)
        for bb in tl.static_range(NB + 1):
            tl.store(part_ptr + c * (NB + 1) + bb, tl.max(tl.where(b == bb, v, float("-inf")), axis=0))

    @triton.jit(do_not_specialize=["n"])
    def _encode_buckets_kernel(x_ptr, bounds_ptr, mins_ptr, div_ptr, out_ptr, n, NB: tl.constexpr,
                               Q: tl.constexpr, K: tl.constexpr, R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        v = tl.load(x_ptr + _lanes(c, G))
        b = _bucket_of(v, bounds_ptr, NB)
        q = tl.math.div_rn(v - tl.load(mins_ptr + b), tl.load(div_ptr + b))
        q = tl.minimum(tl.maximum((q + _ROUND) - _ROUND, 0.0), (1 << Q) - 1.0)
        _pack(out_ptr, q.to(tl.int32) + (b << Q), c, n, K, R, G, W)

    @triton.jit(do_not_specialize=["n"])
    def _decode_buckets_kernel(packed_ptr, mins_ptr, step_ptr, y_ptr, n, Q: tl.constexpr,
                               K: tl.constexpr, R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        codes = _unpack(packed_ptr, c, n, K, R, G, W)
        b = codes >> Q
        level = (codes & ((1 << Q) - 1)).to(tl.float32)
        tl.store(y_ptr + _lanes(c, G), tl.load(mins_ptr + b) + level * tl.load(step_ptr + b))

    @triton.jit(do_not_specialize=["n", "m", "parts"])
    def _sampled_parts_kernel(x_ptr, s_ptr, part_ptr, n, m, parts, NB: tl.constexpr, NBP: tl.constexpr,
                              EB: tl.constexpr, ROUNDS: tl.constexpr):
        """Row ``p`` of the partial results (``NBP + 2`` floats): per bucket the max of program ``p``'s values in
        it (``-inf`` if none), then their min, then 1.0 if one was NaN."""
        p = tl.program_id(0)
        k = tl.arange(0, NBP)
        bounds = tl.load(s_ptr + ((k + 1) * m) // (NB + 1), mask=k < NB, other=0.0) + 0.0
        lo = tl.full((EB,), float("inf"), tl.float32)
        nan = tl.zeros((EB,), tl.int32)
        top = tl.full((NBP, EB), float("-inf"), tl.float32)
        for r in range(ROUNDS):
            i = (r * parts + p).to(tl.int64) * EB + tl.arange(0, EB)
            live = i < n
            v = tl.load(x_ptr + i, mask=live, other=0.0)
            b = tl.sum(((v[None, :] >= bounds[:, None]) & (k[:, None] < NB)).to(tl.int32), axis=0)
            top = tl.where((b[None, :] == k[:, None]) & live[None, :], tl.maximum(top, v[None, :]), top)
            lo = tl.where(live, tl.minimum(lo, v), lo)
            nan = tl.maximum(nan, (live & (v != v)).to(tl.int32))
        row = part_ptr + p * (NBP + 2)
        tl.store(row + k, tl.max(top, axis=1))
        tl.store(row + NBP, tl.min(lo, axis=0))
        tl.store(row + NBP + 1, tl.max(nan, axis=0).to(tl.float32))

    @triton.jit(do_not_specialize=["n", "m", "parts"])
    def _encode_sampled_kernel(x_ptr, s_ptr, part_ptr, grid_ptr, out_ptr, n, m, parts, NB: tl.constexpr,
                               NBP: tl.constexpr, PB: tl.constexpr, Q: tl.constexpr, K: tl.constexpr,
                               R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
        """The grid from the partial results, stored as ``[mins, step, div]`` (``NBP`` floats each), then chunk
        ``c``'s codes."""
        c = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, NBP)
        j = tl.arange(0, PB)
        rows = part_ptr + j * (NBP + 2)
        taken = j < parts
        top = tl.max(tl.load(rows[:, None] + k[None, :], mask=taken[:, None], other=float("-inf")), axis=0)
        lo = tl.min(tl.load(rows + NBP, mask=taken, other=float("inf")), axis=0) + 0.0
        nan = tl.max(tl.load(rows + NBP + 1, mask=taken, other=0.0), axis=0)
        below = tl.load(s_ptr + (k * m) // (NB + 1), mask=k > 0, other=0.0) + 0.0  # bucket k's min: boundary k - 1
        mins = tl.where(k == 0, lo, below)
        step = tl.math.div_rn(tl.maximum(mins, top) + 0.0 - mins, (1 << Q) - 1.0)
        step = tl.where(nan > 0, float("nan"), step)
        div = tl.where(step > 0, step, 1.0)
        tl.store(grid_ptr + k, mins)
        tl.store(grid_ptr + NBP + k, step)
        tl.store(grid_ptr + 2 * NBP + k, div)
        tl.debug_barrier()  # the grid this program's threads stored is read back below by others of them
        v = tl.load(x_ptr + _lanes(c, G))
        b = _bucket_of(v, grid_ptr + 1, NB)
        q = tl.math.div_rn(v - tl.load(grid_ptr + b), tl.load(grid_ptr + 2 * NBP + b))
        q = tl.minimum(tl.maximum((q + _ROUND) - _ROUND, 0.0), (1 << Q) - 1.0)
        _pack(out_ptr, q.to(tl.int32) + (b << Q), c, n, K, R, G, W)


def tiles(buckets: int) -> tuple[int, int]:
    """``(block, parts)``: the values a program of the first kernel takes per round (:data:`PART_TILE` over the
    ``buckets``, at least 16) and the most programs it runs (:data:`REDUCE_TILE` over the ``buckets``, at least
    one; a power of two, the second kernel's tile)."""
    return max(16, PART_TILE // buckets), max(1, REDUCE_TILE // buckets)


def encode_sampled(x: torch.Tensor, sample: torch.Tensor, quant_bits: int,
                   split_bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The grid and codes of a sampled split in two launches (module docstring).

    Args:
        x: 1-D float32 values, contiguous, on the GPU (or CPU under :func:`.triton_codes.run_on_cpu`), at least
            one whole :data:`.bitpack.CHUNK`.
        sample: float32 ``(m,)`` the sorted sample (:func:`.buckets.sample_positions` of ``x``), same device.
        quant_bits: Q, 1..16 with ``Q + S <= 16``; split_bits: S >= 1.

    Returns:
        ``(grid, out)``: float32 ``(3 * 2**S,)`` ``[mins, step, div]`` (``grid[:2 * 2**S]`` is the metadata
        sent, ``grid[1:2**S]`` the boundaries) and the uint8 code stream with its whole chunks written (the tail
        is the caller's); None where it does not apply (the caller runs the reference).
    """
    n, m, buckets = x.numel(), sample.numel(), 1 << split_bits
    if not (available(x) and n >= CHUNK and x.is_contiguous() and n < 2**31 - PART_TILE and sample.is_contiguous()):
        return None
    block, most = tiles(buckets)
    parts = min(most, -(-n // block))
    rounds = 1 << (-(-n // (parts * block)) - 1).bit_length()
    part = torch.empty(parts * (buckets + 2), dtype=torch.float32, device=x.device)
    grid = torch.empty(3 * buckets, dtype=torch.float32, device=x.device)
    out = torch.empty(packed_nbytes(n, quant_bits + split_bits), dtype=torch.uint8, device=x.device)
    nb = buckets - 1
    if not (launch("sampled_parts", _sampled_parts_kernel, (parts,), x, sample, part, n, m, parts, NB=nb,
                   NBP=buckets, EB=block, ROUNDS=rounds) and
            launch("encode_sampled", _encode_sampled_kernel, (n // CHUNK,), x, sample, part, grid, out, n, m, parts,
                   NB=nb, NBP=buckets, PB=most, Q=quant_bits, **_layout(quant_bits + split_bits))):
        return None
    return grid, out


def bucket_maxima(x: torch.Tensor, bounds: torch.Tensor, mins: torch.Tensor) -> torch.Tensor | None:
    """Per-bucket maxima of sort quantization on the GPU: ``max(mins[b], max of the values in bucket b)``
    with a zero as ``+0.0`` -- the reference's ``scatter_reduce`` over the buckets.

    Args:
        x: 1-D float32 values (finite, contiguous), on the GPU.
        bounds: float32 ``(2**S - 1,)`` boundaries; a value's bucket is the number of them ``<= x``.
        mins: float32 ``(2**S,)`` per-bucket mins (``bounds`` after the global min).

    Returns:
        float32 ``(2**S,)``, or None where it does not apply. One program per chunk writes its
        bucket maxima; their max over programs follows (torch), so the result does not depend
        on the order of the values.
    """
    chunks = -(-x.numel() // CHUNK)
    if not (available(x) and chunks and x.is_contiguous()):
        return None
    part = torch.empty(chunks, mins.numel(), dtype=torch.float32, device=x.device)
    if not launch("bucket_maxima", _bucket_maxima_kernel, (chunks,), x, bounds.contiguous(), part, x.numel(),
                   NB=bounds.numel()):
        return None
    return torch.maximum(mins, part.amax(0)) + 0.0


def encode_buckets(x: torch.Tensor, bounds: torch.Tensor, mins: torch.Tensor, div: torch.Tensor, quant_bits: int,
                   out: torch.Tensor) -> bool:
    """:func:`.compiled.encode_buckets` on the GPU: codes ``bucket * 2**Q + level`` of the whole chunks of ``x``.

    Args:
        x: 1-D float32 values (contiguous) on the GPU.
        bounds: float32 ``(2**S - 1,)``; mins, div: float32 ``(2**S,)``; on ``x``'s device.
        quant_bits: Q.
        out: uint8 stream of ``x.numel()`` codes of ``Q + S`` bits (tail left to the caller).

    Returns:
        True if done; False where it does not apply.
    """
    bits = quant_bits + (bounds.numel() + 1).bit_length() - 1
    return _run("encode_buckets", _encode_buckets_kernel, x, x, bounds.contiguous(), mins.contiguous(),
                div.contiguous(), out, x.numel(), NB=bounds.numel(), Q=quant_bits, **_layout(bits))


def decode_buckets(packed: torch.Tensor, quant_bits: int, mins: torch.Tensor, step: torch.Tensor,
                   y: torch.Tensor) -> bool:
    """:func:`.compiled.decode_buckets` on the GPU: ``y = mins[b] + level * step[b]`` for the whole chunks.

    Args:
        packed: uint8 stream of ``n = y.numel()`` codes of ``Q + S`` bits, on the GPU.
        quant_bits: Q.
        mins, step: float32 ``(2**S,)`` as sent, on the same device.
        y: float32 ``(n,)`` output (contiguous); values ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where it does not apply.
    """
    bits = quant_bits + mins.numel().bit_length() - 1
    return _run("decode_buckets", _decode_buckets_kernel, y, packed, mins.contiguous(), step.contiguous(), y, y.numel(),
                   Q=quant_bits, **_layout(bits))
