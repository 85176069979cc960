"""Sort quantization (codec ``sortquant``): equal-count buckets by rank, a uniform grid in each.

With ``split_bits`` S and ``quant_bits`` Q, the ``n`` values are split into ``B = 2**S``
buckets of (nearly) equal count by rank -- bucket ``i`` holds the values between the
``i/B`` and ``(i+1)/B`` quantiles -- and each bucket is quantized uniformly with
``L = 2**Q`` levels between its min and max. A value is sent as the code
``bucket * L + level`` in ``S + Q`` bits (bit-packed, :mod:`..kernels.bitpack`); a bucket as its
min and step (float32). Dense regions of the distribution get narrow buckets and fine
steps, sparse tails wide buckets and coarse steps: every equal share of the values gets
the same number of levels. In mean squared error it can lose to uniform quantization
at equal bits (``benchmarks/codec_speed.py`` prints both).

The original formulation sorts the whole tensor and loops over the ``B`` chunks of the
sorted values. This one never sorts the tensor (above :func:`sample_size` values) and
has no Python loop over buckets or values:

1. the ``B - 1`` boundaries ``b_1 <= ... <= b_{B-1}`` are order statistics of the
   tensor -- exactly for small tensors, else of a fixed-seed uniform sample of
   :func:`..kernels.buckets.sample_size` values (1,024 per bucket up to 16,384, then 64 per bucket: the
   MSE stays within a few percent of the exact split's, above or below it;
   ``benchmarks/codec_speed.py`` measures it), read off the sorted sample (on CPU a
   radix sort, :func:`..kernels.buckets.sort_sample`, else numpy's sort); a zero boundary is +0.0
   (a small message's whole grid and its codes come from one compiled call,
   :func:`..kernels.compiled_grid.sampled_grid`, and its decode from another,
   :func:`..kernels.compiled.message_values`);
2. the bucket of ``x`` is the number of boundaries ``<= x`` (:class:`..kernels.BucketIndex`);
3. bucket ``i``'s min is ``b_i`` itself (a value of the tensor, and the smallest one in
   the bucket; the global min for bucket 0); its max comes with the sort for small
   tensors, else from one pass over the values that also finds the global min
   (:func:`..kernels.compiled_grid.bucket_extrema`, or eager ``torch.aminmax`` and one ``scatter_reduce``
   over the bucket indices); a zero min or max is sent as +0.0;
4. levels, codes and bit-packing run in one compiled loop on CPU (:mod:`..kernels.compiled`, up
   to 16 buckets), else block by block (:func:`..kernels.uniform.blocks`: cache-sized blocks on
   CPU, the whole tensor on a GPU); decoding is a lookup in the ``B * L``-entry table
   of grid values (or its compiled equivalent).

On distinct values this gives exactly the codes of the original formulation (tested).

Ties: values equal to a boundary all go to the upper bucket, so with many equal values
(e.g. the zeros of a ReLU) the counts are unequal and some buckets stay empty (min =
max = their boundary, step 0); every value is still within half a step of its
bucket's grid. Decoding, re-encoding and decoding again gives the decoded tensor back
(to float rounding; tested): the decoded values keep their order, and each boundary
is a bucket min, which decodes to itself.

Reference: the sort-quantization scheme this project is built around (DESIGN.md);
uniform quantization within buckets as in :mod:`.quantize`. Steps 1-4 are the kernel
layer's (:mod:`..kernels.buckets`); this module is the codec: options, grouping, header.
"""

from __future__ import annotations

import torch

from ..base import Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from ..kernels import (bucket_codes, bucket_grid, bucket_values, finite_grid, finite_range, grid_levels, pack_bits,
                       packed_nbytes, unpack_bits)
from ..kernels.uniform import grid_table
from ..steps.grid import GROUP_PARAM, flat_float32, grid_meta, grouping_options
from ..steps.grouping import Grouping

__all__ = ["SortQuantizer", "group_buckets"]


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
            (:class:`.quantize.UniformQuantizer`, :mod:`..steps.grouping`). With a group other
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
            a range overflowing float32 -- on CPU, and on a GPU for groups; a per-tensor grid on a GPU
            is not read back, and the decoder refuses it instead.
    Raises (decode):
        ValueError: a corrupt header, or a grid that is not finite.
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
        """Packed codes and ``cat(mins, steps)`` (each ``(n_groups, 2**S)``) of a non-empty tensor, bucketed per
        group."""
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

    def encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x, self.name)
        q, s = self.quant_bits, self.split_bits
        params = (q, s, self.grouping.param(x.dim()))
        if flat.numel() == 0:
            meta_len = 0 if not self.grouping.plain else 2 << s  # the plain formulation sends its buckets' grid
            packed, meta = flat.to(torch.uint8), flat.new_zeros(meta_len, dtype=self.grouping.meta_dtype)
        elif not self.grouping.plain:
            packed, meta = self._encode_groups(flat, tuple(x.shape))
        else:
            grid = bucket_grid(flat, s, q, self.name, codes=not self.stochastic)
            packed, meta = bucket_codes(flat, grid, q, s, self.stochastic), grid.meta
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
        finite_grid(meta, self.name)  # a GPU encoder sends the grid it computed, unchecked (no read back)
        if ng == 1:
            values = bucket_values(packed, q, s, n_sent, meta)
        else:
            m = ng * buckets
            tables = grid_table(meta[:m].float(), meta[m:].float(), 1 << q).view(ng, -1)
            codes = gp.unsent(unpack_bits(packed, q + s, n_sent, dtype=torch.int64), h.shape)
            values = gp.sent(torch.gather(tables, 1, codes), h.shape)
        return gp.restore(values, h.shape).to(h.dtype)
