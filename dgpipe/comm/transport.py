"""Point-to-point transport of codec :class:`~dgpipe.compression.base.Payload` s over torch.distributed.

A *message* carries one or more payloads plus a few integers of caller meta data,
packed into one byte string (nothing is ever pickled)::

    int64 fields  [MAGIC, total_bytes, n_meta, n_payloads, header_numel,
                   *meta, *header_lengths, *headers]
    tensors       the payloads' tensors, in order, each at an 8-byte aligned offset,
                  dtype and numel as its header says; total_bytes ends the last one

A *stream* is the sequence of messages from one rank to another on one tag
(:class:`Sender` on one side, :class:`Receiver` on the other). Both ends keep the
same *capacity*: 512 bytes at first, then the largest message seen so far. A message
goes out as one ``isend`` of its bytes when it fits the capacity, else as a first
part of exactly ``capacity`` bytes and a second part with the rest. Because the
receiver knows the capacity before the message exists, it can post the receive of
the next message ahead of time (:meth:`Receiver.post`) into a buffer of that size:
with steady shapes every message is a single pre-posted transfer, as with a
fixed-shape pipeline, yet shapes and dtypes may change at any time. The receiver
checks ``total_bytes`` against ``max_bytes`` before allocating for a second part,
validates every header (:func:`~dgpipe.compression.base.parse_header`) and checks that
the layout adds up to exactly ``total_bytes``; received tensors are views into the
message buffer (no copy).

Tensors travel on the *wire device* of the process group: CUDA with NCCL, CPU
otherwise. CUDA payloads over gloo are staged through CPU memory (packing the
message is that copy); received tensors are moved to the caller's ``device``.
NCCL ignores tags and needs exact sizes, so there the capacity stays 512 bytes, the
first part is padded to it, nothing is posted ahead, and messages must be received
in the order they were sent.

Every blocking wait takes a timeout (seconds); a peer that fails or stalls raises
:class:`TransportError` naming that peer instead of hanging.

Usage::

    work = send_payload(codec.encode(x), dst=1)          # rank 0; returns at once
    work.wait(timeout=60)
    payload = recv_payload(src=0, device="cpu", timeout=60)   # rank 1
    y = codec.decode(payload)
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from typing import Sequence

import torch
import torch.distributed as dist

from dgpipe.compression.base import Payload, parse_header

__all__ = [
    "MAGIC",
    "MIN_CAPACITY",
    "DEFAULT_MAX_BYTES",
    "TransportError",
    "SendWork",
    "Sender",
    "Receiver",
    "wire_device",
    "send_payload",
    "recv_payload",
]

MAGIC = 0x64677033  # "dgp3"
MIN_CAPACITY = 512  # bytes; the first capacity of every stream
_FIXED = 5  # MAGIC, total_bytes, n_meta, n_payloads, header_numel
MAX_META = 64
MAX_PAYLOADS = 64
MAX_HEADER_NUMEL = 1 << 16
DEFAULT_MAX_BYTES = 1 << 34  # 16 GiB: refuse to allocate more for one received message


class TransportError(RuntimeError):
    """A send or receive with a peer rank failed or timed out.

    Attributes:
        peer: global rank of the peer.
    """

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


def wire_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Device that tensors must be on for ``group``'s backend: CUDA for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(works: Sequence, peer: int, action: str, timeout: float | None, start: float) -> None:
    """Wait for ``works``, all within ``timeout`` seconds of ``start`` (monotonic clock)."""
    for work in works:
        try:
            if timeout is None:
                work.wait()
            else:
                remaining = timeout - (time.monotonic() - start)
                work.wait(timeout=datetime.timedelta(seconds=max(remaining, 0.001)))
        except RuntimeError as err:
            text = str(err)
            if "timed out" in text.lower() or "timeout" in text.lower():
                why = f"timed out after {timeout:g} s: rank {peer} is stalled or has failed"
            else:
                why = f"rank {peer} closed the connection or failed"
            first_line = text.splitlines()[0] if text else type(err).__name__
            raise TransportError(f"{action} rank {peer} failed ({why}). Check rank {peer}'s log. [{first_line}]",
                                 peer) from err  # fmt: skip


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


def _layout(fields_numel: int, specs) -> tuple[list[int], int]:
    """Byte offsets of the tensors described by ``specs`` [(dtype, numel)], and the total size."""
    offsets, end = [], 8 * fields_numel
    for dt, n in specs:
        start = _align(end)
        offsets.append(start)
        end = start + n * dt.itemsize
    return offsets, end


class SendWork:
    """Handle of an asynchronous send; keeps the sent buffers alive until :meth:`wait`.

    Attributes:
        dst: global rank of the receiver.
        nbytes: bytes this message puts on the wire (fields, headers, tensors, padding).
    """

    def __init__(self, works: list, buffers: list[torch.Tensor], dst: int) -> None:
        self._works, self._buffers = works, buffers
        self.dst = dst
        self.nbytes = sum(b.numel() for b in buffers)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the message has been handed to the receiver.

        Args:
            timeout: seconds; ``None`` uses the process group's timeout.

        Raises:
            TransportError: the receiver failed or did not receive within ``timeout``.
        """
        _wait(self._works, self.dst, "sending to", timeout, time.monotonic())
        self._works, self._buffers = [], []


