"""Point-to-point transport of codec :class:`~dgpipe.compression.base.Payload` s over torch.distributed.

A *message* is one or more payloads and a few meta integers in the wire format of
:mod:`dgpipe.comm.framing` (int64 fields and headers, the tensors' bytes, a closing word; never pickled).

A *stream* is the sequence of messages from one rank to another on one tag
(:class:`Sender` on one side, :class:`Receiver` on the other). Both ends keep the
same *capacity*: 512 bytes at first, then the largest message seen so far. A message
goes out as one ``isend`` of its bytes when it fits the capacity, else as a first
part of exactly ``capacity`` bytes -- the message's first ``capacity - 8`` bytes and
the closing word -- and a second part with the rest. Because the
receiver knows the capacity before the message exists, it can post the receive of
the next message ahead of time (:meth:`Receiver.post`) into a buffer of that size:
with steady shapes every message is a single pre-posted transfer, as with a
fixed-shape pipeline, yet shapes and dtypes may change at any time.

The receiver trusts nothing it reads (:func:`~dgpipe.comm.framing.read_message`): before it allocates for or
waits on a second part, it validates the fixed fields and, when the fields and headers
fit in the first part (they do for all but messages of many payloads), every header
(:func:`~dgpipe.compression.base.parse_header`) and the layout they imply, which must
end at exactly ``total_bytes``: a size word that lies is refused at once. A message whose
headers do not fit in the first part is bounded by the stream's limit --
:data:`LIMIT_GROWTH` times the largest message seen on the stream, at least
:data:`MIN_LIMIT` -- or by an explicit ``max_bytes``, and checked the same way once it is
complete. Received tensors are views into the message buffer (no copy).

The wire proves each part whole. gloo completes a receive that got *fewer* bytes than
its buffer holds and does not say how many came, so every receive buffer is zeroed
before it is posted and every part ends with the closing word, whose bytes are all nonzero:
a part cut short leaves zeros where its closing word belongs and is refused (``corrupt
message from rank N: truncated ...``) -- the first part before the second is allocated.
No receive buffer reaches a decoder with memory the peer did not fill. (A part *longer*
than the buffer is gloo's own fatal error: it ends the receiving process.)

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

from dgpipe.compression.base import Payload

from .delay import DelayLine, HeldWork
from .framing import pack_message, read_message, split_parts

__all__ = [
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

MIN_CAPACITY = 512  # bytes; the first capacity of every stream
DEFAULT_MAX_BYTES = 1 << 34  # 16 GiB: refuse to allocate more for one received message
LIMIT_GROWTH = 16
"""A message whose headers do not fit in its first part may be at most this many times the
largest message seen on its stream (or :data:`MIN_LIMIT`), unless ``max_bytes`` is given."""
MIN_LIMIT = 1 << 28  # 256 MiB


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


def _post(op, buf: torch.Tensor, peer: int, group, tag: int, action: str):
    """``dist.isend``/``dist.irecv``, with a closed link (e.g. after a timeout gloo closes the pair)
    raised as :class:`TransportError` naming the peer."""
    try:
        return op(buf, peer, group=group, tag=tag)
    except RuntimeError as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TransportError(f"{action} rank {peer} failed (the link to rank {peer} is closed: it failed, timed "
                             f"out or went away earlier). Check rank {peer}'s log. [{first_line}]", peer) from err


def _action(label: str, action: str) -> str:
    return f"{label}: {action}" if label else action


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    """A receive buffer: zeroed, so that bytes a peer does not send are zeros, never earlier memory."""
    return torch.zeros(n, dtype=torch.uint8, device=device)


class SendWork:
    """Handle of an asynchronous send; keeps the sent buffers alive until :meth:`wait` (or, where the
    handle is dropped unwaited, until the send completes: its :class:`Sender` holds it till then).

    Attributes:
        dst: global rank of the receiver.
        nbytes: bytes this message puts on the wire (fields, headers, tensors, padding).
    """

    def __init__(self, works: list, buffers: list[torch.Tensor], dst: int, label: str = "") -> None:
        self._works, self._buffers = works, buffers
        self.dst, self.label = dst, label
        self.nbytes = sum(b.numel() for b in buffers)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the message has been handed to the receiver.

        Args:
            timeout: seconds; ``None`` uses the process group's timeout.

        Raises:
            TransportError: the receiver failed or did not receive within ``timeout``.
        """
        _wait(self._works, self.dst, _action(self.label, "sending to"), timeout, time.monotonic())
        self._works, self._buffers = [], []

    def done(self) -> bool:
        """Whether the message has been handed to the receiver (or the send failed); never blocks."""
        return all(w.is_completed() for w in self._works)


