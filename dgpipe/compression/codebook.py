"""Codebook quantization (codec ``codebook``): non-uniform levels that minimise mean squared error.

Each group (:mod:`.grouping`) is scaled by its root mean square ``s = sqrt(mean(x^2))``
and every scaled value ``x / s`` is sent as the index of the nearest of ``2**bits``
levels; it decodes to ``level * s``. The levels are either

- ``levels="normal"``: the Lloyd-Max quantizer of the standard normal distribution
  (Max, "Quantizing for minimum distortion", IRE Trans. IT 1960; Lloyd, IEEE Trans. IT
  1982), computed once per bit width from the normal density in closed form
  (:func:`normal_levels`). Nothing but the per-group scale is sent. It is the
  MSE-optimal fixed codebook for Gaussian data -- which is what a Hadamard rotation
  (``rotate="hadamard"``) makes of a vector with outlier features. (A "normal-float"
  codebook in the sense of QLoRA's NF4, Dettmers et al. 2023, spaces levels at normal
  quantiles between -absmax and +absmax; at 2-4 bits the Lloyd-Max levels with an RMS
  scale have lower MSE on Gaussian data, so that is the fixed codebook used here.)
- ``levels="fit"``: a Lloyd-Max (1-D k-means) codebook fitted to this tensor's scaled
  values (:func:`fit_levels`: a fixed-seed sample of at most 65,536 values, 12
  iterations from the normal levels) and sent as ``2**bits`` float32 values.

Values beyond the outermost levels are clipped to them (the MSE-optimal choice for a
nearest-level quantizer). ``stochastic=True`` rounds a value between its two
neighbouring levels with probabilities that make it unbiased inside ``[levels[0],
levels[-1]] * s`` (clipped values stay biased; for unbiased gradients prefer ``quant``
with ``stochastic=True``).
"""

from __future__ import annotations

import functools

import torch

from . import fused
from .base import Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .grouping import Grouping, round_meta
from .quantize import GROUP_PARAM, finite_range, flat_float32, fused_decode, fused_encode, grouping_options

__all__ = [
    "CodebookQuantizer", "normal_levels", "fit_levels", "nearest_level", "LEVELS", "fused_levels_encode",
    "fused_levels_decode",
]

LEVELS = ("normal", "fit")
"""Codebook kinds, in the order of their wire codes."""
FIT_SAMPLE = 1 << 16
"""Most values a fitted codebook is computed from."""
FIT_ITERATIONS = 12
FIT_SEED = 0xC0DE


@functools.lru_cache(maxsize=None)
def normal_levels(bits: int, iterations: int = 200) -> torch.Tensor:
    """Lloyd-Max levels of ``N(0, 1)`` for ``2**bits`` levels: 1-D float32, ascending.

    Alternates the two optimality conditions in float64 -- cell edges halfway between
    levels, each level the conditional mean of its cell,
    ``(phi(a) - phi(b)) / (Phi(b) - Phi(a))`` -- from the asymptotically optimal start
    (quantiles of ``N(0, 3)``). 1 bit gives ``+-0.7979`` (``sqrt(2/pi)``); 2 bits
    ``+-0.4528, +-1.5104`` (Max's table).
    """
    n = 1 << bits
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    levels = torch.special.ndtri(p) * 3**0.5
    for _ in range(iterations):
        inf = torch.tensor([float("inf")], dtype=torch.float64)
        edges = torch.cat((-inf, (levels[1:] + levels[:-1]) / 2, inf))
        pdf = torch.exp(-0.5 * edges.clamp(-40, 40) ** 2) / (2 * torch.pi) ** 0.5
        mass = torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1])
        levels = torch.where(mass > 0, (pdf[:-1] - pdf[1:]) / mass.clamp(min=1e-300), levels)
    return levels.to(torch.float32)


