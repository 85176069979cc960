"""``qsgd``: unbiased stochastic rounding of ``|x| / norm`` onto ``levels`` levels.

Source:
    D. Alistarh, D. Grubic, J. Li, R. Tomioka, M. Vojnovic, "QSGD: Communication-Efficient
    SGD via Gradient Quantization and Encoding", NeurIPS 2017 (the quantizer
    ``Q_s(v_i) = ||v|| * sign(v_i) * xi_i(v, s)``, with buckets of ``d`` values each
    scaled by its own norm; this codec bit-packs the levels instead of Elias coding).

Also known as random dithering: registered as ``qsgd`` with the alias ``dithering``.
"""

from __future__ import annotations

import math

import torch

from ..base import MAX_NUMEL, Payload, check_params, check_tensor_specs, make_payload, register_codec
from ..kernels.bitpack import pack_bits, unpack_bits
from .core import SeededCodec, check_gradient

__all__ = ["QSGD"]

_NORMS = {"l2": 0, "max": 1}


@register_codec("qsgd", 9, aliases=("dithering",))
class QSGD(SeededCodec):
    """QSGD quantizer: per bucket of values, ``norm * sign(x) * level / s``.

    Each value ``x_i`` of a bucket with norm ``N`` (``||.||_2`` or ``max |.|``) has
    ``r = s * |x_i| / N`` in ``[0, s]``; its level is ``floor(r) + Bernoulli(r - floor(r))``,
    so ``E[decode(encode(x))] = x`` (unbiased) and ``|decode - x| <= N / s``.

    Args:
        levels: ``s >= 1`` quantization levels above zero (``s = 1`` is ternary).
        norm: ``"l2"`` (the paper's) or ``"max"`` (lower variance).
        bucket_size: values per bucket, each with its own norm; ``None`` (default)
            means one bucket for the whole tensor.
        seed: seed of the stochastic rounding (see :class:`~.gradbase.SeededCodec`).

    Input: floating tensor, any shape, CPU or CUDA; inf/NaN raise ``ValueError``.
    Output: same shape, dtype and device.

    Wire: per value the signed level ``s + sign * level`` in ``[0, 2s]``, packed in
    ``b = ceil(log2(2s + 1))`` bits; per bucket its norm as ``float32``::

        nbytes = ceil(n * b / 8) + 4 * n_buckets + header bytes
        n_buckets = ceil(n / bucket_size)   (1 without bucket_size)
    """

    def __init__(self, levels: int = 4, norm: str = "l2", bucket_size: int | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 32767:
            raise ValueError(f"qsgd: levels must be an int in [1, 32767] (codes take <= 16 bits), got {levels!r}")
        if norm not in _NORMS:
            raise ValueError(f"qsgd: norm must be one of {sorted(_NORMS)}, got {norm!r}")
        if bucket_size is not None and (
            isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1
        ):
            raise ValueError(f"qsgd: bucket_size must be a positive int or None, got {bucket_size!r}")
        self.levels = levels
        self.norm = norm
        self.bucket_size = bucket_size

    @property
    def bits(self) -> int:
        """Bits per value on the wire: ``ceil(log2(2 * levels + 1))``."""
        return (2 * self.levels).bit_length()

    def encode(self, x: torch.Tensor) -> Payload:
        check_gradient(x, self.name)
        flat = x.detach().reshape(-1).float()
        n, s = flat.numel(), self.levels
        width = self.bucket_size or max(n, 1)
        n_buckets = math.ceil(n / width) if self.bucket_size else 1
        rows = torch.nn.functional.pad(flat, (0, n_buckets * width - n)).view(n_buckets, width)
        mag = rows.abs()
        norms = mag.amax(dim=1) if self.norm == "max" else torch.linalg.vector_norm(rows, dim=1)
        # |x| / N first (in [0, 1]), then times s: s / N overflows to inf for a subnormal N.
        scaled = mag / torch.where(norms > 0, norms, torch.ones_like(norms)).unsqueeze(1) * s
        low = scaled.floor()
        noise = torch.rand(scaled.shape, generator=self._next_generator(flat.device), device=flat.device)
        level = (low + (noise < scaled - low).float()).clamp_(max=s).reshape(-1)[:n]
        codes = (s + torch.where(flat < 0, -level, level)).to(torch.int64)
        packed = pack_bits(codes, self.bits, check=False)
        return make_payload(self.codec_id, x.dtype, x.shape, (s, self.bucket_size or 0), (packed, norms))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        s, bucket_size = check_params(h, ("levels", 1, 32767), ("bucket_size", 0, MAX_NUMEL))
        n, bits = h.numel, (2 * s).bit_length()
        n_buckets = math.ceil(n / bucket_size) if bucket_size else 1
        check_tensor_specs(h, ("codes", torch.uint8, math.ceil(n * bits / 8)), ("norms", torch.float32, n_buckets))
        packed, norms = payload.tensors
        codes = unpack_bits(packed, bits, n)
        if n and int(codes.max()) > 2 * s:
            raise ValueError(f"corrupt payload: a code exceeds 2*levels = {2 * s}")
        # by index, not repeat_interleave(bucket_size): a header may claim any bucket size up to MAX_NUMEL
        per_value = norms[torch.arange(n, device=norms.device) // bucket_size] if bucket_size else norms.expand(n)
        return ((codes - s).to(torch.float32) * (per_value / s)).to(h.dtype).view(h.shape)