class _Stream:
    """Capacity bookkeeping shared by both ends of a stream (see the module docstring)."""

    def __init__(self, peer: int, group: dist.ProcessGroup | None, tag: int) -> None:
        self.peer, self.group, self.tag = peer, group, tag
        self.device = wire_device(group)
        self.exact = self.device.type != "cpu"  # NCCL: fixed capacity, padded first parts
        self.capacity = MIN_CAPACITY
        self.largest = 0

    def grow(self, total: int) -> None:
        self.largest = max(self.largest, total)
        if not self.exact:
            self.capacity = max(self.capacity, total)


class Sender(_Stream):
    """The sending end of a stream to global rank ``dst`` on ``tag``; with a :class:`DelayLine`, every
    message is posted that line's latency after :meth:`send` (benchmarks only).

    The sender holds each message's :class:`SendWork` until the send completes, so that a caller who
    drops the handle unwaited does not lose the message: gloo keeps only a weak reference to a send
    the receiver has not asked for yet, and would drop it with the handle.
    """

    def __init__(self, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0,
                 delay: DelayLine | None = None) -> None:
        super().__init__(dst, group, tag)
        self.delay = delay
        self._unfinished: list[SendWork] = []

    def send(self, payloads: Sequence[Payload], meta: Sequence[int] = (), label: str = "") -> SendWork:
        """Start sending ``payloads`` and ``meta`` (int64 values) as one message; returns at once.

        ``label`` (e.g. the boundary, direction and micro-batch) starts the messages of the
        errors this send raises, now or in :meth:`SendWork.wait`.

        Raises:
            ValueError: more than 64 meta values or payloads.
            TransportError: the link to the receiver is closed.
        """
        buf, total = pack_message(payloads, meta, self.device, self.capacity if self.exact else 0)
        parts = split_parts(buf, self.capacity)

        def post() -> list:
            return [_post(dist.isend, p, self.peer, self.group, self.tag, _action(label, "sending to")) for p in parts]

        works = post() if self.delay is None else [HeldWork(self.delay.submit(post))]
        self.grow(total)
        work = SendWork(works, parts, self.peer, label)
        self._unfinished = [w for w in self._unfinished if not w.done()] + [work]
        return work


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
        buf = _zeros(nbytes, self.device)
        return buf, _post(dist.irecv, buf, self.peer, self.group, self.tag, "receiving from")

    def recv(
        self, device: torch.device | str, timeout: float | None = None, max_bytes: int | None = None
    ) -> tuple[list[Payload], list[int]]:
        """Receive the next message; blocks until it is complete.

        Args:
            device: where the returned payloads' tensors are placed.
            timeout: seconds for the whole message; ``None`` uses the process group's timeout.
            max_bytes: refuse messages of more bytes than this; ``None``: the stream's limit
                (module docstring) for messages whose headers do not fit in the first part,
                :data:`DEFAULT_MAX_BYTES` for the others (their size is checked exactly).

        Returns:
            ``(payloads, meta)``: headers as 1-D int64 CPU tensors, tensors on ``device``.

        Raises:
            TransportError: the sender failed or nothing arrived within ``timeout``.
            ValueError: a corrupt message (``corrupt message from rank N: ...``), or one over
                the limit.
        """
        start = time.monotonic()
        src, action = self.peer, "receiving from"
        first, work = self._posted.popleft() if self._posted else self._irecv(self.capacity)
        _wait([work], src, action, timeout, start)

        def rest(n: int) -> torch.Tensor:
            buf = _zeros(n, self.device)
            _wait([_post(dist.irecv, buf, src, self.group, self.tag, action)], src, action, timeout, start)
            return buf

        grown = min(DEFAULT_MAX_BYTES, max(MIN_LIMIT, LIMIT_GROWTH * self.largest))
        limit = max_bytes if max_bytes is not None else grown
        payloads, meta, total = read_message(first, rest, src, limit, device)
        self.grow(total)
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
    max_bytes: int | None = None,
) -> Payload:
    """Receive one payload sent by :func:`send_payload` from global rank ``src``; blocks.

    Args:
        src: global rank of the sender.
        device: where the payload's tensors are placed (the header stays on CPU).
        group, tag: as given to :func:`send_payload`.
        timeout: seconds; ``None`` uses the process group's timeout.
        max_bytes: refuse messages of more bytes than this (``None``: as :meth:`Receiver.recv`).

    Raises:
        TransportError: the sender failed or nothing arrived within ``timeout``.
        ValueError: a corrupt message, more than one payload, or over ``max_bytes``.
    """
    payloads, _ = Receiver(src, group, tag).recv(device, timeout, max_bytes)
    if len(payloads) != 1:
        raise ValueError(f"expected one payload from rank {src}, got a message with {len(payloads)}")
    return payloads[0]
