"""The one way a payload moves: codec, framing and meter together, for every sender and receiver in dgpipe.

A :class:`Link` is one named end of a link (a stage boundary ``"stage0->stage1"``, ``"client->server"``, the
data-parallel exchange ``"ddp"``) and the meters it records into. Every message goes through the same four steps:

- **encode** (:meth:`Link.encoding`): the caller's codecs turn tensors into payloads inside the block, which is
  timed on the tensors' device (:func:`~dgpipe.comm.meter.timer`: CUDA events off the CPU, no wait);
  :meth:`Outgoing.add` counts each payload and the uncoded bytes it stands for;
- **frame and send**: :meth:`Link.send` hands the payloads to a :class:`~dgpipe.comm.transport.Sender` (dgpipe's
  transport), :meth:`Link.frame` packs them into one message for a transport of torch's
  (:func:`~dgpipe.comm.framing.pack_message`), :meth:`Link.account` records a message that stays in process;
  each records ``raw_bytes``, ``wire_bytes`` (the payloads' :attr:`~dgpipe.compression.base.Payload.nbytes`),
  ``frame_bytes`` (the message around them) and the encode seconds;
- **receive** (:meth:`Link.receive` from a :class:`~dgpipe.comm.transport.Receiver`, timing the wait, or
  :meth:`Link.unframe` of a message torch received), which checks the message whole before anything is decoded;
- **decode** (:meth:`Link.decoding`): the caller checks the headers and decodes inside the block, which is timed
  and, when it ends without an error, records ``recv_bytes``, ``recv_seconds`` and the decode seconds.

Traffic that is not one framed message (a collective's part, a tensor torch moves uncoded) is recorded through
:meth:`Link.sent` and :meth:`Link.received`.
Nothing outside :mod:`dgpipe.comm` records into a :class:`~dgpipe.comm.meter.BandwidthMeter`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from dgpipe.compression.base import Payload

from .framing import pack_message, read_message
from .meter import BandwidthMeter, DeviceSpan, timer
from .transport import Receiver, Sender, SendWork

__all__ = ["Outgoing", "Incoming", "Link"]


@dataclass
class Outgoing:
    """One message being coded: its payloads in order and the uncoded bytes they carry.

    Attributes:
        direction: the meter's direction label (``"forward"``, ``"backward"``, ``"eval"``, ``"generate"``).
        payloads: what :meth:`add` was given, in order.
        raw_bytes: uncoded bytes of the tensors the payloads code (a payload that carries ids or a mask may add 0).
        encode_seconds: seconds of the :meth:`Link.encoding` block (set when it ends; a
            :class:`~dgpipe.comm.meter.DeviceSpan` on a CUDA device).
    """

    direction: str
    payloads: list[Payload] = field(default_factory=list)
    raw_bytes: int = 0
    encode_seconds: "float | DeviceSpan" = 0.0

    def add(self, payload: Payload, raw_bytes: int = 0) -> Payload:
        """Append ``payload`` (coding ``raw_bytes`` bytes of tensors); returns it."""
        self.payloads.append(payload)
        self.raw_bytes += raw_bytes
        return payload

    @property
    def wire_bytes(self) -> int:
        """Sum of the payloads' ``nbytes`` (their int64 headers and tensors)."""
        return sum(p.nbytes for p in self.payloads)


@dataclass
class Incoming:
    """One message received and checked whole (not yet decoded).

    Attributes:
        payloads: its payloads, views into the receive buffer.
        meta: its meta integers.
        recv_seconds: seconds blocked receiving it (0 where torch's schedule received it).
    """

    payloads: list[Payload]
    meta: list[int]
    recv_seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        """Sum of the payloads' ``nbytes``."""
        return sum(p.nbytes for p in self.payloads)


