"""Framing of several payloads into one byte tensor, for collectives that move bytes.

An all-gather moves one tensor per rank; :func:`frame_payloads` packs the payloads of
one DDP bucket (one per parameter) into a 1-D ``uint8`` tensor, and
:func:`unframe_payloads` validates and splits it again. Nothing is pickled: the frame
is integers and raw tensor bytes, and every header is checked with
:func:`~dgpipe.compression.base.parse_header`.

The payload headers (``int64`` fields, 8 bytes each in a :class:`Payload`) are framed
as variable-length integers: zigzag-mapped, then LEB128, 7 bits per byte with a
continuation bit (the varints of Protocol Buffers; LEB128 is from the DWARF debugging
standard). Header fields are small (codec ids, dtypes, shapes, counts), so a header of
12-14 fields takes about 20 bytes instead of 96-112 -- what a sparse gradient codec
such as DGC at 0.1% density saves per parameter is then no longer spent on headers.
"""

from __future__ import annotations

from typing import Iterable

import torch

from dgpipe.compression.base import Payload, parse_header

__all__ = ["FRAME_MAGIC", "FRAME_PREFIX_BYTES", "frame_payloads", "unframe_payloads", "varint_encode",
           "varint_decode"]

FRAME_MAGIC = 0x64677066  # "dgpf"
#: Bytes of the frame's fixed prefix: ``int64 [FRAME_MAGIC, count, header_bytes]``.
FRAME_PREFIX_BYTES = 24
_MAX_HEADER_NUMEL = 1 << 12
_VARINT_MAX_BYTES = 10  # ceil(64 / 7)
_SHIFTS = torch.arange(_VARINT_MAX_BYTES, dtype=torch.int64) * 7
_GROUP_MASKS = torch.tensor([0x7F] * 9 + [0x01], dtype=torch.int64)  # the 10th byte holds bit 63
_LOW63 = (1 << 63) - 1


def varint_encode(values: torch.Tensor) -> torch.Tensor:
    """Zigzag + LEB128 bytes of ``int64`` integers, vectorised.

    Args:
        values: 1-D ``int64`` CPU tensor, any values.

    Returns:
        1-D ``uint8`` tensor: per value ``v``, the unsigned 64-bit ``z = 2v`` (``v >= 0``)
        or ``-2v - 1`` (``v < 0``) in ``max(1, ceil(bits(z) / 7))`` bytes (at most 10),
        low 7 bits first, the high bit set on every byte but the value's last.
    """
    z = (values << 1) ^ (values >> 63)  # bit pattern of the unsigned zigzag value
    groups = (z[:, None] >> _SHIFTS) & _GROUP_MASKS
    nonzero = ((z[:, None] >> _SHIFTS[:9]) != 0).sum(1).clamp(min=1)
    length = torch.where(z < 0, _VARINT_MAX_BYTES, nonzero)  # z >= 2**63: all 10 bytes
    k = torch.arange(_VARINT_MAX_BYTES)
    more = (k[None, :] < (length - 1)[:, None]).to(torch.int64) << 7
    return (groups | more)[k[None, :] < length[:, None]].to(torch.uint8)


