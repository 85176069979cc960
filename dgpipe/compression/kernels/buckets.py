"""Sort quantization's steps over one group: bucket boundaries and extrema, codes, values.

With ``S`` split bits and ``Q`` quant bits, the values are split into ``B = 2**S`` buckets of
(nearly) equal count by rank, and each bucket gets a uniform grid of ``2**Q`` levels from its
min to its max (:mod:`dgpipe.compression.codecs.sortquant` says why). Without sorting the
tensor:

1. :func:`bucket_grid`: the ``B - 1`` boundaries are order statistics of the values --
   exactly for small tensors, else of a fixed-seed uniform sample of :func:`sample_size`
   values -- read off the sorted sample (:func:`sort_sample`: a radix sort on CPU); a zero
   boundary is +0.0. Bucket ``i``'s min is boundary ``i`` (the global min for bucket 0),
   its max comes with the sort for small tensors, else from one pass over the values that
   also finds the global min (:func:`.compiled_grid.bucket_extrema`; on a GPU the Triton
   maxima; the reference a :class:`BucketIndex` and a ``scatter_reduce``). Then the steps.
   A small CPU message does all of it, and its codes, in one compiled call
   (:func:`.compiled_grid.sampled_grid`).
2. :func:`bucket_codes`: ``bucket * 2**Q + level`` per value, bit-packed; the bucket of
   ``x`` is the number of boundaries ``<= x``.
3. :func:`bucket_values`: ``mins[b] + level * step[b]``.

Every backend gives the same bytes (golden payloads).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import compiled, compiled_grid
from .backend import empty, enabled
from .dispatch import choose, kernels_of
from .bitpack import CHUNK, packed_nbytes, unpack_bits
from .uniform import (blocks, decode_table, encode_blocks, finite_range, grid_divisor, grid_levels, grid_step,
                      grid_table, pack_tail, range_of, tame, uniform_codes, uniform_values, values_tail)

__all__ = [
    "SAMPLE_MIN", "SAMPLE_PER_BUCKET", "SAMPLE_PER_BUCKET_SMALL", "SAMPLE_SEED", "sample_size", "sample_positions",
    "sort_sample", "BucketIndex", "BucketGrid", "bucket_ranges", "bucket_grid", "bucket_codes", "bucket_values",
]

SAMPLE_MIN = 1 << 14
"""Sample size above which only :data:`SAMPLE_PER_BUCKET` values per bucket are drawn."""
SAMPLE_PER_BUCKET = 64
"""Sampled values per bucket, when more than :data:`SAMPLE_MIN` in all."""
SAMPLE_PER_BUCKET_SMALL = 1 << 10
"""Sampled values per bucket of few buckets (up to :data:`SAMPLE_MIN` in all): a boundary's
rank is then off by about ``sqrt(B) / 64`` of a bucket (3% at B = 4), and the sort of the
sample, most of a small message's encode, is 4-8x shorter than at :data:`SAMPLE_MIN`."""

SAMPLE_SEED = 0x5EED
"""Seed of the sample positions: the same tensor always gets the same boundaries."""


def sample_size(n: int, buckets: int) -> int:
    """How many values the boundaries of ``n`` values in ``buckets`` buckets come from.

    ``m = max(64 * buckets, min(1024 * buckets, 16384))`` sampled positions (2,048 for 2
    buckets, 4,096 for 4, 16,384 for 16 to 256, then 64 per bucket) when ``n > 2 * m``,
    else all ``n`` values (the exact split).
    """
    m = max(SAMPLE_PER_BUCKET * buckets, min(SAMPLE_PER_BUCKET_SMALL * buckets, SAMPLE_MIN))
    return m if n > 2 * m else n


@functools.lru_cache(maxsize=64)
def sample_positions(n: int, m: int, device: torch.device) -> torch.Tensor:
    """The ``m`` sampled positions (int64, with repeats) in ``[0, n)``: ``torch.randint`` from a
    generator seeded with :data:`SAMPLE_SEED`, so the same for every tensor of ``n`` values;
    ascending, so that the gather of the sample reads memory in order (the sample is sorted
    anyway: the order of its positions changes nothing else; with cold caches a small message's
    random gather cost more than its sort); cached (a pipeline sends the same sizes step after
    step, and drawing them costs more than the rest of the sampling). Do not modify the
    returned tensor."""
    gen = torch.Generator(device=device)
    gen.manual_seed(SAMPLE_SEED)
    return torch.randint(n, (m,), generator=gen, device=device).sort().values


