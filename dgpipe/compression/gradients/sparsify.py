"""Sparsification: send ``k`` of the ``n`` values -- the largest (``topk``) or random ones (``randomk``).

Both keep ``k = max(1, ceil(ratio * n))`` values (``k = 0`` for an empty tensor), sent
exactly in the tensor's own dtype, and decode to a tensor that is zero elsewhere
(no rescaling: pair them with :class:`~dgpipe.compression.feedback.ErrorFeedback`
so that what is dropped is sent later; Stich et al., "Sparsified SGD with Memory",
NeurIPS 2018; Aji & Heafield, "Sparse Communication for Distributed Gradient
Descent", EMNLP 2017).

- ``topk`` sends the positions too, bit-packed at ``ceil(log2(n))`` bits each.
- ``randomk`` sends no positions: they are drawn from the shared ``seed`` and a step
  counter carried in the header, so any process decodes the payload alone.

Inputs: floating tensors (float32/float16/bfloat16/float64), any shape, contiguous or
not, any device. inf and NaN are values like any other: sent exactly when selected
(``topk`` ranks NaN above every magnitude, as ``torch.topk`` does).
"""

from __future__ import annotations

import math

import torch

from ..base import Codec, Header, Payload, check_params, check_tensor_specs, make_payload, register_codec
from ..kernels.bitpack import index_bits, pack_bits, packed_nbytes, unpack_bits
from .core import SeededCodec, mix_seed

__all__ = ["TopK", "RandomK", "kept_count", "random_positions", "sparse_payload", "decode_sparse"]


def _check_ratio(name: str, ratio: float) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{name}: ratio must be a number in (0, 1], got {ratio!r}")
    return float(ratio)


def _flat(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} codec needs a floating tensor (float32/float16/bfloat16/float64), got {got}")
    return x.detach().reshape(-1)


def kept_count(n: int, ratio: float) -> int:
    """Values kept out of ``n``: ``max(1, ceil(ratio * n))``, and 0 when ``n == 0``."""
    return min(n, max(1, math.ceil(ratio * n))) if n else 0


