"""Codec protocol, the wire ``Payload``, its integer header, and the codec registry.

A codec turns a tensor into a :class:`Payload` -- a few plain tensors plus an integer
header -- and back. Nothing here is pickled: a payload crosses the wire as tensors
only (see :mod:`dgpipe.comm.transport`), and every header field is validated on
decode, raising :class:`ValueError` that names the field.

Header layout (one 1-D ``torch.int64`` tensor, on CPU)::

    [MAGIC, codec_id, dtype_code, ndim, *shape,            # what decode returns
     n_params, *params,                                    # codec-specific integers
     n_tensors, *(dtype_code, numel) for each tensor]      # what follows on the wire

Usage::

    from dgpipe.compression import get_codec
    codec = get_codec("sortquant", quant_bits=6, split_bits=2)
    payload = codec.encode(x)      # x: floating tensor, any shape, CPU or CUDA
    payload.nbytes                 # exact wire bytes, header included
    y = codec.decode(payload)      # same shape, dtype and device as x
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = [
    "MAGIC",
    "MAX_NDIM",
    "MAX_NUMEL",
    "Codec",
    "Header",
    "Payload",
    "DTYPE_CODES",
    "dtype_from_code",
    "code_from_dtype",
    "make_payload",
    "parse_header",
    "check_tensors",
    "check_params",
    "check_tensor_specs",
    "register_codec",
    "get_codec",
    "available_codecs",
    "codec_name_for_id",
]

MAGIC = 0x64677031  # "dgp1"
MAX_NDIM = 16
MAX_NUMEL = 1 << 40
MAX_PARAMS = 64
MAX_TENSORS = 64

# Stable wire codes for dtypes. Never renumber: they are part of the wire format.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
_CODE_TO_DTYPE = {v: k for k, v in DTYPE_CODES.items()}


def code_from_dtype(dtype: torch.dtype) -> int:
    """Wire code of ``dtype``; raises ``ValueError`` for dtypes the wire cannot carry."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be sent; supported: {sorted(map(str, DTYPE_CODES))}") from None


def dtype_from_code(code: int, field: str = "dtype") -> torch.dtype:
    """Inverse of :func:`code_from_dtype`; raises ``ValueError`` naming ``field``."""
    try:
        return _CODE_TO_DTYPE[int(code)]
    except KeyError:
        raise ValueError(f"corrupt header: field {field!r} has unknown dtype code {int(code)}") from None


@dataclass(frozen=True)
class Header:
    """Parsed, validated header fields.

    Attributes:
        codec_id: registry id of the codec that made the payload.
        dtype: dtype of the original (and decoded) tensor.
        shape: shape of the original tensor.
        params: codec-specific integers (bits, seeds, counts ...).
        tensor_specs: ``(dtype, numel)`` of each payload tensor, in order.
    """

    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: tuple[int, ...]
    tensor_specs: tuple[tuple[torch.dtype, int], ...]

    @property
    def numel(self) -> int:
        """Number of values in the original tensor."""
        return math.prod(self.shape)


