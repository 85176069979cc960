"""Groups and their metadata: the ``transform`` and ``grouping`` steps shared by the quantizers.

A quantizer gives each *group* of values its own scale (uniform: min and step; sort
quantization: min and step per bucket; codebook: an RMS scale), so that an outlier only
coarsens its own group. :class:`Grouping` is that choice, validated once and carried in
the wire header as one integer (:meth:`Grouping.param`); :meth:`Grouping.rows` turns
a tensor into a 2-D ``(n_groups, group_len)`` view (after an optional Hadamard rotation
of the last axis, :mod:`.hadamard`) and :meth:`Grouping.restore` undoes it.

Groups (``x`` of shape ``(..., d)``, after the rotation when there is one):

- ``tensor``: one group, all values;
- ``token``: one group per vector along the last axis (per token of a ``(batch, length,
  hidden)`` hidden state; per image row of an NCHW map) -- ``numel / d`` groups of ``d``;
- ``channel``: one group per index of ``axis`` (default -1: per hidden feature of a
  transformer; ``axis=1`` per channel of an NCHW map);
- ``tile``: ``group_size`` consecutive values of the flattened tensor (the last tile may
  be shorter; it is padded with its last value, which is not sent).

Codes go on the wire in group order (row after row of :meth:`Grouping.rows`).

Per-group metadata travels as ``scale_dtype`` (float32, float16 or bfloat16) and is
counted in the payload bytes. Narrow dtypes are rounded *outward* (:func:`round_meta`:
a group's min down, its step or scale up), so the grid still covers the group and the
error bound of the quantizer still holds, only a little coarser; a value that overflows
the dtype is refused with a ``ValueError`` naming the option to change. bfloat16 has
float32's range (gradients of 1e-9 keep their scale; float16 flushes them below 6e-8
and refuses ranges over 65504); float16 has 3 more bits of precision.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..base import DTYPE_CODES, MAX_NUMEL, MAX_NDIM, dtype_from_code
from ..kernels import deferred
from .hadamard import HadamardRotation

__all__ = ["GROUPS", "SCALE_DTYPES", "Grouping", "round_meta"]

GROUPS = ("tensor", "token", "channel", "tile")
"""Group kinds, in the order of their wire codes (0..3)."""
SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""Metadata dtypes a codec may send its per-group parameters in."""
ROTATIONS = ("none", "hadamard")


def round_meta(t: torch.Tensor, dtype: torch.dtype, up: bool, what: str, codec: str) -> torch.Tensor:
    """``t`` (float32) cast to ``dtype``, rounded towards +inf (``up``) or -inf.

    Returns:
        a ``dtype`` tensor ``r`` with ``r >= t`` (``up``) or ``r <= t`` elementwise.

    Raises:
        ValueError: a value overflows ``dtype`` (names ``what``, the codec and the fix) -- on CPU. On another
            device nothing is read back (the host would wait): an overflow is sent as inf, and the decoder
            refuses it (:func:`..kernels.finite_grid`).
    """
    r = t.to(dtype)
    if dtype != torch.float32:
        wrong = r.float() < t if up else r.float() > t
        if not deferred.on_host(t) or bool(wrong.any()):
            r = torch.where(wrong, torch.nextafter(r, torch.full_like(r, math.inf if up else -math.inf)), r)
    if deferred.on_host(t) and not bool(torch.isfinite(r).all()):
        raise ValueError(f"{codec}: a per-group {what} of up to {t.abs().max().item():.4g} overflows scale_dtype "
                         f"{str(dtype).removeprefix('torch.')}; use scale_dtype='bfloat16' or 'float32'")
    return r


