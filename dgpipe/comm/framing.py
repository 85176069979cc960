"""The wire format of dgpipe's messages: payloads framed into bytes and read back, trusting nothing read.

Nothing is ever pickled: a frame is integers and raw tensor bytes, and every payload header is checked with
:func:`~dgpipe.compression.base.parse_header` before anything is allocated for it.

A *message* (:func:`pack_message` / :func:`read_message`; what :mod:`dgpipe.comm.transport` sends point to point
and what a transport of torch's carries for :class:`~dgpipe.pipelining.CompressedPipelineStage`) carries one
or more payloads plus a few integers of caller meta data, packed into one byte string::

    int64 fields  [MAGIC, total_bytes, n_meta, n_payloads, header_numel,
                   *meta, *header_lengths, *headers]
    tensors       the payloads' tensors, in order, each at an 8-byte aligned offset,
                  dtype and numel as its header says
    closing word  :data:`CLOSE` at the next 8-byte aligned offset; total_bytes ends it

A message too large for a stream's receive buffer goes out as two parts (:func:`split_parts`): a first part
of exactly the buffer's size -- the message's first ``capacity - 8`` bytes and the closing word -- and the
rest. :func:`read_message` validates the fixed fields and, when they fit in the first part, every header and
the layout they imply, which must end at exactly ``total_bytes``, before it asks for the second part; the
closing word proves each part whole (a receive buffer is zeroed, and the word's bytes are all nonzero).

An *all-gather frame* (:func:`frame_payloads` / :func:`unframe_payloads`; what the data-parallel hooks exchange,
one per rank and bucket, padded to the longest by the collective) packs the payloads of one DDP bucket (one
per parameter) into a 1-D ``uint8`` tensor. Its headers are framed as variable-length integers: zigzag-mapped,
then LEB128, 7 bits per byte with a continuation bit (the varints of Protocol Buffers; LEB128 is from the DWARF
debugging standard). Header fields are small (codec ids, dtypes, shapes, counts), so a header of 12-14 fields
takes about 20 bytes instead of 96-112: a bucket of a sparse gradient codec carries one header per parameter
(MobileNetV2: 158), and top-k at 1% measured 11.8% more bytes with the int64 headers of a message. A point-to-point
message carries one to a few payloads of a boundary's tensors, whose int64 headers the meter counts in each
payload's ``nbytes``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from dgpipe.compression.base import Payload, parse_header

__all__ = [
    "MAGIC",
    "CLOSE",
    "FRAME_MAGIC",
    "FRAME_PREFIX_BYTES",
    "message_size",
    "pack_message",
    "split_parts",
    "read_message",
    "frame_payloads",
    "unframe_payloads",
    "varint_encode",
    "varint_decode",
]

MAGIC = 0x64677033  # "dgp3"
CLOSE = int.from_bytes(b"dgp3end!", "little")
"""The closing word of every message and of a split message's first part: 8 nonzero bytes."""
_FIXED = 5  # MAGIC, total_bytes, n_meta, n_payloads, header_numel
MAX_META = 64
MAX_PAYLOADS = 64
MAX_HEADER_NUMEL = 1 << 16
MAX_EXPANSION = 4096
"""The tensors a message's headers declare (what decoding allocates) may hold at most this many
times the message's own bytes, or :data:`MIN_DECLARED` bytes: far above any codec's ratio (top-k at
0.1% is ~700x, rank-1 factors of a 4096 x 4096 matrix 2048x), far below what a forged 300-byte
header could ask for."""
MIN_DECLARED = 1 << 26  # 64 MiB


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


def _layout(fields_numel: int, specs) -> tuple[list[int], int]:
    """Byte offsets of the tensors described by ``specs`` [(dtype, numel)], and the total size (the
    closing word included)."""
    offsets, end = [], 8 * fields_numel
    for dt, n in specs:
        start = _align(end)
        offsets.append(start)
        end = start + n * dt.itemsize
    return offsets, _align(end) + 8


_CLOSE_BYTES = torch.tensor([CLOSE], dtype=torch.int64).view(torch.uint8)


def _closed(part: torch.Tensor) -> bool:
    """Whether ``part`` (1-D uint8) ends with :data:`CLOSE`."""
    return part.numel() >= 8 and bool(torch.equal(part[-8:].cpu(), _CLOSE_BYTES))