class _Stream:
    """Capacity bookkeeping shared by both ends of a stream (see the module docstring)."""

    def __init__(self, peer: int, group: dist.ProcessGroup | None, tag: int) -> None:
        self.peer, self.group, self.tag = peer, group, tag
        self.device = wire_device(group)
        self.exact = self.device.type != "cpu"  # NCCL: fixed capacity, padded first parts
        self.capacity = MIN_CAPACITY

    def grow(self, total: int) -> None:
        if not self.exact:
            self.capacity = max(self.capacity, total)


class Sender(_Stream):
    """The sending end of a stream to global rank ``dst`` on ``tag``."""

    def __init__(self, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> None:
        super().__init__(dst, group, tag)

    def send(self, payloads: Sequence[Payload], meta: Sequence[int] = ()) -> SendWork:
        """Start sending ``payloads`` and ``meta`` (int64 values) as one message; returns at once.

        Raises:
            ValueError: more than 64 meta values or payloads.
        """
        if len(meta) > MAX_META or len(payloads) > MAX_PAYLOADS:
            raise ValueError(f"a message holds at most {MAX_META} meta values and {MAX_PAYLOADS} payloads, "
                             f"got {len(meta)} and {len(payloads)}")  # fmt: skip
        headers = [p.header.reshape(-1) for p in payloads]
        lengths = [h.numel() for h in headers]
        fields_numel = _FIXED + len(meta) + len(lengths) + sum(lengths)
        tensors = [t.reshape(-1) for p in payloads for t in p.tensors]
        offsets, total = _layout(fields_numel, [(t.dtype, t.numel()) for t in tensors])
        size = max(total, self.capacity) if self.exact else total
        buf = torch.zeros(size, dtype=torch.uint8, device=self.device)
        fields = [MAGIC, total, len(meta), len(payloads), sum(lengths), *meta, *lengths]
        words = torch.tensor(fields, dtype=torch.int64)
        if headers:
            words = torch.cat([words, *headers])
        buf[: 8 * fields_numel].copy_(words.view(torch.uint8))
        for t, off in zip(tensors, offsets):
            if t.numel():
                buf[off : off + t.numel() * t.element_size()].copy_(t.contiguous().view(torch.uint8))
        cut = self.capacity if size > self.capacity else size
        parts = [buf[:cut], buf[cut:]] if cut < size else [buf]
        works = [dist.isend(p, self.peer, group=self.group, tag=self.tag) for p in parts]
        self.grow(total)
        return SendWork(works, parts, self.peer)


class Receiver(_Stream):
    """The receiving end of a stream from global rank ``src`` on ``tag``.

    :meth:`post` posts the receive of the next message ahead of time (at most one;
    a no-op with NCCL). Post only a message that will come: a posted receive that
    is never matched keeps its buffer until the process ends.
    """

    def __init__(self, src: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> None:
        super().__init__(src, group, tag)
        self._posted: deque = deque()

    def post(self) -> None:
        """Post the receive of the next message (if none is posted yet)."""
        if not self.exact and not self._posted:
            self._posted.append(self._irecv(self.capacity))

    def _irecv(self, nbytes: int) -> tuple[torch.Tensor, object]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf, dist.irecv(buf, self.peer, group=self.group, tag=self.tag)

    def recv(
        self, device: torch.device | str, timeout: float | None = None, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> tuple[list[Payload], list[int]]:
        """Receive the next message; blocks until it is complete.

        Args:
            device: where the returned payloads' tensors are placed.
            timeout: seconds for the whole message; ``None`` uses the process group's timeout.
            max_bytes: refuse messages of more bytes than this.

        Returns:
            ``(payloads, meta)``: headers as 1-D int64 CPU tensors, tensors on ``device``.

        Raises:
            TransportError: the sender failed or nothing arrived within ``timeout``.
            ValueError: a corrupt message, or one over ``max_bytes``.
        """
        start = time.monotonic()
        src, action = self.peer, "receiving from"
        first, work = self._posted.popleft() if self._posted else self._irecv(self.capacity)
        _wait([work], src, action, timeout, start)
        magic, total, n_meta, n_payloads, header_numel = first[: 8 * _FIXED].cpu().view(torch.int64).tolist()
        if magic != MAGIC or not 8 * _FIXED <= total <= max_bytes:
            raise ValueError(f"corrupt or oversized message from rank {src}: magic {magic:#x}, {total} bytes "
                             f"(max_bytes={max_bytes}); sender and receiver out of step?")  # fmt: skip
        if not (0 <= n_meta <= MAX_META and 0 <= n_payloads <= MAX_PAYLOADS and 0 <= header_numel <= MAX_HEADER_NUMEL):
            raise ValueError(f"corrupt message from rank {src}: {n_meta} meta, {n_payloads} payloads, "
                             f"{header_numel} header values")  # fmt: skip
        if total > first.numel():
            buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            buf[: first.numel()] = first
            work = dist.irecv(buf[first.numel() :], src, group=self.group, tag=self.tag)
            _wait([work], src, action, timeout, start)
        else:
            buf = first[:total]
        self.grow(total)
        fields_numel = _FIXED + n_meta + n_payloads + header_numel
        if 8 * fields_numel > total:
            raise ValueError(f"corrupt message from rank {src}: {fields_numel} fields in {total} bytes")
        words = buf[: 8 * fields_numel].cpu().view(torch.int64)
        meta = words[_FIXED : _FIXED + n_meta].tolist()
        lengths = words[_FIXED + n_meta : _FIXED + n_meta + n_payloads].tolist()
        if any(n < 1 for n in lengths) or sum(lengths) != header_numel:
            raise ValueError(f"corrupt message from rank {src}: header lengths {lengths} != {header_numel}")
        headers = list(words[fields_numel - header_numel :].clone().split(lengths)) if lengths else []
        specs = [parse_header(h).tensor_specs for h in headers]
        offsets, end = _layout(fields_numel, [s for spec in specs for s in spec])
        if end != total:
            raise ValueError(f"corrupt message from rank {src}: headers describe {end} bytes, message has {total}")
        it = iter(offsets)
        payloads = []
        for h, spec in zip(headers, specs):
            tensors = []
            for dt, n in spec:
                off = next(it)
                tensors.append(buf[off : off + n * dt.itemsize].view(dt).to(device))
            payloads.append(Payload(h, tuple(tensors)))
        return payloads, meta


def send_payload(payload: Payload, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> SendWork:
    """Start sending one ``payload`` to global rank ``dst``; returns at once.

    A one-message stream: the receiver calls :func:`recv_payload` with the same
    ``tag``. Call ``wait`` on the result before exiting.
    """
    return Sender(dst, group, tag).send([payload])


def recv_payload(
    src: int,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    timeout: float | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Payload:
    """Receive one payload sent by :func:`send_payload` from global rank ``src``; blocks.

    Args:
        src: global rank of the sender.
        device: where the payload's tensors are placed (the header stays on CPU).
        group, tag: as given to :func:`send_payload`.
        timeout: seconds; ``None`` uses the process group's timeout.
        max_bytes: refuse messages of more bytes than this.

    Raises:
        TransportError: the sender failed or nothing arrived within ``timeout``.
        ValueError: a corrupt message, more than one payload, or over ``max_bytes``.
    """
    payloads, _ = Receiver(src, group, tag).recv(device, timeout, max_bytes)
    if len(payloads) != 1:
        raise ValueError(f"expected one payload from rank {src}, got a message with {len(payloads)}")
    return payloads[0]
