"""Codebook quantization (codec ``codebook``): non-uniform levels that minimise mean squared error.

Each group (:mod:`..steps.grouping`) is scaled by its root mean square ``s = sqrt(mean(x^2))``
and every scaled value ``x / s`` is sent as the index of the nearest of ``2**bits``
levels; it decodes to ``level * s``. The levels are either

- ``levels="normal"``: the Lloyd-Max quantizer of the standard normal distribution
  (Max, "Quantizing for minimum distortion", IRE Trans. IT 1960; Lloyd, IEEE Trans. IT
  1982), computed once per bit width from the normal density in closed form
  (:func:`..steps.levels.normal_levels`). Nothing but the per-group scale is sent. It is the
  MSE-optimal fixed codebook for Gaussian data -- which is what a Hadamard rotation
  (``rotate="hadamard"``) makes of a vector with outlier features. (A "normal-float"
  codebook in the sense of QLoRA's NF4, Dettmers et al. 2023, spaces levels at normal
  quantiles between -absmax and +absmax; at 2-4 bits the Lloyd-Max levels with an RMS
  scale have lower MSE on Gaussian data, so that is the fixed codebook used here.)
- ``levels="fit"``: a Lloyd-Max (1-D k-means) codebook fitted to this tensor's scaled
  values (:func:`..steps.levels.fit_levels`: a fixed-seed sample of at most 65,536 values, 12
  iterations from the normal levels) and sent as ``2**bits`` float32 values.

A level count that is not a power of two (``count=5``: 0 and +-0.76, +-1.72 times the scale)
is sent with fixed-length radix packing, ``k`` codes per ``b``-bit word
(:mod:`..kernels.radix`: 5 levels at 2.33 bits a value, 6 at 2.6, 7 at 2.82), so that bit
rates between the whole-bit ones are reachable without an entropy coder; Lloyd-Max MSE on
Gaussian data falls from 0.117 (4 levels) through 0.080, 0.058 and 0.044 to 0.035 (8 levels).

Values beyond the outermost levels are clipped to them (the MSE-optimal choice for a
nearest-level quantizer). ``stochastic=True`` rounds a value between its two
neighbouring levels with probabilities that make it unbiased inside ``[levels[0],
levels[-1]] * s`` (clipped values stay biased; for unbiased gradients prefer ``quant``
with ``stochastic=True``).
"""

from __future__ import annotations

import torch

from ..base import Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from ..kernels import (
    finite_grid, finite_range, level_codes, level_rows, level_rows_values, level_values, nearest_level, packed_nbytes,
    row_rms,
)
from ..kernels.deferred import refuse_unless
from ..kernels.radix import MAX_COUNT, pack_radix, radix_nbytes, unpack_radix
from ..kernels.uniform import in_groups
from ..steps.grid import GROUP_PARAM, flat_float32, grouping_options
from ..steps.grouping import Grouping, round_meta
from ..steps.levels import fit_levels, normal_codebook_on

__all__ = ["CodebookQuantizer", "LEVELS"]

LEVELS = ("normal", "fit")
"""Codebook kinds, in the order of their wire codes."""