@dataclass(frozen=True)
class Grouping:
    """How a quantizer cuts a tensor into groups, and what its metadata is sent as.

    Args:
        group: ``tensor``, ``token``, ``channel`` or ``tile`` (module docstring).
        group_size: values per tile (``group="tile"`` only; > 0).
        axis: the channel axis (``group="channel"`` only), e.g. -1 or 1.
        rotate: ``none`` or ``hadamard`` (:class:`.hadamard.HadamardRotation` of the last axis).
        scale_dtype: ``float32``, ``float16`` or ``bfloat16``: dtype of per-group metadata.

    Raises:
        ValueError: an unknown group, rotation or dtype, a tile size for a non-tile group
            or a missing one for a tile group.
    """

    group: str = "tensor"
    group_size: int = 0
    axis: int = -1
    rotate: str = "none"
    scale_dtype: str = "float32"

    def validate(self, codec: str) -> "Grouping":
        """Check the options (errors name ``codec``); returns self."""
        if self.group not in GROUPS:
            raise ValueError(f"{codec}: group must be one of {GROUPS}, got {self.group!r}")
        size = self.group_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or size > MAX_NUMEL:
            raise ValueError(f"{codec}: group_size must be an int >= 1 for group='tile', got {size!r}")
        if (self.group == "tile") != (size > 0):
            raise ValueError(f"{codec}: group_size={size} goes with group='tile' only (and group='tile' needs "
                             f"group_size >= 1); got group={self.group!r}")
        if isinstance(self.axis, bool) or not isinstance(self.axis, int) or not -MAX_NDIM <= self.axis < MAX_NDIM:
            raise ValueError(f"{codec}: axis must be an int in [-{MAX_NDIM}, {MAX_NDIM}), got {self.axis!r}")
        if self.rotate not in ROTATIONS:
            raise ValueError(f"{codec}: rotate must be one of {ROTATIONS}, got {self.rotate!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"{codec}: scale_dtype must be one of {sorted(SCALE_DTYPES)}, got {self.scale_dtype!r}")
        return self

    @property
    def plain(self) -> bool:
        """One float32 group of the unrotated tensor: the codecs' original fast path."""
        return self.group == "tensor" and self.rotate == "none" and self.scale_dtype == "float32"

    @property
    def meta_dtype(self) -> torch.dtype:
        """Torch dtype of the per-group metadata."""
        return SCALE_DTYPES[self.scale_dtype]

    def param(self, ndim: int) -> int:
        """The options as one header integer (for a tensor of ``ndim`` dimensions).

        Bits 0-1: group (:data:`GROUPS` index); bit 2: rotate; bits 3-10: the wire code
        of ``scale_dtype``; bits 11-14: the channel axis (made >= 0 for ``ndim``; 0 for
        other groups); bits 15 and up: ``group_size``.
        """
        axis = self.axis % ndim if self.group == "channel" and ndim else 0
        return (GROUPS.index(self.group) | ROTATIONS.index(self.rotate) << 2 | DTYPE_CODES[self.meta_dtype] << 3
                | axis << 11 | self.group_size << 15)

    @classmethod
    def from_param(cls, param: int, shape: tuple[int, ...], codec: str) -> "Grouping":
        """Inverse of :meth:`param` for a decoded header of ``shape``.

        Raises:
            ValueError: ``corrupt header`` naming the option that is out of range.
        """
        return _grouping_of(cls, param, len(shape), codec)

    def rotation(self, shape: tuple[int, ...]) -> HadamardRotation | None:
        """The rotation of the last axis of ``shape`` (None without one)."""
        if self.rotate == "none":
            return None
        return HadamardRotation(shape[-1] if shape else 1)

    def rotated_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the tensor that is grouped: ``shape`` with the last axis at the rotation's width."""
        shape = tuple(shape) or (1,)  # a 0-d tensor is grouped as one value
        if math.prod(shape) == 0:
            return shape
        rot = self.rotation(shape)
        return shape if rot is None else (*shape[:-1], rot.width)

    def counts(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(n_groups, group_len, n_sent)`` for a tensor of ``shape``: ``n_sent`` values are coded.

        ``n_groups * group_len >= n_sent`` (equal except for a padded last tile).
        """
        rshape = self.rotated_shape(shape)
        n = math.prod(rshape)
        if n == 0:
            return 0, 0, 0
        if self.group == "tensor":
            return 1, n, n
        if self.group == "token":
            return n // rshape[-1], rshape[-1], n
        if self.group == "channel":
            c = rshape[self.axis % len(rshape)]
            return c, n // c, n
        g = self.group_size
        return -(-n // g), g, n

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (float32, any shape, non-empty) as ``(n_groups, group_len)`` float32 rows, rotated first.

        May be a view of ``x``: do not modify it in place.
        """
        if self.plain:
            return x.reshape(1, -1)
        shape = tuple(x.shape)
        rot = self.rotation(shape)
        y = x.reshape(-1, shape[-1] if shape else 1)
        if rot is not None:
            y = rot.forward(y)
        y = y.view(self.rotated_shape(shape))
        ng, g, n = self.counts(shape)
        if self.group == "channel":
            return y.movedim(self.axis % y.dim(), 0).reshape(ng, g)
        flat = y.reshape(-1)
        if ng * g != n:
            flat = torch.cat((flat, flat[-1:].expand(ng * g - n)))
        return flat.view(ng, g)

    def unsent(self, values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Inverse of :meth:`sent`: 1-D ``n_sent`` values -> ``(n_groups, group_len)`` rows (padding: zeros)."""
        ng, g, n = self.counts(shape)
        if ng * g != n:
            values = torch.nn.functional.pad(values, (0, ng * g - n))
        return values.view(ng, g)

    def sent(self, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The ``n_sent`` values of ``rows`` (any dtype) in wire order: 1-D, the tile padding dropped."""
        if self.plain:
            return rows.reshape(-1)
        return rows.reshape(-1)[: self.counts(shape)[2]]

    def restore(self, values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Inverse of :meth:`rows`: the 1-D ``n_sent`` float32 values in wire order -> a tensor of ``shape``."""
        if self.plain:
            return values.reshape(shape)
        rshape = self.rotated_shape(shape)
        if self.group == "channel":
            axis = self.axis % len(rshape)
            moved = (rshape[axis], *rshape[:axis], *rshape[axis + 1 :])
            y = values.view(moved).movedim(0, axis)
        else:
            y = values.view(rshape)
        rot = self.rotation(shape)
        if rot is not None:
            y = rot.inverse(y.reshape(-1, rot.width))
        return y.reshape(shape)


@functools.lru_cache(maxsize=256)
def _grouping_of(cls: type, param: int, ndim: int, codec: str) -> Grouping:
    """:meth:`Grouping.from_param` for a tensor of ``ndim`` dimensions, cached (a pipeline decodes
    the same header step after step; errors are raised, not cached)."""
    kind, rotate, dcode, axis, size = param & 3, param >> 2 & 1, param >> 3 & 255, param >> 11 & 15, param >> 15
    dtypes = {v: k for k, v in SCALE_DTYPES.items()}
    dt = dtype_from_code(dcode, "params (scale_dtype)")
    if dt not in dtypes or axis >= max(ndim, 1):
        bad = "scale_dtype" if dt not in dtypes else "axis"
        raise ValueError(f"corrupt header: field 'params' (grouping: {bad}) of {codec} is out of range")
    try:
        return cls(GROUPS[kind], size, axis, ROTATIONS[rotate], dtypes[dt]).validate(codec)
    except ValueError as e:
        raise ValueError(f"corrupt header: field 'params' (grouping) of {codec}: {e}") from None