def random_positions(seed: int, step: int, n: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``k`` distinct positions ``randomk`` keeps out of ``n`` at ``step`` (1-D int64, ascending).

    Stratified: one uniformly random position in each of ``k`` consecutive strata of
    ``[0, n)`` (stratum ``i`` is ``[i*n // k, (i+1)*n // k)``), so every position is
    kept with probability about ``k / n``, the positions are spread over the tensor,
    and drawing them costs O(k). Drawn on CPU from ``mix_seed(seed, step)`` and moved
    to ``device``: the same on every process and device.
    """
    gen = torch.Generator().manual_seed(mix_seed(seed, step))
    i = torch.arange(k + 1, dtype=torch.int64) * n // k if k else torch.zeros(1, dtype=torch.int64)
    start, size = i[:-1], i[1:] - i[:-1]
    offset = (torch.rand(k, generator=gen, dtype=torch.float64) * size).to(torch.int64)
    return (start + torch.minimum(offset, size - 1)).to(device)


def sparse_payload(codec_id: int, x: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> Payload:
    """The payload of ``values`` kept at flat positions ``idx`` of ``x`` (``topk``, ``dgc``).

    Args:
        codec_id: the sending codec's id.
        x: the encoded tensor (its shape and dtype go in the header).
        idx: int64 ``(k,)`` distinct positions in ``[0, x.numel())``.
        values: ``(k,)`` in ``x.dtype``, the values at ``idx``.

    Header parameters ``(k, b)`` with ``b = index_bits(n)``; tensors ``(values, positions
    bit-packed at b bits)``, ``k * itemsize + ceil(k * b / 8)`` bytes.
    """
    bits = index_bits(x.numel())
    packed = pack_bits(idx, bits, check=False)
    return make_payload(codec_id, x.dtype, x.shape, (idx.numel(), bits), (values, packed))


def decode_sparse(header: Header, payload: Payload) -> torch.Tensor:
    """Decode a :func:`sparse_payload`: zeros of ``header``'s shape and dtype, ``values`` at the positions.

    Args:
        header: ``payload``'s parsed header (:meth:`Codec.parse`).
        payload: tensors ``(values, packed positions)``.

    Raises:
        ValueError: parameters or tensors that do not fit the header, or a position ``>= n``.
    """
    n = header.numel
    bits = index_bits(n)
    k, _ = check_params(header, ("k", 0, n), ("index_bits", bits, bits))
    check_tensor_specs(header, ("values", header.dtype, k), ("indices", torch.uint8, packed_nbytes(k, bits)))
    values, packed = payload.tensors
    idx = unpack_bits(packed, bits, k)
    if k and int(idx.max()) >= n:
        raise ValueError(f"corrupt payload: field 'tensors[1]' (indices) holds a position >= {n}")
    out = torch.zeros(n, dtype=header.dtype, device=values.device)
    out[idx] = values
    return out.view(header.shape)


@register_codec("topk", 5)
class TopK(Codec):
    """Keep the ``k = max(1, ceil(ratio * n))`` values of largest magnitude, with their positions.

    Args:
        ratio: fraction of the values kept, in (0, 1].

    Wire: the kept values in the tensor's dtype, their positions bit-packed::

        nbytes = k * element_size + ceil(k * ceil(log2(n)) / 8) + header bytes

    Ties at the k-th magnitude are broken as ``torch.topk`` breaks them.
    """

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = _check_ratio("topk", ratio)

    def encode(self, x: torch.Tensor) -> Payload:
        flat = _flat(x, self.name)
        n = flat.numel()
        k = kept_count(n, self.ratio)
        idx = torch.topk(flat.abs(), k, sorted=False).indices if k else torch.zeros(0, dtype=torch.int64)
        idx = idx.to(flat.device)
        return sparse_payload(self.codec_id, x, idx, flat.index_select(0, idx))

    def decode(self, payload: Payload) -> torch.Tensor:
        return decode_sparse(self.parse(payload), payload)


@register_codec("randomk", 6)
class RandomK(SeededCodec):
    """Keep ``k = max(1, ceil(ratio * n))`` values at positions drawn from ``(seed, step)``.

    ``step`` counts this instance's encodes (its only state: ``state_dict()`` /
    ``load_state_dict()``), so successive encodes keep different positions; it travels
    in the header with the seed, and :func:`random_positions` regenerates the
    positions on decode -- in any process, with nothing but the payload. Instances
    with equal seeds that encode in step keep equal positions (what an all-reduce of
    the values needs).

    Args:
        ratio: fraction of the values kept, in (0, 1].
        seed: int in ``[0, 2**62)``.

    Wire: the kept values only, in the tensor's dtype::

        nbytes = k * element_size + header bytes
    """

    stateful = True

    def __init__(self, ratio: float = 0.01, seed: int = 0) -> None:
        super().__init__(seed)
        if not 0 <= seed < 1 << 62:
            raise ValueError(f"randomk: seed must be in [0, 2**62), got {seed}")
        self.ratio = _check_ratio("randomk", ratio)

    def encode(self, x: torch.Tensor) -> Payload:
        flat = _flat(x, self.name)
        n = flat.numel()
        k = kept_count(n, self.ratio)
        step = self._step
        self._step += 1
        values = flat.index_select(0, random_positions(self.seed, step, n, k, flat.device))
        return make_payload(self.codec_id, x.dtype, x.shape, (self.seed, step, k), (values,))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        n = h.numel
        seed, step, k = check_params(h, ("seed", 0, (1 << 62) - 1), ("step", 0, 1 << 62), ("k", 0, n))
        check_tensor_specs(h, ("values", h.dtype, k))
        (values,) = payload.tensors
        out = torch.zeros(n, dtype=h.dtype, device=values.device)
        out[random_positions(seed, step, n, k, values.device)] = values
        return out.view(h.shape)
