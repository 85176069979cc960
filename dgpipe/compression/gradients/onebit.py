"""``onebit``: the sign of every value plus one scale, 1 bit per value.

Sources:
    F. Seide, H. Fu, J. Droppo, G. Li, D. Yu, "1-Bit Stochastic Gradient Descent and its
    Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
    S. P. Karimireddy, Q. Rebjock, S. U. Stich, M. Jaggi, "Error Feedback Fixes SignSGD
    and other Gradient Compression Schemes", ICML 2019 (the scaled sign
    ``C(x) = ||x||_1 / d * sign(x)`` used here).
    S. Zheng, Z. Huang, J. T. Kwok, "Communication-Efficient Distributed Blockwise
    Momentum SGD with Error-Feedback" (dist-EF-SGDM), NeurIPS 2019.

The codec is biased; wrap it in :class:`dgpipe.compression.feedback.ErrorFeedback` to
get EF-SGD (or dist-EF-SGDM with a momentum optimizer), as the papers do.
"""

from __future__ import annotations

import math

import torch

from ..base import Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from ..kernels.bitpack import pack_bits, unpack_bits
from .core import check_gradient

__all__ = ["OneBit"]


@register_codec("onebit", 8)
class OneBit(Codec):
    """Scaled sign: ``decode(encode(x)) = mean(|x|) * sign(x)``, with ``sign(0) = +1``.

    Every decoded value is ``+scale`` or ``-scale``, ``scale = mean(|x|)`` (float32). The
    L1 norm is preserved exactly (up to float32 rounding) when ``x`` has no zeros.

    Input: floating tensor (float32/float16/bfloat16/float64), any shape, CPU or CUDA;
    inf/NaN raise ``ValueError``. Output: same shape, dtype and device.

    Wire: the signs packed 1 bit per value (``uint8``) and the scale (``float32``)::

        nbytes = ceil(n / 8) + 4 + header bytes
    """

    def encode(self, x: torch.Tensor) -> Payload:
        check_gradient(x, self.name)
        flat = x.detach().reshape(-1).float()
        scale = flat.abs().mean().reshape(1) if flat.numel() else flat.new_zeros(1)
        signs = pack_bits((flat >= 0).to(torch.int64), 1, check=False)
        return make_payload(self.codec_id, x.dtype, x.shape, (), (signs, scale))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        check_params(h)
        check_tensor_specs(h, ("signs", torch.uint8, math.ceil(h.numel / 8)), ("scale", torch.float32, 1))
        signs, scale = payload.tensors
        bits = unpack_bits(signs, 1, h.numel).to(torch.float32)
        return ((bits * 2 - 1) * scale).to(h.dtype).view(h.shape)
