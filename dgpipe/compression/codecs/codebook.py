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

Values beyond the outermost levels are clipped to them (the MSE-optimal choice for a
nearest-level quantizer). ``stochastic=True`` rounds a value between its two
neighbouring levels with probabilities that make it unbiased inside ``[levels[0],
levels[-1]] * s`` (clipped values stay biased; for unbiased gradients prefer ``quant``
with ``stochastic=True``).
"""

from __future__ import annotations

import torch

from ..base import Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from ..kernels import finite_range, level_codes, level_rows, level_rows_values, level_values, packed_nbytes, row_rms
from ..steps.grid import GROUP_PARAM, flat_float32, grouping_options
from ..steps.grouping import Grouping, round_meta
from ..steps.levels import fit_levels, normal_levels

__all__ = ["CodebookQuantizer", "LEVELS"]

LEVELS = ("normal", "fit")
"""Codebook kinds, in the order of their wire codes."""


@register_codec("codebook", 13)
class CodebookQuantizer(Codec):
    """Per-group RMS scale and a nearest-level codebook of ``2**bits`` levels (module docstring).

    Args:
        bits: bits per value, 1..16.
        levels: ``normal`` (fixed Lloyd-Max levels of the standard normal) or ``fit``
            (Lloyd-Max levels fitted to this tensor, sent with it).
        stochastic: stochastic rounding between neighbouring levels.
        group, group_size, axis, rotate, scale_dtype: as for ``quant``
            (:mod:`..steps.grouping`); one RMS scale per group. Best with ``group="token"`` and
            ``rotate="hadamard"`` on transformer hidden states.

    Wire (exact, tested)::

        nbytes = ceil(n_sent * bits / 8) + n_groups * sizeof(scale_dtype)
                 + (4 * 2**bits if levels == "fit") + header bytes

    Raises:
        ValueError: bad options (construction); non-floating input, inf/NaN, or a scale
            overflowing ``scale_dtype`` (encode); a corrupt payload (decode).
    """

    def __init__(self, bits: int = 4, levels: str = "normal", stochastic: bool = False, group: str = "tensor",
                 group_size: int = 0, axis: int = -1, rotate: str = "none", scale_dtype: str = "float32") -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
            raise ValueError(f"codebook: bits must be an int in [1, 16], got {bits!r}")
        if levels not in LEVELS:
            raise ValueError(f"codebook: levels must be one of {LEVELS}, got {levels!r}")
        self.bits, self.levels, self.stochastic = bits, levels, bool(stochastic)
        self.grouping = grouping_options(self.name, group, group_size, axis, rotate, scale_dtype)

    def encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x, self.name)
        gp, shape = self.grouping, tuple(x.shape)
        params = (self.bits, LEVELS.index(self.levels), gp.param(len(shape)))
        table = normal_levels(self.bits).to(flat.device)
        fused = self._one_pass(flat, shape, table)
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
            v = rows / torch.where(s32 > 0, s32, 1.0)
            if self.levels == "fit":
                table = fit_levels(gp.sent(v, shape), self.bits)
            packed = level_codes(gp.sent(v, shape), table, self.bits, self.stochastic)
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
        bits, kind, group_param = check_params(h, ("bits", 1, 16), ("levels", 0, len(LEVELS) - 1), GROUP_PARAM)
        gp = Grouping.from_param(group_param, h.shape, self.name)
        ng, _, n_sent = gp.counts(h.shape)
        specs = [("codes", torch.uint8, packed_nbytes(n_sent, bits)), ("scales", gp.meta_dtype, ng)]
        if LEVELS[kind] == "fit":
            specs.append(("levels", torch.float32, 1 << bits))
        check_tensor_specs(h, *specs)
        packed, scale = payload.tensors[:2]
        if n_sent == 0:
            return scale.new_zeros(h.shape, dtype=h.dtype)
        table = payload.tensors[2] if LEVELS[kind] == "fit" else normal_levels(bits).to(packed.device)
        if LEVELS[kind] == "fit" and not bool(torch.isfinite(table).all()):
            raise ValueError("corrupt payload: field 'tensors[2]' (levels) holds inf/NaN")
        if gp.group == "token" and h.shape:  # one compiled pass per row, where it applies
            d = h.shape[-1]
            y = level_rows_values(packed, bits, table, scale, ng, d, gp.rotation(h.shape))
            if y is not None:
                return y.view(h.shape).to(h.dtype)
        values = level_values(packed, bits, n_sent, table, scale.float(), gp.counts(h.shape)[1])
        return gp.restore(values, h.shape).to(h.dtype)
