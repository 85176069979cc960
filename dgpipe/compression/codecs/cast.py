"""Lossless pass-through (``none``) and dtype casts (``fp16``, ``bf16``)."""

from __future__ import annotations

import torch

from ..base import Codec, Payload, check_tensor_specs, make_payload, register_codec


@register_codec("none", 0)
class NoCompression(Codec):
    """Lossless pass-through: the tensor itself plus a header. Any dtype the wire knows.

    ``nbytes = numel * element_size + header bytes``.
    """

    def encode(self, x: torch.Tensor) -> Payload:
        return make_payload(self.codec_id, x.dtype, x.shape, (), (x.contiguous(),))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        check_tensor_specs(h, ("values", h.dtype, h.numel))
        return payload.tensors[0].view(h.shape)


class _Cast(Codec):
    """Cast a floating tensor to ``wire_dtype`` for the wire and back on decode.

    inf and NaN pass through as the IEEE cast makes them (values beyond the wire
    dtype's range become inf, as ``Tensor.to`` does).
    """

    wire_dtype: torch.dtype

    def encode(self, x: torch.Tensor) -> Payload:
        if not x.is_floating_point():
            raise ValueError(f"{self.name} codec needs a floating tensor, got {x.dtype}")
        return make_payload(self.codec_id, x.dtype, x.shape, (), (x.to(self.wire_dtype).contiguous(),))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        check_tensor_specs(h, ("values", self.wire_dtype, h.numel))
        return payload.tensors[0].view(h.shape).to(h.dtype)


@register_codec("fp16", 1)
class Float16(_Cast):
    """IEEE half precision on the wire: 16 bits per value (Micikevicius et al. 2018)."""

    wire_dtype = torch.float16


@register_codec("bf16", 2)
class BFloat16(_Cast):
    """bfloat16 on the wire: 16 bits per value, float32's exponent range."""

    wire_dtype = torch.bfloat16
