"""The uniform grid steps: values -> levels on ``lo + k * step`` -> packed codes, and back.

A value ``x`` of a group with range ``[lo, hi]`` becomes the level
``clamp(round((x - lo) / step), 0, levels - 1)`` with ``step = (hi - lo) / (levels - 1)``
(:func:`grid_levels`; with ``stochastic`` ``floor((x - lo) / step + u)``, ``u ~ U[0, 1)``:
Gupta et al. 2015, Alistarh et al. 2017), and decodes to ``lo + level * step``.

Steps (each returns its result, whichever backend ran it, :mod:`.backend`):

- :func:`uniform_codes`: the packed codes of values in wire order, a grid per run of
  ``group_len`` values;
- :func:`uniform_values`: their decoded values from the metadata as sent;
- :func:`uniform_message`: one group's grid (from its range) and codes -- for a small CPU
  message in one compiled call (:func:`.compiled.uniform_message`), on the GPU in two launches that
  read nothing back (:func:`.triton_codes.encode_message`); :func:`finite_grid`, the decoder's check
  of a grid received.

The reference is whole-block torch ops, block by block on CPU (:func:`blocks`); C
(:mod:`.compiled`) and Triton (:mod:`.triton_codes`) compute the whole chunks, the
reference the ``n % CHUNK`` tail. Same bytes everywhere (golden payloads).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from . import compiled, compiled_grid, deferred
from .backend import empty
from .dispatch import choose, kernels_of
from .bitpack import CHUNK, pack_bits, pack_bits_into, packed_nbytes, unpack_bits

__all__ = [
    "BLOCK", "blocks", "tame", "finite_range", "range_of", "values_tail", "encode_blocks", "decode_table", "pack_tail",
    "NOT_FINITE", "finite_grid", "divide", "grid_step", "grid_divisor", "grid_levels",
    "grid_table", "in_groups", "uniform_codes", "uniform_values", "uniform_message",
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


def pack_tail(out: torch.Tensor, n: int, bits: int, tail: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Complete ``out``, a uint8 stream of ``n`` codes of ``bits`` bits whose whole chunks a kernel
    packed, with the ``n % CHUNK`` tail codes ``tail(start)``; returns ``out``."""
    full = n - n % CHUNK
    if full < n:
        pack_bits_into(out, tail(full), bits, n, full, check=False)
    return out