@register_codec("codebook", 13)
class CodebookQuantizer(Codec):
    """Per-group RMS scale and a nearest-level codebook of ``2**bits`` (or ``count``) levels (module docstring).

    Args:
        bits: bits per value, 1..16 (default 4).
        count: number of levels, 2..65536, instead of ``bits``; one that is not a power of two
            is radix-packed (:mod:`..kernels.radix`). Give ``bits`` or ``count``, not both.
        levels: ``normal`` (fixed Lloyd-Max levels of the standard normal) or ``fit``
            (Lloyd-Max levels fitted to this tensor, sent with it).
        stochastic: stochastic rounding between neighbouring levels.
        group, group_size, axis, rotate, scale_dtype: as for ``quant``
            (:mod:`..steps.grouping`); one RMS scale per group. Best with ``group="token"`` and
            ``rotate="hadamard"`` on transformer hidden states.

    Wire (exact, tested)::

        nbytes = ceil(n_sent * bits / 8) + n_groups * sizeof(scale_dtype)
                 + (4 * 2**bits if levels == "fit") + header bytes

    with a ``count`` that is not a power of two, ``radix_nbytes(n_sent, count)`` codes bytes,
    ``4 * count`` fitted levels, and ``count`` as a fourth header param.

    Raises:
        ValueError: bad options (construction); non-floating input, inf/NaN, or a scale
            overflowing ``scale_dtype`` (encode); a corrupt payload (decode).
    """

    def __init__(self, bits: int | None = None, levels: str = "normal", stochastic: bool = False,
                 group: str = "tensor", group_size: int = 0, axis: int = -1, rotate: str = "none",
                 scale_dtype: str = "float32", count: int | None = None) -> None:
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16):
            raise ValueError(f"codebook: bits must be an int in [1, 16], got {bits!r}")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                                  or not 2 <= count <= MAX_COUNT):
            raise ValueError(f"codebook: count must be an int in [2, {MAX_COUNT}], got {count!r}")
        if bits is not None and count is not None:
            raise ValueError(f"codebook: give bits or count, not both (got bits={bits}, count={count})")
        if levels not in LEVELS:
            raise ValueError(f"codebook: levels must be one of {LEVELS}, got {levels!r}")
        self.count = count if count is not None else 1 << (4 if bits is None else bits)
        self.bits = (self.count - 1).bit_length()  # the code width in memory; on the wire when count is 2**bits
        self.radix = self.count != 1 << self.bits
        self.levels, self.stochastic = levels, bool(stochastic)
        self.grouping = grouping_options(self.name, group, group_size, axis, rotate, scale_dtype)

    def encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x, self.name)
        gp, shape = self.grouping, tuple(x.shape)
        params = (self.bits, LEVELS.index(self.levels), gp.param(len(shape))) + ((self.count,) if self.radix else ())
        table = normal_codebook_on(self.count, flat.device)
        fused = None if self.radix else self._one_pass(flat, shape, table)
        if fused is not None:
            packed, scale = fused
        elif gp.counts(shape)[2] == 0:
            scale, packed = flat.to(gp.meta_dtype), flat.to(torch.uint8)
        else:
            rows = gp.rows(flat.view(shape))
            lo, hi = torch.aminmax(rows)
            finite_range(lo, hi, self.name)
            scale = round_meta(row_rms(rows), gp.meta_dtype, True, "scale", self.name)
            s32 = scale.float()
            v = gp.sent(rows / torch.where(s32 > 0, s32, 1.0), shape)
            if self.levels == "fit":
                table = fit_levels(v, self.count)
            if self.radix:
                packed = pack_radix(nearest_level(v, table, self.stochastic), self.count)
            else:
                packed = level_codes(v, table, self.bits, self.stochastic)
        tensors = (packed, scale.reshape(-1)) + ((table,) if self.levels == "fit" else ())
        return make_payload(self.codec_id, x.dtype, x.shape, params, tensors)

    def _one_pass(self, flat: torch.Tensor, shape: tuple[int, ...],
                  table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(packed, scales)`` of token groups with fixed levels in one compiled pass per row
        (:func:`..kernels.level_rows`: the same bytes as the steps of :meth:`encode`), or None
        where it does not apply."""
        gp = self.grouping
        if gp.group != "token" or self.levels != "normal" or self.stochastic or not shape or flat.numel() == 0:
            return None
        return level_rows(flat.view(-1, shape[-1]), gp.rotation(shape), table, self.bits, gp.meta_dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        fields = [("bits", 1, 16), ("levels", 0, len(LEVELS) - 1), GROUP_PARAM]
        if len(h.params) == 4:  # a radix-packed count: 2**(bits-1) < count < 2**bits
            bits = h.params[0] if 1 <= h.params[0] <= 16 else 1
            fields.append(("count", (1 << (bits - 1)) + 1, (1 << bits) - 1))
        bits, kind, group_param, *radix = check_params(h, *fields)
        count = radix[0] if radix else 1 << bits
        gp = Grouping.from_param(group_param, h.shape, self.name)
        ng, g, n_sent = gp.counts(h.shape)
        codes_nbytes = radix_nbytes(n_sent, count) if radix else packed_nbytes(n_sent, bits)
        specs = [("codes", torch.uint8, codes_nbytes), ("scales", gp.meta_dtype, ng)]
        if LEVELS[kind] == "fit":
            specs.append(("levels", torch.float32, count))
        check_tensor_specs(h, *specs)
        packed, scale = payload.tensors[:2]
        if n_sent == 0:
            return scale.new_zeros(h.shape, dtype=h.dtype)
        finite_grid(scale, self.name)  # a GPU encoder sends what it computed, unchecked (no read back)
        table = payload.tensors[2] if LEVELS[kind] == "fit" else normal_codebook_on(count, packed.device)
        if LEVELS[kind] == "fit":
            refuse_unless(table, "corrupt payload: field 'tensors[2]' (levels) holds inf/NaN")
        if radix:
            values = in_groups(table[unpack_radix(packed, count, n_sent)], g) * scale.float().reshape(-1, 1)
            return gp.restore(values.reshape(-1)[:n_sent], h.shape).to(h.dtype)
        if gp.group == "token" and h.shape:  # one compiled pass per row, where it applies
            d = h.shape[-1]
            y = level_rows_values(packed, bits, table, scale, ng, d, gp.rotation(h.shape))
            if y is not None:
                return y.view(h.shape).to(h.dtype)
        values = level_values(packed, bits, n_sent, table, scale.float(), gp.counts(h.shape)[1])
        return gp.restore(values, h.shape).to(h.dtype)
