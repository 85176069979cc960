"""Lossless packing of integer and bool tensors (``intpack``): attention masks at 1 bit a value.

A boundary's integer tensors -- an attention mask beside the hidden states, token ids --
must arrive bit-exact, and as ``int64`` they cost 64 bits a value: a MiniLM boundary's
int64 mask alone is 0.17 bit per hidden value (one mask value per 384), 8% of a 2-bit
codec's budget. ``intpack`` sends ``x - min(x)`` in the fewest bits that hold the range
(frame-of-reference bit packing: Goldstein, Ramakrishnan and Shaft, "Compressing
Relations and Indexes", ICDE 1998), in the :mod:`..kernels.bitpack` layout: a 0/1 mask costs 1 bit
a value.

Two forms, told apart by the header's params:

- packed, params ``(offset, bits)``, ``1 <= bits <= 62``: the one payload tensor is
  ``pack_bits(x - offset, bits)`` (``uint8``, ``ceil(numel * bits / 8)`` bytes), with
  ``offset = min(x)`` and ``bits = max(1, bit_length(max(x) - min(x)))``;
- as is, no params: the values themselves (``x.dtype``, ``numel``), byte for byte the
  ``none`` codec's payload but for the codec id -- whenever packing, with its two 8-byte
  params, would not be smaller (a few values, ``uint8`` data using its whole range, an
  empty tensor) or the range does not fit 62 bits.

So ``nbytes`` is never more than ``none``'s: ``min(packed + 16, raw) + header bytes``.
"""

from __future__ import annotations

import torch

from ..base import Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from ..kernels.bitpack import MAX_BITS, pack_bits, packed_nbytes, unpack_bits

__all__ = ["IntPack"]

_OFFSET_LIMIT = 1 << 62  # what a header param may hold


def _value_range(dtype: torch.dtype) -> tuple[int, int]:
    return (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)


@register_codec("intpack", 14)
class IntPack(Codec):
    """Lossless frame-of-reference bit packing of an integer or bool tensor (module docstring).

    ``encode(x)``: ``x`` any integer dtype the wire knows (``uint8``, ``int8`` .. ``int64``) or
    ``bool``, any shape and device. ``decode`` returns it bit-exact: same dtype, shape, device.

    Raises:
        ValueError: encoding a floating or complex tensor; decoding a corrupt header or
            values outside the declared dtype's range.
    """

    def encode(self, x: torch.Tensor) -> Payload:
        if x.is_floating_point() or x.is_complex():
            raise ValueError(f"intpack codec needs an integer or bool tensor, got {x.dtype}")
        flat = x.reshape(-1)
        n = flat.numel()
        if n:
            lo, hi = (int(v) for v in torch.aminmax(flat.view(torch.uint8) if x.dtype == torch.bool else flat))
            bits = max(1, (hi - lo).bit_length())
            smaller = packed_nbytes(n, bits) + 2 * 8 < n * x.element_size()  # two int64 params
            if smaller and -_OFFSET_LIMIT <= lo <= _OFFSET_LIMIT and bits <= MAX_BITS:
                codes = flat.to(torch.int64) - lo
                return make_payload(self.codec_id, x.dtype, x.shape, (lo, bits), (pack_bits(codes, bits, check=False),))
        return make_payload(self.codec_id, x.dtype, x.shape, (), (flat.contiguous(),))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        if h.dtype.is_floating_point or h.dtype.is_complex:
            raise ValueError(f"corrupt header: field 'dtype' = {h.dtype}, but intpack carries integer or bool tensors")
        if not h.params:
            check_tensor_specs(h, ("values", h.dtype, h.numel))
            return payload.tensors[0].view(h.shape)
        offset, bits = check_params(h, ("offset", -_OFFSET_LIMIT, _OFFSET_LIMIT), ("bits", 1, MAX_BITS))
        check_tensor_specs(h, ("packed", torch.uint8, packed_nbytes(h.numel, bits)))
        values = unpack_bits(payload.tensors[0], bits, h.numel) + offset  # < 2**63: offset, codes < 2**62
        lo, hi = _value_range(h.dtype)
        if h.numel and not (lo <= offset and int(values.max()) <= hi):
            raise ValueError(f"corrupt payload: decoded values outside the range of {h.dtype} [{lo}, {hi}]")
        return values.to(h.dtype).view(h.shape)
