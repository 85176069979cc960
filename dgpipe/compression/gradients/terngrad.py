"""``terngrad``: stochastic ternary values {-1, 0, +1} times one scaler per tensor.

Source:
    W. Wen, C. Xu, F. Yan, C. Wu, Y. Wang, Y. Chen, H. Li, "TernGrad: Ternary Gradients
    to Reduce Communication in Distributed Deep Learning", NeurIPS 2017 (layer-wise
    ternarizing ``s * sign(g) * b``, ``b ~ Bernoulli(|g| / s)``, ``s = max |g|``, and
    gradient clipping at ``c * sigma``; the paper uses ``c = 2.5``).
"""

from __future__ import annotations

import math

import torch

from ..base import Payload, check_params, check_tensor_specs, make_payload, register_codec
from ..kernels.bitpack import pack_bits, unpack_bits
from .core import SeededCodec, check_gradient

__all__ = ["TernGrad"]


@register_codec("terngrad", 10)
class TernGrad(SeededCodec):
    """TernGrad: every decoded value is ``-s``, ``0`` or ``+s``, ``s = max |g|``.

    ``g`` is the input, first clipped to ``[-c * sigma, c * sigma]`` (``sigma`` the
    standard deviation of the tensor's values) when ``clip = c`` is given. Each value
    becomes ``s * sign(g_i)`` with probability ``|g_i| / s`` and 0 otherwise, so
    ``E[decode(encode(x))] = g``: unbiased for ``x`` without clipping, for the clipped
    tensor with it.

    Args:
        clip: ``c > 0`` of the paper's clipping, or ``None`` (default: no clipping).
        seed: seed of the Bernoulli draws (see :class:`~.gradbase.SeededCodec`).

    Input: floating tensor, any shape, CPU or CUDA; inf/NaN raise ``ValueError``.
    Output: same shape, dtype and device.

    Wire: ternary codes ``sign + 1`` packed 2 bits per value (``uint8``) and the scaler
    (``float32``)::

        nbytes = ceil(n / 4) + 4 + header bytes
    """

    def __init__(self, clip: float | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"terngrad: clip must be a positive number (the paper uses 2.5) or None, got {clip!r}")
        self.clip = clip

    def encode(self, x: torch.Tensor) -> Payload:
        check_gradient(x, self.name)
        g = x.detach().reshape(-1).float()
        if self.clip is not None and g.numel():
            bound = self.clip * g.std(correction=0)
            g = g.clamp(-bound, bound)
        scaler = g.abs().max().reshape(1) if g.numel() else g.new_zeros(1)
        prob = g.abs() / torch.where(scaler > 0, scaler, torch.ones_like(scaler))
        keep = torch.rand(g.shape, generator=self._next_generator(g.device), device=g.device) < prob
        codes = (torch.sign(g) * keep).to(torch.int64) + 1
        return make_payload(self.codec_id, x.dtype, x.shape, (), (pack_bits(codes, 2, check=False), scaler))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        check_params(h)
        check_tensor_specs(h, ("codes", torch.uint8, math.ceil(h.numel / 4)), ("scaler", torch.float32, 1))
        packed, scaler = payload.tensors
        codes = unpack_bits(packed, 2, h.numel)
        if h.numel and int(codes.max()) > 2:
            raise ValueError("corrupt payload: a ternary code is 3 (only 0, 1, 2 are valid)")
        return ((codes - 1).to(torch.float32) * scaler).to(h.dtype).view(h.shape)