def values_tail(y: torch.Tensor, tail: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Complete ``y`` (float32 ``(n,)``), whose whole chunks a kernel wrote, with the values ``tail(start)`` of
    the ``n % CHUNK`` last codes; returns ``y``."""
    n = y.numel()
    full = n - n % CHUNK
    if full < n:
        y[full:] = tail(full)
    return y


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

    min/max propagate NaN and inf, so checking the ends checks every value they cover. On CPU only: on
    another device the range is not read back (the host would wait); the grid it makes is then not finite,
    and the decoder refuses it (:func:`finite_grid`).
    """
    if not deferred.on_host(lo):
        return
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


def range_of(flat: torch.Tensor, codec_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``: 0-d float32 min (a zero as ``+0.0``) and max of the 1-D float32 ``flat``, ``n >= 1``.

    Raises:
        ValueError: ``flat`` holds inf or NaN (:func:`finite_range`) -- on CPU. On a GPU the range is not read
            back (the host would wait): the grid it makes is not finite, and the decoder refuses it
            (:func:`finite_grid`).
    """
    lo, hi = torch.aminmax(flat)
    finite_range(lo, hi, codec_name)
    return lo + 0.0, hi


def divide(t, k: int):
    """``t / k`` correctly rounded (IEEE division) on every device: torch tensors or numpy arrays.

    On a GPU, torch divides a tensor by a host number as a multiplication by its reciprocal, which
    rounds differently now and then: there the divisor is a tensor of the same device."""
    if isinstance(t, torch.Tensor) and not t.is_cpu:
        return t / torch.full_like(t, k)
    return t / k


def grid_step(lo, hi, levels: int):
    """Step of the uniform grid of ``levels`` points from ``lo`` to ``hi`` (float32, same shape;
    torch tensors or numpy arrays, the same IEEE float32 division everywhere: :func:`divide`)."""
    return divide(hi - lo, levels - 1)


def grid_divisor(step):
    """``step`` with its zeros (constant ranges) replaced by 1: the ``div`` of :func:`grid_levels`
    (a torch tensor, or a float32 numpy array for a numpy one)."""
    if isinstance(step, np.ndarray):
        return np.where(step > 0, step, np.float32(1.0))
    if step.is_cpu and step.dtype == torch.float32:  # numpy: a fraction of torch's per-call cost
        return torch.from_numpy(grid_divisor(step.detach().numpy()))
    return torch.where(step > 0, step, 1.0)


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


def grid_table(lo: torch.Tensor, step: torch.Tensor, levels: int) -> torch.Tensor:
    """Decoded value of every code: ``lo[g] + k * step[g]`` at ``g * levels + k`` (1-D float32)."""
    k = torch.arange(levels, dtype=torch.float32, device=lo.device)
    return (lo[:, None] + k * step[:, None]).reshape(-1)


def in_groups(values: torch.Tensor, group_len: int) -> torch.Tensor:
    """``values`` (1-D, wire order) as ``(n_groups, group_len)`` rows, the last one padded with its last value
    (a short last tile: the padding is dropped again after the per-group arithmetic)."""
    n = values.numel()
    ng = -(-n // group_len)
    if ng * group_len != n:
        values = torch.cat((values, values[-1:].expand(ng * group_len - n)))
    return values.view(ng, group_len)


def _reference_codes(values: torch.Tensor, lo: torch.Tensor, div: torch.Tensor, bits: int, group_len: int,
                     stochastic: bool) -> torch.Tensor:
    levels, n = 1 << bits, values.numel()
    lo, div = lo.reshape(-1), div.reshape(-1)
    if group_len >= n:  # one grid: block by block
        return encode_blocks(values, bits,
                             lambda i, j: grid_levels(values[i:j] - lo[0], div[0], levels, stochastic).to(torch.int32))
    rows = in_groups(values, group_len)
    codes = grid_levels(rows - lo[:, None], div[:, None], levels, stochastic).to(torch.int32)
    return pack_bits(codes.reshape(-1)[:n], bits, check=False)


def uniform_codes(values: torch.Tensor, lo: torch.Tensor, div: torch.Tensor, bits: int, group_len: int,
                  stochastic: bool = False) -> torch.Tensor:
    """Packed codes :func:`grid_levels` of ``values``, a grid per group.

    Args:
        values: 1-D float32, ``n >= 1`` values in wire order; group ``i // group_len`` holds value ``i``.
        lo, div: float32, one per group: the grid start and divisor (:func:`grid_divisor`).
        bits: code width, 1..16.
        group_len: values per group (``>= n`` for one group).
        stochastic: stochastic rounding (the reference runs it).

    Returns:
        uint8 ``(ceil(n * bits / 8),)``, the :mod:`.bitpack` stream, on ``values``' device.
    """
    backend = "torch" if stochastic else choose(values)
    if backend != "torch":
        n = values.numel()
        out = empty(packed_nbytes(n, bits), torch.uint8, values)
        if kernels_of(backend).encode_uniform(values, lo, div, bits, group_len, out):
            lo, div = lo.reshape(-1), div.reshape(-1)
            return pack_tail(out, n, bits, lambda start: _tail_codes(values, lo, div, bits, group_len, start))
    return _reference_codes(values, lo, div, bits, group_len, stochastic)


def _tail_codes(values: torch.Tensor, lo: torch.Tensor, div: torch.Tensor, bits: int, group_len: int,
                start: int) -> torch.Tensor:
    """The int32 codes of ``values[start:]`` (reference arithmetic), each with its group's grid."""
    grp = torch.arange(start, values.numel(), device=values.device) // group_len
    return grid_levels(values[start:] - lo[grp], div[grp], 1 << bits, False).to(torch.int32)


def uniform_values(packed: torch.Tensor, bits: int, n: int, meta: torch.Tensor, n_groups: int,
                   group_len: int) -> torch.Tensor:
    """Decoded values ``lo[g] + code * step[g]`` of ``n`` codes (1-D float32, wire order).

    Args:
        packed: uint8 stream of ``n >= 1`` codes of ``bits`` bits.
        meta: ``cat(lo, step)`` as sent, ``2 * n_groups`` values (any float dtype; computed in float32).
        n_groups, group_len: the grouping (group ``i // group_len`` holds value ``i``).
    """
    backend = choose(packed, n)
    if backend == "c" and n_groups == 1:  # a small message in one call, where that applies
        y = compiled.message_values(packed, bits, 0, meta, n)
        if y is not None:
            return y
    lo, step = meta[:n_groups].float(), meta[n_groups:].float()
    if backend != "torch":
        y = empty(n, torch.float32, packed)
        if kernels_of(backend).decode_uniform(packed, bits, lo, step, group_len, y):
            return values_tail(y, lambda start: _tail_values(packed, bits, n, lo, step, group_len, start))
    if n_groups == 1:  # one grid: a table lookup per value
        return decode_table(packed, bits, n, grid_table(lo, step, 1 << bits))
    codes = in_groups(unpack_bits(packed, bits, n, dtype=torch.int32).to(torch.float32), group_len)
    return (lo[:, None] + codes * step[:, None]).reshape(-1)[:n]  # as the table: multiply, then add


def _tail_values(packed: torch.Tensor, bits: int, n: int, lo: torch.Tensor, step: torch.Tensor, group_len: int,
                 start: int) -> torch.Tensor:
    grp = torch.arange(start, n, device=packed.device) // group_len
    codes = unpack_bits(packed, bits, n, start=start, dtype=torch.int32).to(torch.float32)
    return lo.reshape(-1)[grp] + codes * step.reshape(-1)[grp]


def uniform_message(values: torch.Tensor, bits: int, codec_name: str,
                    stochastic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One grid over all of ``values``, from their min and max: the metadata sent and the packed codes.

    Args:
        values: 1-D float32, ``n >= 1``.
        bits: code width, 1..16.
        codec_name: for the error message.
        stochastic: stochastic rounding.

    Returns:
        ``(meta, packed)``: float32 ``(2,)`` ``[lo, step]``, ``lo = min(values)``,
        ``step = (max(values) - lo) / (2**bits - 1)`` (a zero min or max as ``+0.0``), and the uint8 code
        stream (:func:`uniform_codes`). On the CPU the range is one compiled pass
        (:func:`.compiled_grid.value_range`), and a small message's grid and codes one more call; on the GPU,
        two kernel launches that read nothing back to the host (:func:`.triton_codes.encode_message`).

    Raises:
        ValueError: the range is not finite (:func:`finite_range`) -- except on the GPU path, which does
            not read the range back: there the grid sent is not finite, and the decoder refuses it
            (:func:`finite_grid`).
    """
    backend = "torch" if stochastic else choose(values)
    if backend == "triton":
        done = kernels_of(backend).encode_message(values, bits)
        if done is not None:
            grid, out = done
            n = values.numel()
            return grid[:2], pack_tail(out, n, bits, lambda start: _tail_codes(values, grid[:1], grid[2:], bits, n,
                                                                                start))
    found = compiled_grid.value_range(values.detach().numpy()) if backend == "c" and values.is_contiguous() else None
    if found is None:
        lo, hi = torch.aminmax(values)
        lo, hi = lo + 0.0, hi + 0.0  # a zero as +0.0: which zero a min or max keeps depends on the order
        finite_range(lo, hi, codec_name)
        if not values.is_cpu:
            step = grid_step(lo.reshape(1), hi.reshape(1), 1 << bits)
            meta, div = torch.cat((lo.reshape(1), step)), grid_divisor(step)
            return meta, uniform_codes(values, meta[:1], div, bits, values.numel(), stochastic)
        a, b = lo.detach().numpy().reshape(1), hi.detach().numpy().reshape(1)  # numpy: a fraction of torch's cost
    else:
        lo_f, hi_f = float(found[0]) + 0.0, float(found[1]) + 0.0  # exact: a float32 as a Python float
        if not tame(lo_f, hi_f):
            finite_range(torch.tensor(lo_f), torch.tensor(hi_f), codec_name)  # raises
        if compiled.one_call(values):
            done = compiled.uniform_message(values, lo_f, hi_f, bits)
            if done is not None:
                return done
        a, b = np.array([lo_f], np.float32), np.array([hi_f], np.float32)
    step = grid_step(a, b, 1 << bits)
    meta, div = torch.from_numpy(np.concatenate((a, step))), torch.from_numpy(grid_divisor(step))
    return meta, uniform_codes(values, meta[:1], div, bits, values.numel(), stochastic)


NOT_FINITE = ("{} payload has a grid that is not finite: the sender's values held inf/NaN, a range wider than "
              "float32 can hold or a group parameter past its scale_dtype; replace them first (e.g. "
              "torch.nan_to_num), use scale_dtype='float32', or send that tensor with codec 'none' or 'fp16'")
"""The decoder's refusal of a grid or scales that are not finite (formatted with the codec's name)."""


def finite_grid(meta: torch.Tensor, codec_name: str) -> None:
    """Refuse a received grid -- ``lo`` and ``step`` per group, or scales; any float dtype -- unless every value is
    finite: the check of a sender that did not check its range (an encoder off the CPU reads nothing back). On
    CPU a numpy test, raising now; on another device ``meta`` is kept and checked at the runtime's next wait
    (:func:`.deferred.refuse_unless`, :func:`.deferred.raise_deferred`), so the decoder neither waits nor
    launches a kernel for it.

    Raises:
        ValueError: :data:`NOT_FINITE` -- on CPU here, elsewhere from :func:`.deferred.raise_deferred`.
    """
    if deferred.on_host(meta) and (meta.dtype == torch.float32 and tame(meta.detach().numpy())
                                   or bool(torch.isfinite(meta).all())):
        return  # the message is made only for a refusal
    deferred.refuse_unless(meta, NOT_FINITE.format(codec_name))