@dataclass
class Payload:
    """What one encoded tensor puts on the wire.

    Attributes:
        header: 1-D ``torch.int64`` CPU tensor (layout in the module docstring).
        tensors: flat (1-D) tensors, e.g. packed codes as ``uint8`` and per-bucket
            parameters as ``float32``; on the device of the encoded tensor.
    """

    header: torch.Tensor
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Exact bytes this payload puts on the wire (header and all tensors)."""
        return self.header.numel() * self.header.element_size() + sum(
            t.numel() * t.element_size() for t in self.tensors
        )

    def to(self, device: torch.device | str) -> "Payload":
        """The same payload with its tensors on ``device`` (the header stays on CPU)."""
        return Payload(self.header, tuple(t.to(device) for t in self.tensors))


def make_payload(
    codec_id: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    params: Sequence[int],
    tensors: Sequence[torch.Tensor],
) -> Payload:
    """Build a :class:`Payload` with a header describing ``shape``/``dtype``/``tensors``.

    Args:
        codec_id: id of the encoding codec (see :func:`register_codec`).
        dtype: dtype of the original tensor (decode restores it).
        shape: shape of the original tensor.
        params: codec-specific integers, at most 64.
        tensors: payload tensors; they are flattened (made contiguous, 1-D).
    """
    flat = tuple(t if t.dim() == 1 else t.reshape(-1) for t in tensors)
    fields = [MAGIC, codec_id, code_from_dtype(dtype), len(shape), *shape, len(params), *params, len(flat)]
    for t in flat:
        fields += [code_from_dtype(t.dtype), t.numel()]
    return Payload(torch.from_numpy(np.array(fields, dtype=np.int64)), flat)  # numpy: ~3x faster than torch.tensor


def parse_header(header: torch.Tensor, expected_codec_id: int | None = None) -> Header:
    """Validate and parse a header tensor.

    Args:
        header: 1-D integer tensor as built by :func:`make_payload`.
        expected_codec_id: if given, the ``codec_id`` field must equal it.

    Raises:
        ValueError: naming the field that is missing, out of range or inconsistent.
    """
    if not isinstance(header, torch.Tensor) or header.dim() != 1 or header.dtype != torch.int64:
        raise ValueError("corrupt header: field 'header' must be a 1-D int64 tensor")
    return _parse_fields(tuple(header.tolist()), expected_codec_id)


@functools.lru_cache(maxsize=1024)
def _parse_fields(h: tuple[int, ...], expected_codec_id: int | None) -> Header:
    """:func:`parse_header` of the header's integers, cached: a pipeline receives the same few
    headers step after step (errors are raised, not cached; at most 1024 entries, whatever a
    peer sends)."""
    pos = 0

    def take(field: str, lo: int, hi: int) -> int:
        nonlocal pos
        if pos >= len(h):
            raise ValueError(f"corrupt header: truncated before field {field!r}")
        v = h[pos]
        pos += 1
        if not lo <= v <= hi:
            raise ValueError(f"corrupt header: field {field!r} = {v} outside [{lo}, {hi}]")
        return v

    take("magic", MAGIC, MAGIC)
    codec_id = take("codec_id", 0, 1 << 16)
    if expected_codec_id is not None and codec_id != expected_codec_id:
        raise ValueError(
            f"corrupt header: field 'codec_id' = {codec_id} ({codec_name_for_id(codec_id)}) "
            f"but this codec is {expected_codec_id} ({codec_name_for_id(expected_codec_id)})"
        )
    dtype = dtype_from_code(take("dtype", 0, 255))
    ndim = take("ndim", 0, MAX_NDIM)
    shape = tuple(take(f"shape[{i}]", 0, MAX_NUMEL) for i in range(ndim))
    if math.prod(shape) > MAX_NUMEL:
        raise ValueError(f"corrupt header: field 'shape' has {math.prod(shape)} values, over {MAX_NUMEL}")
    n_params = take("n_params", 0, MAX_PARAMS)
    params = tuple(take(f"params[{i}]", -(1 << 62), 1 << 62) for i in range(n_params))
    n_tensors = take("n_tensors", 0, MAX_TENSORS)
    specs = []
    for i in range(n_tensors):
        dt = dtype_from_code(take(f"tensors[{i}].dtype", 0, 255), f"tensors[{i}].dtype")
        specs.append((dt, take(f"tensors[{i}].numel", 0, MAX_NUMEL)))
    if pos != len(h):
        raise ValueError(f"corrupt header: {len(h) - pos} trailing fields after 'tensors'")
    return Header(codec_id, dtype, shape, params, tuple(specs))


def check_tensors(header: Header, tensors: Sequence[torch.Tensor]) -> None:
    """Check that ``tensors`` match the header's ``(dtype, numel)`` list.

    Raises:
        ValueError: naming the first mismatching tensor field.
    """
    if len(tensors) != len(header.tensor_specs):
        raise ValueError(f"corrupt payload: field 'n_tensors' = {len(header.tensor_specs)} but {len(tensors)} tensors")
    for i, (t, (dt, n)) in enumerate(zip(tensors, header.tensor_specs)):
        if t.dtype != dt or t.numel() != n:
            raise ValueError(
                f"corrupt payload: field 'tensors[{i}]' expected {dt}[{n}], got {t.dtype}[{t.numel()}]"
            )


def check_params(header: Header, *fields: tuple[str, int, int]) -> tuple[int, ...]:
    """Check a codec's header params: exactly one per ``(name, lo, hi)`` in ``fields``, each in range.

    Returns:
        The params, in order.

    Raises:
        ValueError: naming the field (``params[i] (name)``) that is missing or out of range.
    """
    if len(header.params) != len(fields):
        names = ", ".join(f[0] for f in fields)
        raise ValueError(f"corrupt header: field 'n_params' = {len(header.params)}, expected {len(fields)} ({names})")
    for i, (v, (name, lo, hi)) in enumerate(zip(header.params, fields)):
        if not lo <= v <= hi:
            raise ValueError(f"corrupt header: field 'params[{i}]' ({name}) = {v} outside [{lo}, {hi}]")
    return header.params


def check_tensor_specs(header: Header, *specs: tuple[str, torch.dtype, int]) -> None:
    """Check that the header lists exactly the payload tensors ``(name, dtype, numel)`` a codec expects.

    Raises:
        ValueError: naming the first tensor field (``tensors[i] (name)``) that differs.
    """
    if len(header.tensor_specs) != len(specs):
        raise ValueError(f"corrupt header: field 'n_tensors' = {len(header.tensor_specs)}, expected {len(specs)}")
    for i, ((dt, n), (name, edt, en)) in enumerate(zip(header.tensor_specs, specs)):
        if dt != edt or n != en:
            raise ValueError(f"corrupt header: field 'tensors[{i}]' ({name}) is {dt}[{n}], expected {edt}[{en}]")


class Codec:
    """Base class of all codecs: ``encode(tensor) -> Payload``, ``decode(Payload) -> tensor``.

    Subclasses set ``name`` and ``codec_id`` through :func:`register_codec` and implement
    :meth:`encode` and :meth:`decode`. Codecs are stateless unless ``stateful`` is True
    (wrappers such as error feedback); a stateless codec's decode uses only the payload.
    """

    name: str = "?"
    codec_id: int = -1
    stateful: bool = False

    def encode(self, x: torch.Tensor) -> Payload:
        """Encode ``x`` (any shape; dtype as the codec documents) into a :class:`Payload`."""
        raise NotImplementedError

    def decode(self, payload: Payload) -> torch.Tensor:
        """Decode ``payload`` to a tensor of the original shape and dtype, on the payload's device.

        Raises:
            ValueError: if the header is corrupt, truncated or from another codec.
        """
        raise NotImplementedError

    def parse(self, payload: Payload) -> Header:
        """Parse and validate ``payload``'s header for this codec, and check its tensors."""
        header = parse_header(payload.header, self.codec_id)
        check_tensors(header, payload.tensors)
        return header

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