def _message_layout(payloads: Sequence[Payload], n_meta: int) -> tuple[list[int], int]:
    """The byte offsets of ``payloads``' tensors in a message with ``n_meta`` meta values, and its total size.

    Raises:
        ValueError: more than 64 meta values or payloads.
    """
    if n_meta > MAX_META or len(payloads) > MAX_PAYLOADS:
        raise ValueError(f"a message holds at most {MAX_META} meta values and {MAX_PAYLOADS} payloads, "
                         f"got {n_meta} and {len(payloads)}")  # fmt: skip
    fields_numel = _FIXED + n_meta + len(payloads) + sum(p.header.numel() for p in payloads)
    return _layout(fields_numel, [(t.dtype, t.numel()) for p in payloads for t in p.tensors])


def message_size(payloads: Sequence[Payload], n_meta: int = 0) -> int:
    """Bytes of the message :func:`pack_message` makes of ``payloads`` and ``n_meta`` meta values (nothing is
    packed).

    Raises:
        ValueError: more than 64 meta values or payloads.
    """
    return _message_layout(payloads, n_meta)[1]


def pack_message(payloads: Sequence[Payload], meta: Sequence[int] = (), device: torch.device | str = "cpu",
                 min_size: int = 0) -> tuple[torch.Tensor, int]:
    """The bytes of one message (module docstring): ``(buffer, total_bytes)``.

    Args:
        payloads: at most 64; their tensors are copied into the buffer.
        meta: at most 64 int64 values.
        device: where the buffer is made (the wire device).
        min_size: pad the buffer with zeros to at least this many bytes (NCCL's fixed first part).

    Returns:
        ``buffer``: 1-D uint8 of ``max(total_bytes, min_size)`` bytes; ``total_bytes``: the
        message's own size, which :func:`read_message` checks.
    Raises:
        ValueError: more than 64 meta values or payloads.
    """
    offsets, total = _message_layout(payloads, len(meta))
    headers = [p.header.reshape(-1) for p in payloads]
    lengths = [h.numel() for h in headers]
    fields_numel = _FIXED + len(meta) + len(lengths) + sum(lengths)
    tensors = [t.reshape(-1) for p in payloads for t in p.tensors]
    buf = torch.zeros(max(total, min_size), dtype=torch.uint8, device=device)
    fields = [MAGIC, total, len(meta), len(payloads), sum(lengths), *meta, *lengths]
    words = torch.tensor(fields, dtype=torch.int64)
    if headers:
        words = torch.cat([words, *headers])
    buf[: 8 * fields_numel].copy_(words.view(torch.uint8))
    for t, off in zip(tensors, offsets):
        if t.numel():
            buf[off : off + t.numel() * t.element_size()].copy_(t.contiguous().view(torch.uint8))
    buf[total - 8 : total].copy_(_CLOSE_BYTES)
    return buf, total


def split_parts(buf: torch.Tensor, capacity: int) -> list[torch.Tensor]:
    """The parts a message ``buf`` (1-D uint8) goes out as on a stream of ``capacity`` bytes: itself when
    it fits, else a first part of ``capacity`` bytes -- its first ``capacity - 8`` and :data:`CLOSE` --
    and the rest of the message from byte ``capacity - 8``."""
    if buf.numel() <= capacity:
        return [buf]
    first = torch.empty(capacity, dtype=torch.uint8, device=buf.device)
    first[: capacity - 8].copy_(buf[: capacity - 8])
    first[capacity - 8 :].copy_(_CLOSE_BYTES)
    return [first, buf[capacity - 8 :]]


def _fields(words: list[int], n_meta: int, n_payloads: int, header_numel: int, total: int, src: int):
    """Meta, headers and tensor offsets from the int64 ``words`` of a message's fields; checks that
    the headers are valid and that their layout ends at exactly ``total`` bytes."""
    meta = words[_FIXED : _FIXED + n_meta]
    lengths = words[_FIXED + n_meta : _FIXED + n_meta + n_payloads]
    if any(n < 1 for n in lengths) or sum(lengths) != header_numel:
        raise ValueError(f"corrupt message from rank {src}: header lengths {lengths} do not add up to {header_numel}")
    fields_numel = _FIXED + n_meta + n_payloads + header_numel
    flat = torch.tensor(words[fields_numel - header_numel : fields_numel], dtype=torch.int64)
    headers = list(flat.split(lengths)) if lengths else []
    try:
        parsed = [parse_header(h) for h in headers]
    except ValueError as err:
        raise ValueError(f"corrupt message from rank {src}: {err}") from None
    specs = [h.tensor_specs for h in parsed]
    declared = sum(h.numel * h.dtype.itemsize for h in parsed)
    if declared > max(MIN_DECLARED, MAX_EXPANSION * total):
        raise ValueError(f"corrupt message from rank {src}: its {total} bytes declare tensors of {declared} bytes, "
                         f"more than {MAX_EXPANSION}x (or {MIN_DECLARED} bytes) a codec can expand to")
    offsets, end = _layout(fields_numel, [sp for spec in specs for sp in spec])
    if end != total:
        raise ValueError(f"corrupt message from rank {src}: its size word says {total} bytes but its headers "
                         f"describe {end}")  # fmt: skip
    return meta, headers, specs, offsets


