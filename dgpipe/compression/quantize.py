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

import numpy as np
import torch

from . import fused
from .base import MAX_NUMEL, Codec, Payload, check_params, check_tensor_specs, make_payload, register_codec
from .bitpack import CHUNK, pack_bits, pack_bits_into, packed_nbytes, unpack_bits
from .grouping import Grouping, round_meta

__all__ = [
    "UniformQuantizer",
    "BLOCK",
    "blocks",
    "encode_blocks",
    "decode_table",
    "flat_float32",
    "finite_range",
    "tame",
    "grid_step",
    "grid_divisor",
    "grid_levels",
    "grid_table",
    "grid_meta",
    "grouping_options",
    "GROUP_PARAM",
    "fused_uniform_encode",
    "fused_uniform_decode",
    "fused_encode",
    "fused_decode",
]


BLOCK = 1 << 18
"""Values per block of the per-value work on CPU: a block's temporaries stay in cache."""


def blocks(flat: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges covering ``flat`` (1-D): blocks of :data:`BLOCK` values on
    CPU -- about 2x faster there than whole-tensor passes -- and one range elsewhere
    (a GPU wants few, large kernels)."""
    n = flat.numel()
    step = BLOCK if flat.is_cpu else max(n, 1)
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


_HALF_MAX = float(2**127)
"""Magnitude below which a float32 difference ``hi - lo`` cannot overflow (half of float32's range)."""


def tame(*ends: np.ndarray | float) -> bool:
    """Whether the float32 arrays (or Python floats) ``ends`` are all finite and below :data:`_HALF_MAX`
    in magnitude, so that the differences of their values are finite: a check in numpy without an
    error-state context (whose own cost is a good part of a small message's); NaN fails it."""
    return all(abs(e) < _HALF_MAX if isinstance(e, float) else  # a Python comparison, no ufunc call
               abs(e.item()) < _HALF_MAX if e.size == 1 else e.size == 0 or float(np.abs(e).max()) < _HALF_MAX
               for e in ends)


def finite_range(lo: torch.Tensor, hi: torch.Tensor, codec_name: str) -> None:
    """Raise ``ValueError`` unless all ``lo``/``hi`` (range ends, float32) and ``hi - lo`` are finite.

    min/max propagate NaN and inf, so checking the ends checks every value they cover.
    """
    if lo.is_cpu and lo.dtype == hi.dtype == torch.float32 and tame(lo.detach().numpy(), hi.detach().numpy()):
        return  # numpy: a fraction of torch's per-call cost
    if bool(torch.isfinite(hi - lo).all()):
        return
    if not bool((torch.isfinite(lo) & torch.isfinite(hi)).all()):
        raise ValueError(
            f"{codec_name} codec got inf/NaN values; lossy quantizers refuse them: replace them "
            "first (e.g. torch.nan_to_num) or send this tensor with codec 'none' or 'fp16'"
        )
    raise ValueError(f"{codec_name} codec got a value range wider than float32 can hold (max - min overflows)")


def grid_step(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    """Step of the uniform grid of ``levels`` points from ``lo`` to ``hi`` (float32, same shape;
    torch tensors or numpy arrays, the same float32 division)."""
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
    """``step`` with its zeros (constant ranges) replaced by 1: the ``div`` of :func:`grid_levels`
    (a torch tensor, or a float32 numpy array for a numpy one)."""
    if isinstance(step, np.ndarray):
        return np.where(step > 0, step, np.float32(1.0))
    if step.is_cpu and step.dtype == torch.float32:  # numpy: a fraction of torch's per-call cost
        return torch.from_numpy(grid_divisor(step.detach().numpy()))
    return torch.where(step > 0, step, 1.0)


def grid_table(lo: torch.Tensor, step: torch.Tensor, levels: int) -> torch.Tensor:
    """Decoded value of every code: ``lo[g] + k * step[g]`` at ``g * levels + k`` (1-D float32)."""
    k = torch.arange(levels, dtype=torch.float32, device=lo.device)
    return (lo[:, None] + k * step[:, None]).reshape(-1)


_NUMPY_DTYPES = {torch.uint8: np.uint8, torch.float32: np.float32}


def _empty(n: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``n`` values on ``like``'s device: allocated by numpy on CPU (cheaper per
    call), by torch elsewhere."""
    if like.is_cpu:
        return torch.from_numpy(np.empty(n, _NUMPY_DTYPES[dtype]))
    return torch.empty(n, dtype=dtype, device=like.device)


def fused_encode(
    values: torch.Tensor, bits: int, kernel: Callable[[torch.Tensor], bool], tail: Callable[[int], torch.Tensor]
) -> torch.Tensor | None:
    """Packed codes of ``values`` (1-D float32, wire order): the whole chunks from a :mod:`.fused`
    kernel, the ``n % CHUNK`` tail eager; None where the kernel does not apply (the caller encodes eagerly).

    Args:
        values: the values to code.
        bits: code width.
        kernel: ``kernel(out)`` packs the whole chunks into ``out`` (uint8, the full stream),
            returns False if it did not apply.
        tail: ``tail(start)`` gives the integer codes of ``values[start:]`` (``start`` a multiple of CHUNK).
    """
    n = values.numel()
    if not fused.wanted(values):
        return None
    out = _empty(packed_nbytes(n, bits), torch.uint8, values)
    if not kernel(out):
        return None
    return pack_tail(out, n, bits, tail)


def pack_tail(out: torch.Tensor, n: int, bits: int, tail: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Complete ``out``, a uint8 stream of ``n`` codes of ``bits`` bits whose whole chunks a kernel
    packed, with the ``n % CHUNK`` tail codes ``tail(start)`` (eager); returns ``out``."""
    full = n - n % CHUNK
    if full < n:
        pack_bits_into(out, tail(full), bits, n, full, check=False)
    return out


def fused_uniform_encode(
    values: torch.Tensor, lo32: torch.Tensor, div: torch.Tensor, bits: int, group_len: int
) -> torch.Tensor | None:
    """The packed codes of :func:`grid_levels` (to nearest) from :func:`.fused.encode_uniform`, or None.

    ``values``: 1-D float32 in wire order (:meth:`.grouping.Grouping.sent`: group ``i``
    is the values ``i * group_len ..`` for every grouping); ``lo32``/``div``: float32,
    one per group. The bytes are those of the eager path.
    """
    n = values.numel()

    def tail(start: int) -> torch.Tensor:
        grp = torch.arange(start, n) // group_len
        lo, d = lo32.reshape(-1)[grp], div.reshape(-1)[grp]
        return grid_levels(values[start:] - lo, d, 1 << bits, False).to(torch.int32)

    return fused_encode(values, bits, lambda out: fused.encode_uniform(values, lo32, div, bits, group_len, out), tail)


def fused_decode(
    packed: torch.Tensor, n: int, kernel: Callable[[torch.Tensor], bool], tail: Callable[[int], torch.Tensor]
) -> torch.Tensor | None:
    """``n`` decoded values (1-D float32, wire order): the whole chunks from a :mod:`.fused` kernel,
    the ``n % CHUNK`` tail eager; None where the kernel does not apply (the caller decodes eagerly).

    Args:
        packed: the uint8 code stream.
        n: number of codes.
        kernel: ``kernel(y)`` writes the whole chunks into ``y`` (float32 ``(n,)``), returns False
            if it did not apply.
        tail: ``tail(start)`` gives the values of codes ``start .. n`` (``start`` a multiple of CHUNK).
    """
    if not fused.wanted(packed, n):
        return None
    y = _empty(n, torch.float32, packed)
    if not kernel(y):
        return None
    full = n - n % CHUNK
    if full < n:
        y[full:] = tail(full)
    return y


def fused_uniform_decode(
    packed: torch.Tensor, bits: int, n: int, lo: torch.Tensor, step: torch.Tensor, group_len: int
) -> torch.Tensor | None:
    """``lo[g] + code * step[g]`` (1-D float32, wire order) from :func:`.fused.decode_uniform`, or None."""

    def tail(start: int) -> torch.Tensor:
        grp = torch.arange(start, n) // group_len
        codes = unpack_bits(packed, bits, n, start=start, dtype=torch.int32).to(torch.float32)
        return lo.reshape(-1)[grp] + codes * step.reshape(-1)[grp]

    return fused_decode(packed, n, lambda y: fused.decode_uniform(packed, bits, lo, step, group_len, y), tail)


#: Header param of the grouping options, after a codec's own (see :meth:`.grouping.Grouping.param`).
GROUP_PARAM = ("grouping", 0, (MAX_NUMEL << 15) | ((1 << 15) - 1))


def grouping_options(codec: str, group: str, group_size: int, axis: int, rotate: str, scale_dtype: str) -> Grouping:
    """The validated :class:`.grouping.Grouping` of a quantizer's keyword options.

    ``group_size > 0`` with the default ``group="tensor"`` means tiles (the original
    ``quant`` option). Raises ``ValueError`` naming ``codec`` for bad options.
    """
    if group == "tensor" and isinstance(group_size, int) and not isinstance(group_size, bool) and group_size > 0:
        group = "tile"
    return Grouping(group, group_size, axis, rotate, scale_dtype).validate(codec)


def grid_meta(
    lo: torch.Tensor, hi: torch.Tensor, levels: int, grouping: Grouping, codec: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group grid ``(lo, step)`` as sent (``grouping.meta_dtype``) and the float32 ``lo`` and divisor to code with.

    ``lo`` is rounded down and the step up (:func:`.grouping.round_meta`), so the grid
    ``lo + k * step``, ``k < levels``, still covers ``[lo, hi]``.

    Returns:
        ``(meta, lo32, div32)``: ``meta`` 1-D ``cat(lo, step)`` in the metadata dtype;
        ``lo32``/``div32`` float32 of ``lo``'s shape (:func:`grid_divisor`).
    """
    if grouping.meta_dtype == lo.dtype == hi.dtype == torch.float32 and lo.is_cpu:
        lo32, hi32 = lo.detach().numpy(), hi.detach().numpy()
        if tame(lo32, hi32):  # numpy: a fraction of torch's per-call cost
            step = grid_step(lo32, hi32, levels)
            meta = torch.from_numpy(np.concatenate((lo32.reshape(-1), step.reshape(-1))))
            return meta, lo.detach(), torch.from_numpy(grid_divisor(step))
    lo_m = round_meta(lo, grouping.meta_dtype, False, "min", codec)
    lo32 = lo_m.float()
    step_m = round_meta(grid_step(lo32, hi, levels), grouping.meta_dtype, True, "step", codec)
    return torch.cat((lo_m.reshape(-1), step_m.reshape(-1))), lo32, grid_divisor(step_m.float())


@register_codec("quant", 3)
class UniformQuantizer(Codec):
    """Uniform min-max quantization to ``bits`` bits per value, per tensor or per group.

    Args:
        bits: bits per value, 1..16 (``2**bits`` levels from a group's min to its max).
        stochastic: unbiased stochastic rounding (error < one step) instead of
            rounding to nearest (error <= half a step).
        group: ``tensor`` (one min/step), ``token``, ``channel`` or ``tile``
            (:mod:`.grouping`): one min/step per group, so that an outlier only coarsens
            its own group (per-group ranges as in ActNN, Chen et al. ICML 2021, and
            AQ-SGD, Wang et al. NeurIPS 2022).
        group_size: values per tile (``group="tile"``); ``group_size > 0`` alone also
            selects tiles.
        axis: the channel axis of ``group="channel"`` (-1: last).
        rotate: ``none`` or ``hadamard``: a random-sign Hadamard rotation of the last
            axis before quantizing, inverted after decoding (:mod:`.hadamard`).
        scale_dtype: ``float32`` (default), ``float16`` or ``bfloat16``: dtype of the
            per-group min and step on the wire.

    Input: a floating tensor (float32/float16/bfloat16/float64), any shape, any device;
    computed in float32. Decode returns the original shape, dtype and device.

    Wire: codes bit-packed at ``bits`` bits, plus ``(min, step)`` per group::

        nbytes = ceil(n_sent * bits / 8) + 2 * n_groups * sizeof(scale_dtype) + header bytes

    ``n_sent`` is the number of values, or with a padded rotation (:mod:`.hadamard`)
    the padded count; ``n_groups`` from :meth:`.grouping.Grouping.counts`.

    Raises (encode):
        ValueError: non-floating input, inf/NaN values, a range overflowing float32 or
            a metadata value overflowing ``scale_dtype``; bad options at construction.
    """

    def __init__(self, bits: int = 8, stochastic: bool = False, group: str = "tensor", group_size: int = 0,
                 axis: int = -1, rotate: str = "none", scale_dtype: str = "float32") -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
            raise ValueError(f"quant: bits must be an int in [1, 16], got {bits!r}")
        self.bits, self.stochastic = bits, bool(stochastic)
        self.grouping = grouping_options(self.name, group, group_size, axis, rotate, scale_dtype)

    def encode(self, x: torch.Tensor) -> Payload:
        flat = flat_float32(x, self.name)
        gp, levels, shape = self.grouping, 1 << self.bits, tuple(x.shape)
        ng, _, n_sent = gp.counts(shape)
        fast = self._encode_message(flat) if gp.plain and not self.stochastic and n_sent else None
        if fast is not None:
            meta, packed = fast
        elif n_sent == 0:
            packed, meta = flat.to(torch.uint8), flat.to(gp.meta_dtype)
        else:
            rows = gp.rows(flat.view(shape))
            if ng == 1:  # a whole-tensor reduction: several times faster than along dim 1 of one row
                lo, hi = (t.view(1, 1) for t in torch.aminmax(rows))
            else:
                lo, hi = torch.aminmax(rows, dim=1, keepdim=True)
            finite_range(lo, hi, self.name)
            meta, lo32, div = grid_meta(lo, hi, levels, gp, self.name)
            packed = self._pack(rows, lo32, div, shape)
        params = (self.bits, gp.param(len(shape)))
        return make_payload(self.codec_id, x.dtype, x.shape, params, (packed, meta))

    def _encode_message(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(meta, packed)`` of a plain tensor from :func:`.fused.uniform_message` (one call after the
        range), or None where that does not apply.

        Raises:
            ValueError: inf/NaN values or a range overflowing float32.
        """
        if not fused.one_call(flat):
            return None
        lo, hi = torch.aminmax(flat)
        a, b = lo.item(), hi.item()
        if not tame(a, b):
            finite_range(lo, hi, self.name)  # raises
        return fused.uniform_message(flat, a, b, self.bits)

    def _pack(self, rows: torch.Tensor, lo32: torch.Tensor, div: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Packed codes of the non-empty ``rows``: the fused kernel where it applies, else eager block by block.

        In wire order (:meth:`.grouping.Grouping.sent`) group ``i`` is the values
        ``i * group_len ..`` for every grouping, so the fused kernel takes them all.
        """
        gp, levels = self.grouping, 1 << self.bits
        ng, g, _ = gp.counts(shape)
        if not self.stochastic:
            packed = fused_uniform_encode(gp.sent(rows, shape), lo32, div, self.bits, g)
            if packed is not None:
                return packed
        if ng == 1:
            values = gp.sent(rows, shape)
            return encode_blocks(
                values,
                self.bits,
                lambda i, j: grid_levels(values[i:j] - lo32[0], div[0], levels, self.stochastic).to(torch.int32),
            )
        codes = grid_levels(rows - lo32, div, levels, self.stochastic).to(torch.int32)
        return pack_bits(gp.sent(codes, shape), self.bits, check=False)

    def decode(self, payload: Payload) -> torch.Tensor:
        h = self.parse(payload)
        bits, group_param = check_params(h, ("bits", 1, 16), GROUP_PARAM)
        gp = Grouping.from_param(group_param, h.shape, self.name)
        ng, g, n_sent = gp.counts(h.shape)
        check_tensor_specs(h, ("codes", torch.uint8, packed_nbytes(n_sent, bits)), ("min/step", gp.meta_dtype, 2 * ng))
        packed, meta = payload.tensors
        if n_sent == 0:
            return meta.new_zeros(h.shape, dtype=h.dtype)
        values = fused.message_values(packed, bits, 0, meta, n_sent) if ng == 1 else None  # in wire order, one call
        if values is None:  # step by step
            lo, step = meta[:ng].float(), meta[ng:].float()
            values = fused_uniform_decode(packed, bits, n_sent, lo, step, g)  # in wire order, as gp.sent gives
        if values is None and ng == 1:  # one grid: a table lookup per value
            values = decode_table(packed, bits, n_sent, grid_table(lo, step, 1 << bits))
        elif values is None:
            codes = gp.unsent(unpack_bits(packed, bits, n_sent, dtype=torch.int32).to(torch.float32), h.shape)
            values = gp.sent(lo[:, None] + codes * step[:, None], h.shape)  # as the table: multiply, then add
        return gp.restore(values, h.shape).to(h.dtype)