def nearest_level(v: torch.Tensor, levels: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """Index (int32) of the level nearest to each value of ``v``, or, with ``stochastic``, of the lower or
    upper neighbouring level with probabilities that make the decoded value unbiased (between the levels).

    Args:
        v: float32, any shape.
        levels: 1-D ascending float32, at least 2 values.
    """
    if not stochastic:
        return torch.bucketize(v, (levels[1:] + levels[:-1]) / 2).to(torch.int32)
    i = (torch.bucketize(v, levels, right=True) - 1).clamp_(0, levels.numel() - 2)
    lo, hi = levels[i], levels[i + 1]
    up = torch.rand_like(v) < ((v - lo) / (hi - lo)).clamp_(0, 1)
    return (i + up).to(torch.int32)


def fused_levels_encode(v: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor | None:
    """Packed :func:`nearest_level` indices (to nearest) of ``v`` (1-D float32, wire order) from
    :func:`.fused.encode_levels` (the ``n % CHUNK`` tail eager), or None where it does not apply."""
    mids = (levels[1:] + levels[:-1]) / 2
    return fused_encode(v, bits, lambda out: fused.encode_levels(v, mids, bits, out),
                        lambda start: nearest_level(v[start:], levels, False))


def fused_levels_decode(packed: torch.Tensor, bits: int, levels: torch.Tensor, scale: torch.Tensor, group_len: int,
                        n: int) -> torch.Tensor | None:
    """``levels[code] * scale[group]`` (1-D float32, wire order) from :func:`.fused.decode_levels`, or None."""

    def tail(start: int) -> torch.Tensor:
        grp = torch.arange(start, n) // group_len
        return levels[unpack_bits(packed, bits, n, start=start)] * scale.reshape(-1)[grp]

    return fused_decode(packed, n, lambda y: fused.decode_levels(packed, bits, levels, scale, group_len, y), tail)


def fit_levels(v: torch.Tensor, bits: int) -> torch.Tensor:
    """A Lloyd-Max codebook of ``2**bits`` levels fitted to the values ``v`` (1-D float32, non-empty).

    Up to :data:`FIT_SAMPLE` values (a fixed-seed sample), :data:`FIT_ITERATIONS`
    Lloyd iterations from :func:`normal_levels`; a level whose cell is empty keeps its
    value. Returns 1-D float32, ascending.
    """
    if v.numel() > FIT_SAMPLE:
        gen = torch.Generator(device=v.device).manual_seed(FIT_SEED)
        v = v[torch.randint(v.numel(), (FIT_SAMPLE,), generator=gen, device=v.device)]
    levels = normal_levels(bits).to(v.device)
    n = levels.numel()
    for _ in range(FIT_ITERATIONS):
        cell = nearest_level(v, levels, False).long()
        sums = torch.zeros(n, device=v.device).index_add_(0, cell, v)
        counts = torch.zeros(n, device=v.device).index_add_(0, cell, torch.ones_like(v))
        levels = torch.where(counts > 0, sums / counts.clamp(min=1), levels).sort().values
    return levels


@register_codec("codebook", 13)
class CodebookQuantizer(Codec):
    """Per-group RMS scale and a nearest-level codebook of ``2**bits`` levels (module docstring).

    Args:
        bits: bits per value, 1..16.
        levels: ``normal`` (fixed Lloyd-Max levels of the standard normal) or ``fit``
            (Lloyd-Max levels fitted to this tensor, sent with it).
        stochastic: stochastic rounding between neighbouring levels.
        group, group_size, axis, rotate, scale_dtype: as for ``quant``
            (:mod:`.grouping`); one RMS scale per group. Best with ``group="token"`` and
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
        if gp.counts(shape)[2] == 0:
            scale, packed = flat.to(gp.meta_dtype), flat.to(torch.uint8)
        else:
            rows = gp.rows(flat.view(shape))
            lo, hi = torch.aminmax(rows)
            finite_range(lo, hi, self.name)
            peak = rows.abs().amax(dim=1, keepdim=True)
            peak = torch.where(peak > 0, peak, 1.0)
            rms = peak * (rows / peak).square().mean(dim=1, keepdim=True).sqrt()  # no overflow of x^2
            scale = round_meta(rms, gp.meta_dtype, True, "scale", self.name)
            s32 = scale.float()
            v = rows / torch.where(s32 > 0, s32, 1.0)
            if self.levels == "fit":
                table = fit_levels(gp.sent(v, shape), self.bits)
            packed = None if self.stochastic else fused_levels_encode(gp.sent(v, shape), table, self.bits)
            if packed is None:
                packed = pack_bits(gp.sent(nearest_level(v, table, self.stochastic), shape), self.bits, check=False)
        tensors = (packed, scale.reshape(-1)) + ((table,) if self.levels == "fit" else ())
        return make_payload(self.codec_id, x.dtype, x.shape, params, tensors)

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
        values = fused_levels_decode(packed, bits, table, scale.float(), gp.counts(h.shape)[1], n_sent)
        if values is None:
            codes = unpack_bits(packed, bits, n_sent, dtype=torch.int64)
            values = gp.sent(gp.unsent(table[codes], h.shape) * scale.float()[:, None], h.shape)
        return gp.restore(values, h.shape).to(h.dtype)
