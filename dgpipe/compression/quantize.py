"""Uniform min-max quantization (codec ``quant``) and the grid helpers sort quantization shares.

A value ``x`` in a range ``[lo, hi]`` becomes the level ``round((x - lo) / step)`` with
``step = (hi - lo) / (2**bits - 1)``, and decodes to ``lo + level * step``, so every
value is within half a step of its decoded value. With ``stochastic=True`` the level
is ``floor((x - lo) / step + u)``, ``u ~ U[0, 1)``: unbiased (``E[decoded] = x``),
error below one step (stochastic rounding; Gupta et al. 2015, Alistarh et al. 2017).

Policy for inf/NaN (all lossy quantizers of this package): ``encode`` raises
``ValueError`` -- a range with an infinite or undefined end would turn every decoded
value into garbage. So does a finite range wider than float32 can hold (``hi - lo``
overflows). Replace such values first (``torch.nan_to_num``) or send the tensor with
codec ``none``/``fp16``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import MAX_NUMEL, Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from .bitpack import pack_bits, pack_bits_into, packed_nbytes, unpack_bits

__all__ = [
    "UniformQuantizer",
    "BLOCK",
    "blocks",
    "encode_blocks",
    "decode_table",
    "flat_float32",
    "finite_range",
    "grid_step",
    "grid_divisor",
    "grid_levels",
    "grid_table",
]


BLOCK = 1 << 18
"""Values per block of the per-value work on CPU: a block's temporaries stay in cache."""


