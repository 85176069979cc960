"""Sort quantization (codec ``sortquant``): equal-count buckets by rank, a uniform grid in each.

With ``split_bits`` S and ``quant_bits`` Q, the ``n`` values are split into ``B = 2**S``
buckets of (nearly) equal count by rank -- bucket ``i`` holds the values between the
``i/B`` and ``(i+1)/B`` quantiles -- and each bucket is quantized uniformly with
``L = 2**Q`` levels between its min and max. A value is sent as the code
``bucket * L + level`` in ``S + Q`` bits (bit-packed, :mod:`.bitpack`); a bucket as its
min and step (float32). Dense regions of the distribution get narrow buckets and fine
steps, sparse tails wide buckets and coarse steps: every equal share of the values gets
the same number of levels. In mean squared error it can lose to uniform quantization
at equal bits (``benchmarks/codec_speed.py`` prints both).

The original formulation sorts the whole tensor and loops over the ``B`` chunks of the
sorted values. This one never sorts the tensor (above :func:`sample_size` values) and
has no Python loop over buckets or values:

1. the ``B - 1`` boundaries ``b_1 <= ... <= b_{B-1}`` are order statistics of the
   tensor -- exactly for small tensors, else of a fixed-seed uniform sample of
   :func:`sample_size` values (1,024 per bucket up to 16,384, then 64 per bucket: the
   MSE stays within a few percent of the exact split's, above or below it;
   ``benchmarks/codec_speed.py`` measures it), read off the sorted sample (on CPU a
   radix sort, :func:`.fused.sort_sample`, else numpy's sort); a zero boundary is +0.0
   (a small message's whole grid and its codes come from one compiled call,
   :func:`.fused.sampled_grid`, and its decode from another, :func:`.fused.message_values`);
2. the bucket of ``x`` is the number of boundaries ``<= x`` (:class:`BucketIndex`);
3. bucket ``i``'s min is ``b_i`` itself (a value of the tensor, and the smallest one in
   the bucket; the global min for bucket 0); its max comes with the sort for small
   tensors, else from one pass over the values that also finds the global min
   (:func:`.fused.bucket_extrema`, or eager ``torch.aminmax`` and one ``scatter_reduce``
   over the bucket indices); a zero min or max is sent as +0.0;
4. levels, codes and bit-packing run in one compiled loop on CPU (:mod:`.fused`, up to
   16 buckets), else block by block (:func:`.quantize.blocks`: cache-sized blocks on
   CPU, the whole tensor on a GPU); decoding is a lookup in the ``B * L``-entry table
   of grid values (or its fused equivalent).

On distinct values this gives exactly the codes of the original formulation (tested).

Ties: values equal to a boundary all go to the upper bucket, so with many equal values
(e.g. the zeros of a ReLU) the counts are unequal and some buckets stay empty (min =
max = their boundary, step 0); every value is still within half a step of its
bucket's grid. Decoding, re-encoding and decoding again gives the decoded tensor back
(to float rounding; tested): the decoded values keep their order, and each boundary
is a bucket min, which decodes to itself.

Reference: the sort-quantization scheme this project is built around (DESIGN.md);
uniform quantization within buckets as in :mod:`.quantize`.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from . import fused
from .base import Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from .bitpack import CHUNK, pack_bits, packed_nbytes, unpack_bits
from .grouping import Grouping
from .quantize import (
    GROUP_PARAM,
    blocks,
    decode_table,
    encode_blocks,
    finite_range,
    tame,
    flat_float32,
    grid_divisor,
    grid_levels,
    grid_step,
    grid_meta,
    grid_table,
    fused_decode,
    fused_encode,
    fused_uniform_decode,
    fused_uniform_encode,
    grouping_options,
    pack_tail,
)

__all__ = [
    "SortQuantizer", "sample_size", "sample_positions", "bucket_grid", "range_of", "BucketIndex", "bucket_codes",
    "group_buckets", "fused_bucket_values",
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


def bucket_grid(
    flat: torch.Tensor, buckets: int, codec_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Boundaries and per-bucket ranges of ``flat`` split into ``buckets`` equal-count buckets.

    Args:
        flat: 1-D float32 values, ``n >= 1``, any device.
        buckets: a power of two >= 2.
        codec_name: for the error message.

    Returns:
        ``(bounds, mins, maxs)``. ``bounds``: the
        ``buckets - 1`` non-decreasing lower boundaries of buckets ``1 ..``:
        ``s[(i * m) // buckets]``, ``s`` the sorted :func:`sample_size` values (each a value
        of ``flat``). ``mins``: per-bucket min, ``(lo, *bounds)`` with ``lo`` the min of
        ``flat`` (exact: ``bounds[i-1]`` is the smallest value of bucket ``i``, unless that
        is empty). ``maxs``: per-bucket max (= min for an empty bucket; a zero as ``+0.0``)
        when the split is exact (``s`` is all of ``flat``) or a sampled split's one pass
        found it (:func:`.fused.bucket_extrema`, which also gives ``lo``), else
        None (the caller finds it from the buckets).

    Raises:
        ValueError: ``flat`` holds inf or NaN (:func:`.quantize.finite_range`).
    """
    n = flat.numel()
    m = sample_size(n, buckets)
    if flat.is_cpu:
        return _cpu_bucket_grid(flat, buckets, m, codec_name)
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