_REGISTRY: dict[str, type[Codec]] = {}
_IDS: dict[int, str] = {}


def register_codec(name: str, codec_id: int, aliases: Sequence[str] = ()) -> Callable[[type[Codec]], type[Codec]]:
    """Class decorator registering a codec under ``name`` with the wire id ``codec_id``.

    ``aliases`` are further names :func:`get_codec` accepts for the same codec (same id;
    ``codec.name`` stays ``name``).

    Raises:
        ValueError: if a name or the id is already taken.
    """

    def deco(cls: type[Codec]) -> type[Codec]:
        if any(n in _REGISTRY for n in (name, *aliases)) or codec_id in _IDS:
            raise ValueError(f"codec name {name!r}, an alias in {list(aliases)} or id {codec_id} registered twice")
        cls.name, cls.codec_id = name, codec_id
        for n in (name, *aliases):
            _REGISTRY[n] = cls
        _IDS[codec_id] = name
        return cls

    return deco


def get_codec(name: str, **options) -> Codec:
    """Instantiate the codec registered as ``name`` with keyword ``options``.

    Raises:
        ValueError: unknown name (the message lists the available codecs) or bad options.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}") from None
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"bad options for codec {name!r}: {e}") from None


def available_codecs() -> list[str]:
    """Names of all registered codecs, sorted."""
    return sorted(_REGISTRY)


def codec_name_for_id(codec_id: int) -> str:
    """Registered name for a wire id, or ``'unknown'``."""
    return _IDS.get(int(codec_id), "unknown")