@functools.lru_cache(maxsize=64)
def _cpu_sample_positions(n: int, m: int) -> np.ndarray:
    """:func:`sample_positions` on CPU as a numpy array (cached: do not modify it)."""
    return sample_positions(n, m, torch.device("cpu")).numpy()


@functools.lru_cache(maxsize=64)
def _boundary_ranks(m: int, buckets: int) -> np.ndarray:
    """Ranks ``i * m // buckets``, ``i = 1 .. buckets - 1``, of the boundaries in a sorted sample of ``m`` (cached)."""
    return np.arange(1, buckets) * m // buckets


def sort_sample(x: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
    """``np.sort(x[positions])`` (or of all of ``x``): float32 ``(m,)`` ascending.

    A radix sort on CPU where the kernels are on (:func:`.compiled_grid.sort_sample`: 2-3x numpy's on
    the 2k-16k values of a boundary sample; equal value for value, only the order among equal values
    may differ: ``-0.0`` before ``+0.0``), else numpy's sort.
    """
    s = compiled_grid.sort_sample(x, positions) if enabled() else None
    return np.sort(x if positions is None else x[positions]) if s is None else s


class BucketIndex:
    """Bucket of every value: ``BucketIndex(boundaries)(x)`` is the number of boundaries ``<= x``.

    Built once per tensor, prepared on first use, applied block by block; whole-tensor steps,
    faster on CPU than ``torch.bucketize``: with up to 15 distinct boundaries, one
    compare-and-add per distinct boundary (weighted by its multiplicity); beyond, and off the CPU, a binary
    search of ``log2(len(boundaries) + 1)`` steps (gather the middle boundary of each value's
    range, compare, add).

    Args:
        boundaries: 1-D non-decreasing float32 of ``2**S - 1`` values, ``S >= 1``.
    """

    def __init__(self, boundaries: torch.Tensor) -> None:
        self.boundaries = boundaries

    @functools.cached_property
    def _compares(self) -> list[tuple[torch.Tensor, int]] | None:
        if not self.boundaries.is_cpu:  # counting the distinct boundaries would read them back: the search
            return None
        distinct, mult = torch.unique_consecutive(self.boundaries, return_counts=True)
        return list(zip(distinct, mult.tolist())) if distinct.numel() <= 15 else None

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """Buckets of the 1-D float32 ``flat``: int64, same shape."""
        if self._compares is not None:
            (t, k), *rest = self._compares
            count = torch.ge(flat, t, out=torch.empty_like(flat))
            if k > 1:
                count *= k
            ge = torch.empty_like(flat)
            for t, k in rest:
                count.add_(torch.ge(flat, t, out=ge), alpha=k)
            return count.to(torch.int32).to(torch.int64)  # via int32: faster on CPU
        bounds = self.boundaries
        half = (bounds.numel() + 1) // 2
        b = torch.ge(flat, bounds[half - 1]).to(torch.int32)
        b *= half
        t = torch.empty_like(flat)
        ge = torch.empty(flat.shape, dtype=torch.int32, device=flat.device)
        half //= 2
        while half:
            # b is a multiple of 2 * half; boundary b + half - 1 splits [b, b + 2 * half) in two.
            torch.index_select(bounds[half - 1 :], 0, b.to(torch.int64), out=t)
            b.add_(torch.ge(flat, t, out=ge), alpha=half)
            half //= 2
        return b.to(torch.int64)


class BucketGrid:
    """What :func:`bucket_grid` found for one group of ``n`` values.

    Attributes:
        bounds: float32 ``(2**S - 1,)`` non-decreasing boundaries, or None for ``S = 0``.
        mins: float32 ``(2**S,)`` per-bucket grid start ``(lo, *bounds)``.
        div: float32 ``(2**S,)`` per-bucket divisor (the step, or 1 where it is 0).
        meta: float32 ``(2 * 2**S,)``: ``cat(mins, step)``, the metadata sent.
        index: each value's bucket (uint8/int16 ``(n,)``) where the reference found the maxima with it;
            the codes step reuses it.
        packed: the code stream with its whole chunks written, where one compiled call coded them
            with the grid; the codes step adds the tail.
    """

    def __init__(self, bounds: torch.Tensor | None, mins: torch.Tensor, div: torch.Tensor, meta: torch.Tensor,
                 index: torch.Tensor | None = None, packed: torch.Tensor | None = None) -> None:
        self.bounds, self.mins, self.div, self.meta, self.index, self.packed = bounds, mins, div, meta, index, packed

    @classmethod
    def of_rows(cls, grid: np.ndarray, packed: torch.Tensor | None) -> "BucketGrid":
        """The grid of :func:`.compiled_grid.sampled_grid`'s float32 rows (mins, step, divisor); the tensors
        other than ``meta`` are made when first asked for (a small message coded in the same call needs
        only ``meta``: each tensor made costs a microsecond or two)."""
        made = cls.__new__(cls)
        made._rows, made.meta, made.index, made.packed = grid, torch.from_numpy(grid[:2].reshape(-1)), None, packed
        return made

    @functools.cached_property
    def bounds(self) -> torch.Tensor:
        return torch.from_numpy(self._rows[0, 1:])

    @functools.cached_property
    def mins(self) -> torch.Tensor:
        return torch.from_numpy(self._rows[0])

    @functools.cached_property
    def div(self) -> torch.Tensor:
        return torch.from_numpy(self._rows[2])


def _steps(mins: torch.Tensor, maxs: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(div, meta)`` of the per-bucket grids (float32 ``(B,)``); in numpy on CPU (the same float32
    operations at a fraction of torch's per-call cost: a small message's encode is mostly such calls)."""
    if not mins.is_cpu:
        step = grid_step(mins, maxs, levels)
        return grid_divisor(step), torch.cat((mins, step))
    lo, hi = mins.detach().numpy(), maxs.detach().numpy()
    step = grid_step(lo, hi, levels)
    return torch.from_numpy(grid_divisor(step)), torch.from_numpy(np.concatenate((lo, step)))


def _cpu_grid(flat: torch.Tensor, buckets: int, m: int, codec_name: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(bounds, mins, maxs)`` of a CPU tensor from a sample of ``m`` values, in numpy (the sample's
    radix sort or numpy's, and numpy's per-call cost is a fraction of torch's); ``maxs`` None where a
    sampled split's maxima are left to the reference."""
    n = flat.numel()
    xs = flat.detach().numpy()
    positions = None if m == n else _cpu_sample_positions(n, m)
    s = sort_sample(xs, positions)
    bounds = s[_boundary_ranks(m, buckets)] + np.float32(0.0)  # a zero as +0.0 (the sorts order zeros differently)
    if m < n:
        found = None
        if choose(flat) == "c":
            found = compiled_grid.bucket_extrema(xs, bounds)
        if found is None:
            lo, _ = range_of(flat, codec_name)
            bounds_t = torch.from_numpy(bounds)
            return bounds_t, torch.cat((lo.view(1), bounds_t)), None
        lo, maxs = found
        top = maxs[-1]
    else:  # the whole tensor sorted: NaN last, so an inf or NaN is at an end
        lo, top = s[0], s[-1]
        # bucket i's max: the largest value below the next boundary (or the top), if the bucket is not empty
        maxs = np.append(s[np.maximum(np.searchsorted(s, bounds) - 1, 0)], top)
    lo = lo + np.float32(0.0)  # -0.0 -> +0.0: which zero a min keeps depends on the order of the values
    if not tame(lo, top):
        finite_range(torch.tensor(lo), torch.tensor(top), codec_name)  # raises if the range is not finite
    mins = np.empty(buckets, np.float32)
    mins[0], mins[1:] = lo, bounds
    if m == n:
        maxs = np.where(np.append(bounds, top) > mins, maxs, mins)
    return torch.from_numpy(bounds), torch.from_numpy(mins), torch.from_numpy(np.maximum(maxs, mins) + np.float32(0.0))


def _torch_grid(flat: torch.Tensor, buckets: int, m: int, codec_name: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`_cpu_grid` in torch ops, for tensors on other devices."""
    n = flat.numel()
    sample = flat if m == n else flat.index_select(0, sample_positions(n, m, flat.device))
    s = torch.sort(sample).values
    bounds = s[torch.arange(1, buckets, device=flat.device) * m // buckets] + 0.0  # a zero as +0.0
    below = s[torch.searchsorted(s, bounds).sub_(1).clamp_(min=0)]  # the largest sampled value below each boundary
    lo, hi = range_of(flat, codec_name)
    mins = torch.cat((lo.view(1), bounds))
    if m < n:
        return bounds, mins, None
    # bucket i's max: the largest value below the next boundary (or hi), if the bucket is not empty
    uppers = torch.cat((bounds, hi.view(1)))
    return bounds, mins, torch.where(uppers > mins, torch.cat((below, hi.view(1))), mins) + 0.0


def bucket_ranges(flat: torch.Tensor, buckets: int, codec_name: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Boundaries and per-bucket ranges of ``flat`` split into ``buckets`` equal-count buckets.

    Args:
        flat: 1-D float32 values, ``n >= 1``, any device.
        buckets: a power of two >= 2.
        codec_name: for the error message.

    Returns:
        ``(bounds, mins, maxs)``. ``bounds``: the ``buckets - 1`` non-decreasing lower boundaries of
        buckets ``1 ..``: ``s[(i * m) // buckets]``, ``s`` the sorted :func:`sample_size` values (each a
        value of ``flat``). ``mins``: per-bucket min, ``(lo, *bounds)`` with ``lo`` the min of ``flat``.
        ``maxs``: per-bucket max (= min for an empty bucket; a zero as ``+0.0``) when the split is exact
        or a sampled split's compiled pass found it (:func:`.compiled_grid.bucket_extrema`), else None.

    Raises:
        ValueError: ``flat`` holds inf or NaN (:func:`.uniform.finite_range`).
    """
    m = sample_size(flat.numel(), buckets)
    return (_cpu_grid if flat.is_cpu else _torch_grid)(flat, buckets, m, codec_name)


def _one_call(flat: torch.Tensor, buckets: int, quant_bits: int, codec_name: str, pack: bool) -> BucketGrid | None:
    """The grid (and with ``pack`` the whole chunks' codes) of a sampled split in one compiled call
    (:func:`.compiled_grid.sampled_grid`), or None where that does not apply."""
    n = flat.numel()
    m = sample_size(n, buckets)
    if m == n or choose(flat) != "c":
        return None
    result = compiled_grid.sampled_grid(flat.detach().numpy(), _cpu_sample_positions(n, m),
                                        _boundary_ranks(m, buckets), quant_bits, pack)
    if result is None:
        return None
    grid, packed = result
    if not tame(*grid[3, :2].tolist()):  # the min and max of flat: raises if the range is not finite
        finite_range(torch.from_numpy(grid[3, :1].copy()), torch.from_numpy(grid[3, 1:2].copy()), codec_name)
    return BucketGrid.of_rows(grid, None if packed is None else torch.from_numpy(packed))


def _two_launches(flat: torch.Tensor, split_bits: int, quant_bits: int) -> BucketGrid | None:
    """The grid and the whole chunks' codes of a sampled split on a GPU: the sample gathered and sorted (torch),
    then two Triton launches that read nothing back (:func:`.triton_buckets.encode_sampled`); None where that
    does not apply."""
    n, buckets = flat.numel(), 1 << split_bits
    m = sample_size(n, buckets)
    if m == n or choose(flat) != "triton" or not flat.is_contiguous():
        return None
    sample = torch.sort(flat.index_select(0, sample_positions(n, m, flat.device))).values
    done = kernels_of("triton", "buckets").encode_sampled(flat, sample, quant_bits, split_bits)
    if done is None:
        return None
    grid, packed = done
    return BucketGrid(grid[1:buckets], grid[:buckets], grid[2 * buckets:], grid[:2 * buckets], packed=packed)


def bucket_grid(flat: torch.Tensor, split_bits: int, quant_bits: int, codec_name: str,
                codes: bool = True) -> BucketGrid:
    """Boundaries, per-bucket grids and metadata of the values ``flat`` (module docstring, step 1).

    Args:
        flat: 1-D float32 values, ``n >= 1``, any device.
        split_bits: S, ``2**S`` buckets (0: one bucket, the plain range).
        quant_bits: Q, ``2**Q`` levels per bucket.
        codec_name: for the error message.
        codes: the codes will be rounded to nearest (not stochastic), so a compiled call that
            finds the grid may code the whole chunks too (:attr:`BucketGrid.packed`).

    Raises:
        ValueError: ``flat`` holds inf or NaN, or its range overflows float32.
    """
    levels, buckets = 1 << quant_bits, 1 << split_bits
    if split_bits == 0:
        lo, hi = range_of(flat, codec_name)
        mins = lo.view(1)
        return BucketGrid(None, mins, *_steps(mins, hi.view(1), levels))
    grid = _one_call(flat, buckets, quant_bits, codec_name, codes)
    if grid is not None:
        return grid
    grid = _two_launches(flat, split_bits, quant_bits) if codes else None
    if grid is not None:
        return grid
    bounds, mins, maxs = bucket_ranges(flat, buckets, codec_name)
    index = None
    if maxs is None and choose(flat) == "triton":  # a sampled split on a GPU: the maxima in one kernel
        maxs = kernels_of("triton", "buckets").bucket_maxima(flat, bounds, mins)
    if maxs is None:  # the reference: the maxima (and the buckets, which the codes reuse)
        search = BucketIndex(bounds)
        index = torch.empty(flat.numel(), dtype=torch.uint8 if split_bits <= 8 else torch.int16, device=flat.device)
        maxs = mins.clone()
        for i, j in blocks(flat):
            b = search(flat[i:j])
            index[i:j] = b
            maxs.scatter_reduce_(0, b, flat[i:j], "amax")
        maxs += 0.0  # -0.0 -> +0.0: which zero a max keeps depends on the order of the values
    return BucketGrid(bounds, mins, *_steps(mins, maxs, levels), index=index)


def _codes_of(flat: torch.Tensor, grid: BucketGrid, quant_bits: int, stochastic: bool):
    """``codes_of(i, j)``: the int32 codes ``bucket * 2**Q + level`` of ``flat[i:j]`` (the reference)."""
    search = None if grid.bounds is None or grid.index is not None else BucketIndex(grid.bounds)
    levels = 1 << quant_bits

    def codes_of(i: int, j: int) -> torch.Tensor:
        x = flat[i:j]
        bucket = grid.index[i:j].long() if grid.index is not None else search(x) if search is not None else None
        if bucket is None:
            return grid_levels(x - grid.mins, grid.div, levels, stochastic).to(torch.int32)
        w = grid.mins.index_select(0, bucket)
        torch.sub(x, w, out=w)
        codes = grid_levels(w, grid.div.index_select(0, bucket), levels, stochastic).to(torch.int32)
        return codes.add_(bucket.to(torch.int32), alpha=levels)

    return codes_of


def bucket_codes(flat: torch.Tensor, grid: BucketGrid, quant_bits: int, split_bits: int,
                 stochastic: bool = False) -> torch.Tensor:
    """Packed codes ``bucket * 2**Q + level`` (``S + Q`` bits) of ``flat`` on ``grid`` (step 2).

    Returns:
        uint8 ``(ceil(n * (S + Q) / 8),)`` on ``flat``'s device.
    """
    n, bits = flat.numel(), quant_bits + split_bits
    if grid.packed is not None and n % CHUNK == 0:  # one call coded it all: a small message's usual case
        return grid.packed
    codes_of = _codes_of(flat, grid, quant_bits, stochastic)
    if grid.packed is not None:
        return pack_tail(grid.packed, n, bits, lambda start: codes_of(start, n))
    if grid.bounds is None:
        return uniform_codes(flat, grid.mins, grid.div, quant_bits, n, stochastic)
    backend = "torch" if stochastic else choose(flat)
    if backend != "torch":
        out = empty(packed_nbytes(n, bits), torch.uint8, flat)
        if kernels_of(backend, "buckets").encode_buckets(flat, grid.bounds, grid.mins, grid.div, quant_bits, out):
            return pack_tail(out, n, bits, lambda start: codes_of(start, n))
    return encode_blocks(flat, bits, codes_of)


def bucket_values(packed: torch.Tensor, quant_bits: int, split_bits: int, n: int, meta: torch.Tensor) -> torch.Tensor:
    """Decoded values ``mins[b] + level * step[b]`` of ``n >= 1`` codes of one group (step 3).

    Args:
        packed: uint8 stream of ``n`` codes of ``Q + S`` bits.
        meta: ``cat(mins, step)`` as sent, ``2 * 2**S`` values (computed in float32).

    Returns:
        float32 ``(n,)`` on ``packed``'s device.
    """
    if split_bits == 0:
        return uniform_values(packed, quant_bits, n, meta, 1, n)
    backend = choose(packed, n)
    if backend == "c":  # a small message in one call, where that applies
        y = compiled.message_values(packed, quant_bits, split_bits, meta, n)
        if y is not None:
            return y
    buckets = 1 << split_bits
    mins, step = meta[:buckets].float(), meta[buckets:].float()
    if backend != "torch":
        y = empty(n, torch.float32, packed)
        if kernels_of(backend, "buckets").decode_buckets(packed, quant_bits, mins, step, y):
            table = grid_table(mins, step, 1 << quant_bits)
            return values_tail(y, lambda start: table[unpack_bits(packed, quant_bits + split_bits, n, start=start)])
    return decode_table(packed, quant_bits + split_bits, n, grid_table(mins, step, 1 << quant_bits))