@functools.lru_cache(maxsize=64)
def _cpu_sample_positions(n: int, m: int) -> np.ndarray:
    """:func:`sample_positions` on CPU as a numpy array (cached: do not modify it)."""
    return sample_positions(n, m, torch.device("cpu")).numpy()


@functools.lru_cache(maxsize=64)
def _boundary_ranks(m: int, buckets: int) -> np.ndarray:
    """Ranks ``i * m // buckets``, ``i = 1 .. buckets - 1``, of the boundaries in a sorted sample of ``m`` (cached)."""
    return np.arange(1, buckets) * m // buckets


def _cpu_bucket_grid(
    flat: torch.Tensor, buckets: int, m: int, codec_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`bucket_grid` of a CPU tensor from a sample of ``m`` values, with the same results as
    the torch steps, in numpy: the sample's radix sort (or numpy's) is several times torch's and
    robust to ties, and a small message's encode is mostly per-call overhead, of which numpy's is
    a fraction of torch's."""
    n = flat.numel()
    xs = flat.detach().numpy()
    positions = None if m == n else _cpu_sample_positions(n, m)
    s = fused.sort_sample(xs, positions)  # a radix sort, 2-3x numpy's here
    if s is None:
        s = np.sort(xs if positions is None else xs[positions])
    bounds = s[_boundary_ranks(m, buckets)] + np.float32(0.0)  # a zero as +0.0 (the sorts order zeros differently)
    below = s[np.maximum(np.searchsorted(s, bounds) - 1, 0)]  # the largest sampled value below each boundary
    if m < n:
        found = fused.bucket_extrema(xs, bounds, np.where(below < bounds, below, np.float32(-np.inf)), s[0], s[-1])
        if found is None:
            lo, _ = range_of(flat, codec_name)
            bounds_t = torch.from_numpy(bounds)
            return bounds_t, torch.cat((lo.view(1), bounds_t)), None
        lo, maxs = found
        top = maxs[-1]
    else:  # the whole tensor sorted: NaN last, so an inf or NaN is at an end
        lo, top = s[0], s[-1]
        # bucket i's max: the largest value below the next boundary (or the top), if the bucket is not empty
        maxs = np.append(below, top)
    lo = lo + np.float32(0.0)  # -0.0 -> +0.0: which zero a min keeps depends on the order of the values
    if not tame(lo, top):
        finite_range(torch.tensor(lo), torch.tensor(top), codec_name)  # raises if the range is not finite
    mins = np.empty(buckets, np.float32)
    mins[0], mins[1:] = lo, bounds
    if m == n:
        maxs = np.where(np.append(bounds, top) > mins, maxs, mins)
    return torch.from_numpy(bounds), torch.from_numpy(mins), torch.from_numpy(np.maximum(maxs, mins) + np.float32(0.0))