class Link:
    """One named end of a link and the meters its traffic is recorded in (module docstring).

    Args:
        name: the meter's name for the link, e.g. a stage boundary's ``"stage0->stage1"``.
        meters: each :class:`~dgpipe.comm.meter.BandwidthMeter` that records every message (none: nothing is
            recorded; ``None`` entries are skipped).
        device: where the coded tensors live; encode and decode are timed there.
    """

    def __init__(self, name: str, *meters: BandwidthMeter | None, device: torch.device | str = "cpu") -> None:
        self.name = name
        self.meters = tuple(m for m in meters if m is not None)
        self.device = torch.device(device)

    # -- sending ---------------------------------------------------------------------------

    @contextmanager
    def encoding(self, direction: str) -> Iterator[Outgoing]:
        """Time the block in which the caller codes one message: ``with link.encoding("forward") as out:
        out.add(codec.encode(x), x.nbytes)``."""
        stop = timer(self.device)
        out = Outgoing(direction)
        yield out
        out.encode_seconds = stop()

    def send(self, sender: Sender, out: Outgoing, meta: Sequence[int] = (), label: str = "") -> SendWork:
        """Frame ``out``'s payloads with ``meta`` and send them on ``sender`` (returns at once; ``label`` names the
        message in errors), and record the message."""
        work = sender.send(out.payloads, meta, label)
        self._sent(out, work.nbytes)
        return work

    def frame(self, out: Outgoing, device: torch.device | str = "cpu") -> torch.Tensor:
        """``out``'s payloads as one message of bytes (``uint8``, on ``device``) for a transport of torch's to move,
        and record it."""
        buf, total = pack_message(out.payloads, device=device)
        self._sent(out, total)
        return buf

    def account(self, out: Outgoing) -> None:
        """Record a message that is coded and decoded in one process (no framing: ``frame_bytes`` 0)."""
        self._sent(out, out.wire_bytes)

    def _sent(self, out: Outgoing, message_bytes: int) -> None:
        wire = out.wire_bytes
        self.sent(out.direction, raw_bytes=out.raw_bytes, wire_bytes=wire, frame_bytes=message_bytes - wire,
                  encode_seconds=out.encode_seconds)

    # -- receiving -------------------------------------------------------------------------

    def receive(self, receiver: Receiver, device: torch.device | str, timeout: float | None,
                max_bytes: int | None = None) -> Incoming:
        """The next message of ``receiver``, on ``device``, checked whole (its wait timed).

        Raises:
            TransportError: the peer failed or stalled past ``timeout`` seconds.
            ValueError: a corrupt message (truncated, lying size word, bad headers) or one over ``max_bytes``.
        """
        start = time.perf_counter()
        payloads, meta = receiver.recv(device, timeout, max_bytes)
        return Incoming(payloads, meta, time.perf_counter() - start)

    def unframe(self, buf: torch.Tensor, peer: int, device: torch.device | str) -> Incoming:
        """The message in ``buf`` (``uint8``, all of it; what a transport of torch's received from global rank
        ``peer``), checked whole, its tensors on ``device``.

        Raises:
            ValueError: a corrupt message, or one that says it is longer than ``buf``.
        """

        def longer(n: int) -> torch.Tensor:
            raise ValueError(f"{n} bytes more than its fixed size")

        payloads, meta, _ = read_message(buf, longer, peer, buf.numel(), device)
        return Incoming(list(payloads), list(meta))

    @contextmanager
    def decoding(self, direction: str, incoming: Incoming) -> Iterator[Incoming]:
        """Time the block in which the caller checks and decodes ``incoming``; records it when the block ends
        without an error."""
        stop = timer(self.device)
        yield incoming
        self.received(direction, recv_bytes=incoming.nbytes, recv_seconds=incoming.recv_seconds,
                      decode_seconds=stop())

    # -- traffic that is not one framed message ------------------------------------------

    def sent(self, direction: str, *, raw_bytes: int, wire_bytes: int, frame_bytes: int = 0,
             encode_seconds: "float | DeviceSpan" = 0.0) -> None:
        """Record what this end put on a link other than as one framed message: its part of a collective, or a
        tensor a transport of torch's moved uncoded (fields as :meth:`BandwidthMeter.record_send`)."""
        for m in self.meters:
            m.record_send(self.name, direction, raw_bytes=raw_bytes, wire_bytes=wire_bytes, frame_bytes=frame_bytes,
                          encode_seconds=encode_seconds)

    def received(self, direction: str, *, recv_bytes: int, recv_seconds: float = 0.0,
                 decode_seconds: "float | DeviceSpan" = 0.0) -> None:
        """Record what this end took from a link other than as one framed message (fields as
        :meth:`BandwidthMeter.record_recv`)."""
        for m in self.meters:
            m.record_recv(self.name, direction, recv_bytes=recv_bytes, recv_seconds=recv_seconds,
                          decode_seconds=decode_seconds)