def varint_decode(data: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`varint_encode`: a 1-D ``uint8`` CPU tensor to ``int64`` values.

    Raises:
        ValueError: the bytes end inside a value, or a value runs over 64 bits.
    """
    b = data.to(torch.int64)
    ends = (b & 0x80) == 0
    if b.numel() and not bool(ends[-1]):
        raise ValueError("corrupt frame: the headers' varints end inside a value")
    value_of_byte = ends.cumsum(0) - ends.to(torch.int64)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends.nonzero().view(-1) + 1])[:-1]
    place = torch.arange(b.numel()) - starts[value_of_byte]
    groups = b & 0x7F
    if b.numel() and (int(place.max()) >= _VARINT_MAX_BYTES or bool((groups[place == 9] > 1).any())):
        raise ValueError("corrupt frame: a header varint runs over 64 bits")
    z = torch.zeros(starts.numel(), dtype=torch.int64).scatter_add_(0, value_of_byte, groups << (7 * place))
    return ((z >> 1) & _LOW63) ^ -(z & 1)


def frame_payloads(payloads: Iterable[Payload], device: torch.device) -> torch.Tensor:
    """Frame several payloads into one 1-D ``uint8`` tensor on ``device`` (no pickling).

    Layout: ``int64 [FRAME_MAGIC, count, header_bytes]`` (:data:`FRAME_PREFIX_BYTES`),
    then ``header_bytes`` bytes of :func:`varint_encode` of ``header_numel_1,
    *header_1, ..., header_numel_count, *header_count``, then every payload's tensors'
    bytes, in order. Bytes: ``24 + header_bytes + sum of the payloads' tensor bytes``.
    """
    payloads = list(payloads)
    fields = [torch.zeros(0, dtype=torch.int64)]
    fields += [t for p in payloads for t in (torch.tensor([p.header.numel()]), p.header.cpu())]
    headers = varint_encode(torch.cat(fields))
    prefix = torch.tensor([FRAME_MAGIC, len(payloads), headers.numel()], dtype=torch.int64)
    parts = [prefix.view(torch.uint8).to(device), headers.to(device)]
    parts += [t.reshape(-1).contiguous().view(torch.uint8).to(device) for p in payloads for t in p.tensors]
    return torch.cat(parts)


def unframe_payloads(blob: torch.Tensor, count: int, device: torch.device) -> list[Payload]:
    """Inverse of :func:`frame_payloads`: ``count`` payloads, tensors on ``device``.

    Every header is validated with :func:`~dgpipe.compression.base.parse_header`
    and the byte count must match exactly.

    Raises:
        ValueError: naming the field that is corrupt or inconsistent.
    """
    nbytes = blob.numel()
    if blob.dtype != torch.uint8 or nbytes < FRAME_PREFIX_BYTES:
        raise ValueError(f"corrupt frame: {nbytes} bytes, need at least {FRAME_PREFIX_BYTES}")
    magic, got, header_bytes = blob[:FRAME_PREFIX_BYTES].cpu().clone().view(torch.int64).tolist()
    if magic != FRAME_MAGIC or got != count:
        raise ValueError(f"corrupt frame: field 'magic/count' = {[magic, got]}, expected [{FRAME_MAGIC}, {count}]")
    if not 0 <= header_bytes <= nbytes - FRAME_PREFIX_BYTES:
        raise ValueError(f"corrupt frame: field 'header_bytes' = {header_bytes} out of range")
    pos = FRAME_PREFIX_BYTES + header_bytes
    ints = varint_decode(blob[FRAME_PREFIX_BYTES:pos].cpu())
    headers, sizes, i = [], [], 0
    for _ in range(count):
        n = int(ints[i]) if i < ints.numel() else -1
        if not 4 <= n <= _MAX_HEADER_NUMEL or i + 1 + n > ints.numel():
            raise ValueError(f"corrupt frame: field 'header_numel' = {n} out of range")
        h = ints[i + 1 : i + 1 + n].clone()
        spec = parse_header(h)
        headers.append(h)
        sizes.append([(dt, n * torch.empty(0, dtype=dt).element_size()) for dt, n in spec.tensor_specs])
        i += 1 + n
    if i != ints.numel():
        raise ValueError(f"corrupt frame: {ints.numel() - i} header fields beyond the {count} headers")
    if pos + sum(b for s in sizes for _, b in s) != nbytes:
        raise ValueError(f"corrupt frame: {nbytes} bytes but the headers announce a different total")
    payloads = []
    for h, spec in zip(headers, sizes):
        tensors = []
        for dt, b in spec:
            tensors.append(blob[pos : pos + b].to(device).clone().view(dt))
            pos += b
        payloads.append(Payload(h, tuple(tensors)))
    return payloads