def blocks(flat: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges covering ``flat`` (1-D): blocks of :data:`BLOCK` values on
    CPU -- about 2x faster there than whole-tensor passes -- and one range elsewhere
    (a GPU wants few, large kernels)."""
    n = flat.numel()
    step = BLOCK if flat.device.type == "cpu" else max(n, 1)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def encode_blocks(flat: torch.Tensor, bits: int, codes_of: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """Bit-packed codes of ``flat`` (1-D float32), computed and packed block by block.

    Args:
        flat: the values.
        bits: code width.
        codes_of: ``codes_of(i, j)`` gives the int32 codes (in ``[0, 2**bits)``) of
            ``flat[i:j]``, for the ranges of :func:`blocks`.

    Returns:
        1-D uint8 of ``ceil(len(flat) * bits / 8)`` bytes (layout of :func:`.bitpack.pack_bits`).
    """
    n = flat.numel()
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=flat.device)
    for i, j in blocks(flat):
        pack_bits_into(out, codes_of(i, j), bits, n, i, check=False)
    return out


def decode_table(packed: torch.Tensor, bits: int, n: int, table: torch.Tensor) -> torch.Tensor:
    """``table[code]`` for the ``n`` codes of ``bits`` bits in ``packed``, block by block (1-D float32)."""
    y = torch.empty(n, dtype=torch.float32, device=packed.device)
    for i, j in blocks(y):
        torch.index_select(table, 0, unpack_bits(packed, bits, n, start=i, stop=j, dtype=torch.int32), out=y[i:j])
    return y


def flat_float32(x: torch.Tensor, codec_name: str) -> torch.Tensor:
    """``x`` flattened to 1-D float32 (a view of ``x`` when it already is; never modify it).

    Raises:
        ValueError: ``x`` is not a floating tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{codec_name} codec needs a floating tensor (float32/float16/bfloat16/float64), got {got}")
    return x.reshape(-1).to(torch.float32)


def finite_range(lo: torch.Tensor, hi: torch.Tensor, codec_name: str) -> None:
    """Raise ``ValueError`` unless all ``lo``/``hi`` (range ends, float32) and ``hi - lo`` are finite.

    min/max propagate NaN and inf, so checking the ends checks every value they cover.
    """
    if not bool(torch.isfinite(hi - lo).all()):
        if not bool((torch.isfinite(lo) & torch.isfinite(hi)).all()):
            raise ValueError(
                f"{codec_name} codec got inf/NaN values; lossy quantizers refuse them: replace them "
                "first (e.g. torch.nan_to_num) or send this tensor with codec 'none' or 'fp16'"
            )
        raise ValueError(f"{codec_name} codec got a value range wider than float32 can hold (max - min overflows)")


def grid_step(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    """Step of the uniform grid of ``levels`` points from ``lo`` to ``hi`` (float32, same shape)."""
    return (hi - lo) / (levels - 1)


def grid_levels(v: torch.Tensor, div: torch.Tensor, levels: int, stochastic: bool) -> torch.Tensor:
    """Turn ``v = x - lo`` into levels on the grid ``lo + k * step``, ``k`` in ``[0, levels)``, in place.

    Args:
        v: float32, ``x - lo`` for values ``x`` in ``[lo, lo + (levels - 1) * step]``;
            overwritten with the (integral) levels and returned.
        div: float32, broadcastable to ``v``: the step where it is positive, and any
            positive number (e.g. 1) where the range is zero (there ``v`` is 0).
        levels: number of grid points, ``2**bits``.
        stochastic: unbiased stochastic rounding instead of rounding to nearest.
    """
    v /= div
    if stochastic:
        v += torch.rand_like(v)
        v.floor_()
    else:
        v.round_()
    return v.clamp_(0, levels - 1)  # float rounding of a tiny step must not leave [0, levels)


def grid_divisor(step: torch.Tensor) -> torch.Tensor:
    """``step`` with its zeros (constant ranges) replaced by 1: the ``div`` of :func:`grid_levels`."""
    return torch.where(step > 0, step, 1.0)


def grid_table(lo: torch.Tensor, step: torch.Tensor, levels: int) -> torch.Tensor:
    """Decoded value of every code: ``lo[g] + k * step[g]`` at ``g * levels + k`` (1-D float32)."""
    k = torch.arange(levels, dtype=torch.float32, device=lo.device)
    return (lo[:, None] + k * step[:, None]).reshape(-1)


@register_codec("quant", 3)
class UniformQuantizer(Codec):
    """Uniform min-max quantization to ``bits`` bits per value, per tensor or per group.

    Args:
        bits: bits per value, 1..16 (``2**bits`` levels from min to max).
        stochastic: unbiased stochastic rounding (error < one step) instead of
            rounding to nearest (error <= half a step).
        group_size: 0 for one ``(min, step)`` for the whole tensor; ``g > 0`` for one
            per ``g`` consecutive values of the flattened tensor (the last group may be
            shorter), so that an outlier only coarsens its own group.

    Input: a floating tensor (float32/float16/bfloat16/float64), any shape, any device;
    computed in float32. Decode returns the original shape, dtype and device.

    Wire: codes bit-packed at ``bits`` bits, plus ``(min, step)`` per group as float32::

        nbytes = ceil(n * bits / 8) + 8 * n_groups + header bytes,
        n_groups = ceil(n / group_size) (group_size > 0), else 1 (0 if n == 0).

    Raises (encode):
        ValueError: non-floating input, inf/NaN values, or a range overflowing float32.
    """

    def __init__(self, bits: int = 8, stochastic: bool = False, group_size: int = 0) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
            raise ValueError(f"quant: bits must be an int in [1, 16], got {bits!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0:
            raise ValueError(f"quant: group_size must be an int >= 0 (0 = per tensor), got {group_size!r}")
        self.bits, self.stochastic, self.group_size = bits, bool(stochastic), group_size

    @staticmethod
    def _groups(n: int, group_size: int) -> tuple[int, int]:
        """``(g, n_groups)``: the effective group length and the number of groups for ``n`` values."""
        g = group_size if group_size else max(n, 1)
        return g, -(-n // g)

    def encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x, self.name)
        n, levels = flat.numel(), 1 << self.bits
        g, ng = self._groups(n, self.group_size)
        if n == 0:
            packed, lo, step = flat.to(torch.uint8), flat, flat
        else:
            # repeat the last value so that the last group's min and max stay its own
            rows = (torch.cat((flat, flat[-1:].expand(g - n % g))) if n % g else flat).view(ng, g)
            lo, hi = torch.aminmax(rows, dim=1, keepdim=True)
            finite_range(lo, hi, self.name)
            step = grid_step(lo, hi, levels)
            div = grid_divisor(step)
            if ng == 1:
                packed = encode_blocks(
                    flat,
                    self.bits,
                    lambda i, j: grid_levels(flat[i:j] - lo[0], div[0], levels, self.stochastic).to(torch.int32),
                )
            else:
                codes = grid_levels(rows - lo, div, levels, self.stochastic).view(-1)[:n].to(torch.int32)
                packed = pack_bits(codes, self.bits, check=False)
        params = torch.cat((lo.reshape(-1), step.reshape(-1)))
        return make_payload(self.codec_id, x.dtype, x.shape, (self.bits, self.group_size), (packed, params))

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        bits, group_size = check_params(h, ("bits", 1, 16), ("group_size", 0, MAX_NUMEL))
        n = h.numel
        g, ng = self._groups(n, group_size)
        check_tensor_specs(h, ("codes", torch.uint8, packed_nbytes(n, bits)), ("min/step", torch.float32, 2 * ng))
        packed, params = payload.tensors
        lo, step = params[:ng], params[ng:]
        if ng == 1:  # one grid: a table lookup per value
            y = decode_table(packed, bits, n, grid_table(lo, step, 1 << bits))
        else:
            codes = unpack_bits(packed, bits, n, dtype=torch.int32).to(torch.float32)
            if n % g:
                codes = torch.nn.functional.pad(codes, (0, g - n % g))
            y = torch.addcmul(lo[:, None], codes.view(ng, g), step[:, None]).view(-1)[:n]
        return y.to(h.dtype).view(h.shape)