def range_of(flat: torch.Tensor, codec_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``: 0-d float32 min (a zero as ``+0.0``) and max of the 1-D float32 ``flat``, ``n >= 1``.

    Raises:
        ValueError: ``flat`` holds inf or NaN (:func:`.quantize.finite_range`).
    """
    lo, hi = torch.aminmax(flat)
    finite_range(lo, hi, codec_name)
    return lo + 0.0, hi


class BucketIndex:
    """Bucket of every value: ``BucketIndex(boundaries)(x)`` is the number of boundaries ``<= x``.

    Built once per tensor, prepared on first use (the fused kernels need none), applied
    block by block; whole-tensor steps, faster on CPU
    than ``torch.bucketize``: with up to 15 distinct boundaries, one compare-and-add
    per distinct boundary (weighted by its multiplicity); beyond, a binary search of
    ``log2(len(boundaries) + 1)`` steps (gather the middle boundary of each value's
    range, compare, add).

    Args:
        boundaries: 1-D non-decreasing float32 of ``2**S - 1`` values, ``S >= 1``.
    """

    def __init__(self, boundaries: torch.Tensor) -> None:
        self.boundaries = boundaries

    @functools.cached_property
    def _compares(self) -> list[tuple[torch.Tensor, int]] | None:
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


def bucket_codes(
    x: torch.Tensor, bucket: torch.Tensor | None, mins: torch.Tensor, div: torch.Tensor, levels: int, stochastic: bool
) -> torch.Tensor:
    """Codes ``bucket * levels + level`` of the values ``x`` (1-D float32), as int32.

    Args:
        x: values within their buckets' ranges.
        bucket: int64 bucket of each value (:class:`BucketIndex`), or None for one bucket.
        mins, div: per-bucket grid start and step (:func:`.quantize.grid_divisor`).
        levels: levels per bucket, ``2**quant_bits``.
        stochastic: stochastic rounding.
    """
    if bucket is None:
        return grid_levels(x - mins, div, levels, stochastic).to(torch.int32)
    w = mins.index_select(0, bucket)
    torch.sub(x, w, out=w)
    codes = grid_levels(w, div.index_select(0, bucket), levels, stochastic).to(torch.int32)
    return codes.add_(bucket.to(torch.int32), alpha=levels)


def _fused_sampled_grid(
    flat: torch.Tensor, buckets: int, quant_bits: int, codec_name: str, pack: bool
) -> tuple[np.ndarray, torch.Tensor | None] | None:
    """``(grid, packed)`` of a sampled split from :func:`.fused.sampled_grid`: one compiled call for a
    CPU tensor whose kernels run on one thread. ``grid``: float32 ``(4, 2**S)``, rows ``mins``,
    ``step`` (rows 0-1: the metadata sent) and divisor, the values of :func:`_cpu_bucket_grid` and
    :func:`_bucket_steps` (the boundaries are ``mins[1:]``). ``packed``: with ``pack``, the uint8
    code stream with its whole chunks written in the same call (the tail left to the caller),
    else None. None where the call does not apply.

    Raises:
        ValueError: ``flat`` holds inf or NaN (:func:`.quantize.finite_range`).
    """
    n = flat.numel()
    m = sample_size(n, buckets)
    if not flat.is_cpu or m == n or fused.gpu_kernels(flat) is not None:
        return None
    result = fused.sampled_grid(flat.detach().numpy(), _cpu_sample_positions(n, m), _boundary_ranks(m, buckets),
                                quant_bits, pack)
    if result is None:
        return None
    grid, packed = result
    if not tame(*grid[3, :2].tolist()):  # the min and max of flat: raises if the range is not finite
        finite_range(torch.from_numpy(grid[3, :1].copy()), torch.from_numpy(grid[3, 1:2].copy()), codec_name)
    return grid, None if packed is None else torch.from_numpy(packed)


def _bucket_steps(mins: torch.Tensor, maxs: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(div, meta)`` of the per-bucket grids (float32 ``(B,)``): the step's divisor
    (:func:`.quantize.grid_divisor`) and the metadata sent, ``cat(mins, step)``; in numpy on CPU
    (the same float32 operations at a fraction of torch's per-call cost: a small message's encode
    is mostly such calls)."""
    if not mins.is_cpu:
        step = grid_step(mins, maxs, levels)
        return grid_divisor(step), torch.cat((mins, step))
    lo, hi = mins.detach().numpy(), maxs.detach().numpy()
    step = grid_step(lo, hi, levels)
    return torch.from_numpy(grid_divisor(step)), torch.from_numpy(np.concatenate((lo, step)))


def group_buckets(g: int, buckets: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equal-count buckets of the ranks ``0 .. g-1`` of a group of ``g`` values.

    Returns:
        ``(bucket_of_rank, first, last)``: int64 ``(g,)`` bucket ``r * buckets // g`` of
        rank ``r``; int64 ``(buckets,)`` first and last rank of each bucket (clamped into
        ``[0, g)``; a bucket is empty when ``first > last``, which happens when ``g < buckets``).
    """
    b = torch.arange(buckets, device=device)
    first = (b * g + buckets - 1) // buckets
    last = ((b + 1) * g + buckets - 1) // buckets - 1
    return torch.arange(g, device=device) * buckets // g, first.clamp(max=g - 1), last.clamp(min=0)


def fused_bucket_values(
    packed: torch.Tensor, quant_bits: int, split_bits: int, n: int, mins: torch.Tensor, step: torch.Tensor
) -> torch.Tensor | None:
    """The ``n`` decoded values (1-D float32) of one group's codes from :mod:`.fused`, or None.

    ``mins``/``step``: float32 ``(2**S,)`` as sent. Whole chunks come from the fused
    kernel, the tail from the table of :func:`.quantize.grid_table`: the values are
    those of :func:`.quantize.decode_table`.
    """
    if split_bits == 0:
        return fused_uniform_decode(packed, quant_bits, n, mins, step, n)

    def tail(start: int) -> torch.Tensor:
        return grid_table(mins, step, 1 << quant_bits)[unpack_bits(packed, quant_bits + split_bits, n, start=start)]

    return fused_decode(packed, n, lambda y: fused.decode_buckets(packed, quant_bits, mins, step, y), tail)


@register_codec("sortquant", 4)
class SortQuantizer(Codec):
    """Sort quantization: ``2**split_bits`` equal-count buckets, ``2**quant_bits`` levels in each.

    Args:
        quant_bits: Q, bits of the level within a bucket, >= 1.
        split_bits: S, bits of the bucket index, >= 0 (0: plain uniform quantization);
            ``S + Q <= 16``. The original default ratio is Q:S = 3:1 (12+4, 9+3, 6+2, 3+1).
        stochastic: unbiased stochastic rounding within the bucket (error < one step)
            instead of rounding to nearest (error <= half a step).
        group, group_size, axis, rotate, scale_dtype: as for ``quant``
            (:class:`.quantize.UniformQuantizer`, :mod:`.grouping`). With a group other
            than ``tensor``, buckets are by rank **inside each group** (each group is
            sorted; bucket ``i`` holds its ranks ``[i*g/B, (i+1)*g/B)``, ties split by
            the sort), with a min and step per group and bucket; with ``group="tensor"``
            and a rotation or a narrow ``scale_dtype``, buckets are by rank over the
            whole (rotated) tensor, found by a full sort. The default (tensor, no
            rotation, float32) is the sampled-boundary formulation above.

    Input: a floating tensor (float32/float16/bfloat16/float64), any shape, contiguous
    or not, any device; computed in float32. Decode returns the original shape, dtype
    and device. Empty and 0-d tensors work; so do tensors with fewer values than buckets
    (the unused buckets are empty).

    Wire (exact, tested)::

        nbytes = ceil(n_sent * (S + Q) / 8) + n_groups * 2**S * 2 * sizeof(scale_dtype) + header bytes

    (codes bit-packed at S + Q bits; per group and bucket min and step; ``n_sent`` and
    ``n_groups`` as for ``quant``).

    Raises (encode):
        ValueError: non-floating input, inf/NaN values (policy in :mod:`.quantize`), or
            a range overflowing float32.
    """

    def __init__(self, quant_bits: int = 6, split_bits: int = 2, stochastic: bool = False, group: str = "tensor",
                 group_size: int = 0, axis: int = -1, rotate: str = "none", scale_dtype: str = "float32") -> None:
        for name, v, lo in (("quant_bits", quant_bits, 1), ("split_bits", split_bits, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 16:
                raise ValueError(f"sortquant: {name} must be an int in [{lo}, 16], got {v!r}")
        if quant_bits + split_bits > 16:
            raise ValueError(f"sortquant: quant_bits + split_bits must be <= 16, got {quant_bits} + {split_bits}")
        self.quant_bits, self.split_bits, self.stochastic = quant_bits, split_bits, bool(stochastic)
        self.grouping = grouping_options(self.name, group, group_size, axis, rotate, scale_dtype)

    def _encode_groups(self, flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed codes and ``cat(mins, steps)`` (each ``(n_groups, 2**S)``) of a non-empty tensor, bucketed per group."""
        gp, q, s = self.grouping, self.quant_bits, self.split_bits
        rows = gp.rows(flat.view(shape))
        ng, g = rows.shape
        ranked, order = torch.sort(rows, dim=1)
        bucket, first, last = group_buckets(g, 1 << s, rows.device)
        mins, maxs = ranked[:, first], ranked[:, last]
        maxs = torch.where(first <= last, maxs, mins)  # an empty bucket: min = max
        finite_range(mins, maxs, self.name)
        meta, lo32, div = grid_meta(mins, maxs, 1 << q, gp, self.name)
        levels = grid_levels(ranked - lo32[:, bucket], div[:, bucket], 1 << q, self.stochastic)
        ranked_codes = levels.to(torch.int32).add_(bucket.to(torch.int32) << q)
        codes = torch.empty_like(ranked_codes).scatter_(1, order, ranked_codes)
        return pack_bits(gp.sent(codes, shape), q + s, check=False), meta

    def _grid(self, flat: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor | None]:
        """``(bounds, mins, div, meta, index)`` of a plain (ungrouped) non-empty tensor, step by step:
        :func:`bucket_grid` (or the range, for one bucket), the maxima of a sampled split (a GPU kernel,
        else eager, which also keeps each value's bucket as ``index`` for the codes), the steps."""
        s, levels, index = self.split_bits, 1 << self.quant_bits, None
        if s == 0:
            lo, hi = range_of(flat, self.name)
            bounds, mins, maxs = None, lo.view(1), hi.view(1)
        else:
            bounds, mins, maxs = bucket_grid(flat, 1 << s, self.name)
        if maxs is None:  # sampled split on a GPU: the maxima in one kernel
            maxs = fused.bucket_maxima(flat, bounds, mins)
        if maxs is None:  # sampled split, no fused pass: the maxima (and the buckets) eager
            search = BucketIndex(bounds)
            index = torch.empty(flat.numel(), dtype=torch.uint8 if s <= 8 else torch.int16, device=flat.device)
            maxs = mins.clone()
            for i, j in blocks(flat):
                b = search(flat[i:j])
                index[i:j] = b
                maxs.scatter_reduce_(0, b, flat[i:j], "amax")
            maxs += 0.0  # -0.0 -> +0.0: which zero a max keeps depends on the order of the values
        return (bounds, mins, *_bucket_steps(mins, maxs, levels), index)

    def _fused_codes(self, flat: torch.Tensor, bounds: torch.Tensor | None, mins: torch.Tensor, div: torch.Tensor,
                     codes_of: Callable[[int, int], torch.Tensor]) -> torch.Tensor | None:
        """Packed codes of the plain formulation from :mod:`.fused` (the tail from ``codes_of``), or None."""
        q, s, n = self.quant_bits, self.split_bits, flat.numel()
        if bounds is None:
            return fused_uniform_encode(flat, mins, div, q, n)
        return fused_encode(flat, q + s, lambda out: fused.encode_buckets(flat, bounds, mins, div, q, out),
                            lambda start: codes_of(start, n))

    def _encode_steps(self, flat: torch.Tensor, grid: np.ndarray | None,
                      packed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, meta)`` of a plain non-empty tensor, from the one-call ``grid`` of
        :func:`_fused_sampled_grid` (and its ``packed`` whole chunks, if it coded them) or else step by step
        (:meth:`_grid`); the codes of what is not yet packed from the fused kernels, or eager."""
        q, s, n = self.quant_bits, self.split_bits, flat.numel()
        if grid is not None:
            g = torch.from_numpy(grid)
            bounds, mins, div, meta, index = g[0, 1:], g[0], g[2], g[:2].reshape(-1), None
        else:
            bounds, mins, div, meta, index = self._grid(flat)
        search = None if bounds is None else BucketIndex(bounds)

        def codes_of(i: int, j: int) -> torch.Tensor:
            if search is None:
                b = None
            else:
                b = search(flat[i:j]) if index is None else index[i:j].long()
            return bucket_codes(flat[i:j], b, mins, div, 1 << q, self.stochastic)

        if packed is not None:
            packed = pack_tail(packed, n, q + s, lambda start: codes_of(start, n))
        elif not self.stochastic:
            packed = self._fused_codes(flat, bounds, mins, div, codes_of)
        if packed is None:
            packed = encode_blocks(flat, q + s, codes_of)
        return packed, meta

    def encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x, self.name)
        q, s = self.quant_bits, self.split_bits
        n, buckets = flat.numel(), 1 << s
        params = (q, s, self.grouping.param(x.dim()))
        if not self.grouping.plain:
            if n == 0:
                packed, meta = flat.to(torch.uint8), flat.to(self.grouping.meta_dtype)
            else:
                packed, meta = self._encode_groups(flat, tuple(x.shape))
            return make_payload(self.codec_id, x.dtype, x.shape, params, (packed, meta))
        if n == 0:
            meta = torch.zeros(2 * buckets, device=flat.device)
            packed = flat.to(torch.uint8)
        else:
            fast = _fused_sampled_grid(flat, buckets, q, self.name, not self.stochastic) if s else None
            grid, packed = fast if fast is not None else (None, None)
            if packed is not None and n % CHUNK == 0:  # one call coded it all: a small message's usual case
                meta = torch.from_numpy(grid[:2].reshape(-1))
            else:
                packed, meta = self._encode_steps(flat, grid, packed)
        return make_payload(self.codec_id, x.dtype, x.shape, params, (packed, meta))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        q, s, group_param = check_params(h, ("quant_bits", 1, 16), ("split_bits", 0, 15), GROUP_PARAM)
        if q + s > 16:
            raise ValueError(f"corrupt header: fields 'params' (quant_bits + split_bits) = {q} + {s} > 16")
        gp = Grouping.from_param(group_param, h.shape, self.name)
        ng, _, n_sent = gp.counts(h.shape)
        if gp.plain:
            ng = 1  # the sampled formulation sends its bucket parameters even for an empty tensor
        buckets = 1 << s
        check_tensor_specs(h, ("codes", torch.uint8, packed_nbytes(n_sent, q + s)),
                           ("min/step", gp.meta_dtype, 2 * ng * buckets))
        packed, meta = payload.tensors
        if n_sent == 0:
            return meta.new_zeros(h.shape, dtype=h.dtype)
        values = fused.message_values(packed, q, s, meta, n_sent) if ng == 1 else None  # one call
        if values is None:  # step by step
            m = ng * buckets
            mins, steps = meta[:m].float(), meta[m:].float()
            values = fused_bucket_values(packed, q, s, n_sent, mins, steps) if ng == 1 else None
        if values is None:
            tables = grid_table(mins, steps, 1 << q).view(ng, -1)
            if ng == 1:
                values = decode_table(packed, q + s, n_sent, tables[0])
            else:
                codes = gp.unsent(unpack_bits(packed, q + s, n_sent, dtype=torch.int64), h.shape)
                values = gp.sent(torch.gather(tables, 1, codes), h.shape)
        return gp.restore(values, h.shape).to(h.dtype)
