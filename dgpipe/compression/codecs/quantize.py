"""Uniform min-max quantization (codec ``quant``).

A value ``x`` in a range ``[lo, hi]`` becomes the level ``round((x - lo) / step)`` with
``step = (hi - lo) / (2**bits - 1)``, and decodes to ``lo + level * step``, so every
value is within half a step of its decoded value. With ``stochastic=True`` the level
is ``floor((x - lo) / step + u)``, ``u ~ U[0, 1)``: unbiased (``E[decoded] = x``),
error below one step (stochastic rounding; Gupta et al. 2015, Alistarh et al. 2017).

Steps: grouping and rotation (:mod:`..steps.grouping`), the per-group range and grid
(:mod:`..steps.grid`), then the codes and values (:func:`..kernels.uniform_codes`,
:func:`..kernels.uniform_values`; one group: :func:`..kernels.uniform_message`).

Policy for inf/NaN (all lossy quantizers of this package): ``encode`` raises
``ValueError`` -- a range with an infinite or undefined end would turn every decoded
value into garbage. So does a finite range wider than float32 can hold (``hi - lo``
overflows). Replace such values first (``torch.nan_to_num``) or send the tensor with
codec ``none``/``fp16``. One exception: on the GPU, a tensor of one grid is encoded
without reading its range back to the host (:func:`..kernels.uniform_message`), so the
grid it sends is not finite and ``decode`` raises the ``ValueError`` instead (every
decode checks the grid it receives).
"""

from __future__ import annotations

import torch

from ..base import Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from ..kernels import finite_grid, finite_range, packed_nbytes, uniform_codes, uniform_message, uniform_values
from ..steps.grid import GROUP_PARAM, flat_float32, grid_meta, grouping_options
from ..steps.grouping import Grouping

__all__ = ["UniformQuantizer"]


@register_codec("quant", 3)
class UniformQuantizer(Codec):
    """Uniform min-max quantization to ``bits`` bits per value, per tensor or per group.

    Args:
        bits: bits per value, 1..16 (``2**bits`` levels from a group's min to its max).
        stochastic: unbiased stochastic rounding (error < one step) instead of
            rounding to nearest (error <= half a step).
        group: ``tensor`` (one min/step), ``token``, ``channel`` or ``tile``
            (:mod:`..steps.grouping`): one min/step per group, so that an outlier only coarsens
            its own group (per-group ranges as in ActNN, Chen et al. ICML 2021, and
            AQ-SGD, Wang et al. NeurIPS 2022).
        group_size: values per tile (``group="tile"``); ``group_size > 0`` alone also
            selects tiles.
        axis: the channel axis of ``group="channel"`` (-1: last).
        rotate: ``none`` or ``hadamard``: a random-sign Hadamard rotation of the last
            axis before quantizing, inverted after decoding (:mod:`..steps.hadamard`).
        scale_dtype: ``float32`` (default), ``float16`` or ``bfloat16``: dtype of the
            per-group min and step on the wire.

    Input: a floating tensor (float32/float16/bfloat16/float64), any shape, any device;
    computed in float32. Decode returns the original shape, dtype and device.

    Wire: codes bit-packed at ``bits`` bits, plus ``(min, step)`` per group::

        nbytes = ceil(n_sent * bits / 8) + 2 * n_groups * sizeof(scale_dtype) + header bytes

    ``n_sent`` is the number of values, or with a padded rotation (:mod:`..steps.hadamard`)
    the padded count; ``n_groups`` from :meth:`..steps.grouping.Grouping.counts`.

    Raises (encode):
        ValueError: non-floating input, inf/NaN values, a range overflowing float32 or
            a metadata value overflowing ``scale_dtype``; bad options at construction.
    Raises (decode):
        ValueError: a corrupt header, or a grid that is not finite (inf/NaN values sent
            from a GPU, module docstring).
    """

    def __init__(self, bits: int = 8, stochastic: bool = False, group: str = "tensor", group_size: int = 0,
                 axis: int = -1, rotate: str = "none", scale_dtype: str = "float32") -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
            raise ValueError(f"quant: bits must be an int in [1, 16], got {bits!r}")
        self.bits, self.stochastic = bits, bool(stochastic)
        self.grouping = grouping_options(self.name, group, group_size, axis, rotate, scale_dtype)

    def encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x, self.name)
        gp, shape = self.grouping, tuple(x.shape)
        ng, g, n_sent = gp.counts(shape)
        params = (self.bits, gp.param(len(shape)))
        if n_sent == 0:
            packed, meta = flat.to(torch.uint8), flat.to(gp.meta_dtype)
        elif gp.plain:
            meta, packed = uniform_message(flat, self.bits, self.name, self.stochastic)
        else:
            rows = gp.rows(flat.view(shape))
            if ng == 1:  # a whole-tensor reduction: several times faster than along dim 1 of one row
                lo, hi = (t.view(1, 1) for t in torch.aminmax(rows))
            else:
                lo, hi = torch.aminmax(rows, dim=1, keepdim=True)
            finite_range(lo, hi, self.name)
            meta, lo32, div = grid_meta(lo, hi, 1 << self.bits, gp, self.name)
            packed = uniform_codes(gp.sent(rows, shape), lo32, div, self.bits, g, self.stochastic)
        return make_payload(self.codec_id, x.dtype, x.shape, params, (packed, meta))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        bits, group_param = check_params(h, ("bits", 1, 16), GROUP_PARAM)
        gp = Grouping.from_param(group_param, h.shape, self.name)
        ng, g, n_sent = gp.counts(h.shape)
        check_tensor_specs(h, ("codes", torch.uint8, packed_nbytes(n_sent, bits)), ("min/step", gp.meta_dtype, 2 * ng))
        packed, meta = payload.tensors
        if n_sent == 0:
            return meta.new_zeros(h.shape, dtype=h.dtype)
        finite_grid(meta, self.name)
        values = uniform_values(packed, bits, n_sent, meta, ng, g)  # in wire order
        return gp.restore(values, h.shape).to(h.dtype)