def _truncated(src: int, what: str) -> ValueError:
    return ValueError(f"corrupt message from rank {src}: truncated: the closing word is missing from {what} "
                      "(fewer bytes arrived than the message says)")


def read_message(first: torch.Tensor, rest, src: int, limit: int, device: torch.device | str):
    """Validate and unpack one message from its first part; the receiving side of the wire format.

    Args:
        first: 1-D uint8, the message's first part (the stream's capacity: the whole
            message, padded, when it fits; else its first ``capacity - 8`` bytes and
            :data:`CLOSE`), received into a zeroed buffer.
        rest: ``rest(n)`` returns the next ``n`` bytes of the message (1-D uint8), i.e.
            allocates and receives the second part into a zeroed buffer; called at most
            once, and only after the checks below passed.
        src: the sender's rank (for messages).
        limit: most bytes of a message whose fields and headers do not fit in ``first``
            (the others are checked exactly) -- and of any message.
        device: where the returned tensors are placed.

    Returns:
        ``(payloads, meta, total_bytes)``.

    Raises:
        ValueError: ``corrupt message from rank N: ...`` -- a wrong magic, a size word
            below the fields, above ``limit`` or other than the headers describe, counts out
            of range, an invalid header, a first part cut short -- before ``rest`` is called
            when the fields fit in ``first``; a message cut short (``truncated``) once it is
            complete.
    """
    if first.numel() < 8 * _FIXED:
        raise ValueError(f"corrupt message from rank {src}: a first part of {first.numel()} bytes")
    head = first[: 8 * _FIXED].cpu().view(torch.int64).tolist()
    magic, total, n_meta, n_payloads, header_numel = head
    if magic != MAGIC:
        raise ValueError(f"corrupt message from rank {src}: magic {magic:#x}, not {MAGIC:#x} "
                         "(sender and receiver out of step?)")  # fmt: skip
    if not (0 <= n_meta <= MAX_META and 0 <= n_payloads <= MAX_PAYLOADS and 0 <= header_numel <= MAX_HEADER_NUMEL):
        raise ValueError(f"corrupt message from rank {src}: {n_meta} meta, {n_payloads} payloads, "
                         f"{header_numel} header values")  # fmt: skip
    fields_numel = _FIXED + n_meta + n_payloads + header_numel
    if not 8 * fields_numel <= total <= limit:
        raise ValueError(f"corrupt message from rank {src}: its size word says {total} bytes, outside "
                         f"[{8 * fields_numel}, {limit}] (its {fields_numel} fields .. the limit)")  # fmt: skip
    split = total > first.numel()  # then the first part is the message's first bytes and a closing word
    body = first[:-8] if split else first
    checked = None
    if 8 * fields_numel <= body.numel():  # everything needed to know the size is here: check it now
        words = body[: 8 * fields_numel].cpu().view(torch.int64).tolist()
        checked = _fields(words, n_meta, n_payloads, header_numel, total, src)
    if split:
        if not _closed(first):
            raise _truncated(src, f"its first part of {first.numel()} bytes")
        buf = torch.cat([body, rest(total - body.numel()).to(first.device)])
    else:
        buf = first[:total]
    if checked is None:
        checked = _fields(buf[: 8 * fields_numel].cpu().view(torch.int64).tolist(), n_meta, n_payloads,
                          header_numel, total, src)  # fmt: skip
    if not _closed(buf):
        raise _truncated(src, f"its {total} bytes")
    meta, headers, specs, offsets = checked
    it = iter(offsets)
    payloads = []
    for h, spec in zip(headers, specs):
        tensors = []
        for dt, n in spec:
            off = next(it)
            tensors.append(buf[off : off + n * dt.itemsize].view(dt).to(device))
        payloads.append(Payload(h, tuple(tensors)))
    return payloads, meta, total


# -- all-gather frames ----------------------------------------------------------------------------------------

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
        header = parse_header(h)
        headers.append(h)
        sizes.append([(dt, n * torch.empty(0, dtype=dt).element_size()) for dt, n in header.tensor_specs])
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
