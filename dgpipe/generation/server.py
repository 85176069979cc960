"""The server of split generation: its blocks behind a link to a client process (:func:`serve`, which admits
nothing a client sends before checking it), or in the client's own process (:class:`LocalServer`)
(:mod:`dgpipe.generation`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from dgpipe.comm import BandwidthMeter
from dgpipe.comm.delay import DelayLine
from dgpipe.comm.link import Link
from dgpipe.comm.transport import Receiver, Sender
from dgpipe.compression import Payload, get_codec
from dgpipe.pipeline.coders import CodecArg

from .protocol import ALPHA, DECODE, END, HIDDEN, PREFILL, TAG, ServerLimits, Stream, Tracker, checked_header
from .stages import StageBlocks

__all__ = ["LocalServer", "serve"]


class LocalServer:
    """The server's stage in the client's process: the same codecs both ways (encode, decode), no transport;
    for tests and single-machine use. ``act_codec``/``return_codec``/``channel_mean``/``alpha``/``channel_scale``:
    as for :func:`generate`'s servers (:class:`RemoteServer`). The meter (attribute ``meter``: it may be replaced
    between calls, or ``None``) records the payload bytes a :class:`RemoteServer` sends and receives (the prompt
    mask included), not the transport's framing."""

    def __init__(self, blocks: StageBlocks, act_codec: CodecArg = "none", return_codec: CodecArg | None = None,
                 meter: BandwidthMeter | None = None, channel_mean: bool = False, alpha: float = ALPHA,
                 channel_scale: bool = False) -> None:
        self.stage = blocks
        ret = act_codec if return_codec is None else return_codec
        # one coder per side and direction, as between processes: (sender, receiver)
        self.act = (Stream(act_codec, channel_mean, alpha, channel_scale),
                    Stream(act_codec, channel_mean, alpha, channel_scale))
        self.back = (Stream(ret, channel_mean, alpha, channel_scale), Stream(ret, channel_mean, alpha, channel_scale))
        self.int_codec = get_codec("intpack")
        self.meter = meter
        self.tracker: Tracker | None = None

    def __call__(self, hidden: torch.Tensor, prompt_mask: torch.Tensor | None,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`RemoteServer.__call__`; the ids are used (and metered) where the stage's pairs are anchored.

        Raises:
            ValueError: an anchored stage called without ``ids``.
        """
        if prompt_mask is not None:
            self.stage.reset()
            self.tracker = Tracker(prompt_mask)
        else:
            self.tracker.advance()
        keys = self.tracker.keys(hidden.shape[1], prompt_mask is not None)
        extra = [self.int_codec.encode(prompt_mask.long())] if prompt_mask is not None else []
        if self.stage.needs_ids and ids is not None:
            extra.append(self.int_codec.encode(ids))
        hidden = self._hop(self.act, hidden, keys, Link("client->server", self.meter), extra)
        hidden = self.stage(hidden, self.tracker.mask, self.tracker.positions, ids if self.stage.needs_ids else None)
        return self._hop(self.back, hidden, keys, Link("server->client", self.meter))

    def _hop(self, coders: tuple["Stream", "Stream"], hidden: torch.Tensor, keys: torch.Tensor, link: Link,
             extra: Sequence[Payload] = ()) -> torch.Tensor:
        """``hidden`` through a direction's coders (encode, meter with the ``extra`` payloads a message to a
        server process carries beside it -- the prompt mask at prefill, the ids to anchored pairs --, decode)."""
        with link.encoding("generate") as message:
            payload = message.add(coders[0].encode(hidden, keys), hidden.numel() * hidden.element_size())
        for p in extra:
            message.add(p)
        link.account(message)
        return coders[1].decode(payload, keys)

    def close(self) -> None:
        """Nothing to end in process."""


class _Gate:
    """The server's checks of one client's messages (:class:`ServerLimits`), made before anything is decoded or
    allocated, and the state they are checked against: the past length and batch of the generation served."""

    def __init__(self, blocks: StageBlocks, peer: int, limits: ServerLimits, act: Stream) -> None:
        self.who, self.act = f"client (rank {peer})", act
        self.hidden_size, self.dtype = blocks.width_in, blocks.dtype
        self.vocab = int(blocks.config.vocab_size) if blocks.needs_ids else 0
        """The ids' bound (``[0, vocab)``) where the stage takes them (anchored pairs), else 0: none are admitted."""
        self.context, self.max_tokens = limits.context(blocks.config), limits.max_tokens
        self.max_bytes = limits.message_bytes(self.hidden_size, max(self.dtype.itemsize, 4), 1 + blocks.needs_ids)
        self.int_codec = get_codec("intpack")
        self.past, self.batch = 0, 0

    def admit(self, meta: list[int], payloads: list[Payload]) -> tuple[int, int, int]:
        """``(kind, batch, length)`` of a message whose meta and headers fit what is served.

        Raises:
            ValueError: ``client (rank N) sent ...``: a meta field, payload count or header that does not fit.
        """
        who = self.who
        if len(meta) != 4 or meta[0] not in (PREFILL, DECODE, END):
            raise ValueError(f"{who} sent meta {meta}: want [kind in 1..3, past, batch, length]")
        kind, their_past, b, length = meta
        if kind == END:
            return kind, 0, 0
        want = (2 if kind == PREFILL else 1) + (self.vocab > 0)
        if len(payloads) != want:
            raise ValueError(f"{who} sent {len(payloads)} payloads with meta {meta}; a "
                             f"{'prefill' if kind == PREFILL else 'decode step'} has {want}"
                             + (" (hidden states, the prompt mask at prefill, token ids)" if self.vocab else ""))
        if b < 1 or length < 1:
            raise ValueError(f"{who} sent a batch of {b} sequences of {length} tokens: both must be >= 1")
        past = 0 if kind == PREFILL else self.past
        if kind == PREFILL and their_past != 0:
            raise ValueError(f"{who} sent a prefill at past {their_past}, want 0")
        if kind == DECODE and (self.batch == 0 or their_past != past or b != self.batch or length != 1):
            raise ValueError(f"{who} sent a decode step with meta {meta}; the server holds {past} tokens of a batch "
                             f"of {self.batch} (a decode step has length 1)")
        if past + length > self.context:
            raise ValueError(f"{who} sent {length} tokens at past {past}: past + length = {past + length} is past "
                             f"the {self.context} tokens per sequence served (max_length)")
        if b * (past + length) > self.max_tokens:
            raise ValueError(f"{who} sent a batch of {b} at {past + length} tokens: {b * (past + length)} tokens, "
                             f"more than the {self.max_tokens} served (max_tokens)")
        checked_header(payloads[0], self.act.codec, (b, length, self.hidden_size), self.dtype, who, "hidden states")
        if kind == PREFILL:
            checked_header(payloads[1], self.int_codec, (b, length), None, who, "a prompt mask")
        if self.vocab:
            checked_header(payloads[-1], self.int_codec, (b, length), None, who, "token ids")
        return kind, b, length

    def mask(self, payload: Payload) -> torch.Tensor:
        """The prompt mask of an admitted prefill: int64 ``(B, L)`` of 0/1 with a token in every row.

        Raises:
            ValueError: ``client (rank N) sent a prompt mask ...`` that does not decode or fit.
        """
        try:
            mask = self.int_codec.decode(payload)
        except ValueError as err:
            raise ValueError(f"{self.who} sent a prompt mask that does not decode: {err}") from None
        if mask.is_floating_point() or bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"{self.who} sent a prompt mask of {mask.dtype} values other than 0 and 1")
        if not bool(mask.any(1).all()):
            raise ValueError(f"{self.who} sent a prompt mask with an empty row (a prompt of no token)")
        return mask.long()

    def ids(self, payload: Payload) -> torch.Tensor:
        """The token ids of an admitted message to anchored pairs: int64 ``(B, L)`` in ``[0, vocab)``.

        Raises:
            ValueError: ``client (rank N) sent token ids ...`` that do not decode or fall outside the vocabulary.
        """
        try:
            ids = self.int_codec.decode(payload)
        except ValueError as err:
            raise ValueError(f"{self.who} sent token ids that do not decode: {err}") from None
        if ids.is_floating_point() or bool(((ids < 0) | (ids >= self.vocab)).any()):
            raise ValueError(f"{self.who} sent token ids outside the vocabulary [0, {self.vocab})")
        return ids.long()

    def hidden(self, payload: Payload, keys: torch.Tensor) -> torch.Tensor:
        """The hidden states of an admitted message, decoded.

        Raises:
            ValueError: ``client (rank N) sent hidden states that do not decode: ...``.
        """
        try:
            return self.act.decode(payload, keys)
        except ValueError as err:
            raise ValueError(f"{self.who} sent hidden states that do not decode: {err}") from None

    def served(self, b: int, length: int, prefill: bool) -> None:
        """Count a served message's tokens."""
        self.past, self.batch = (length if prefill else self.past + length), b


def serve(blocks: StageBlocks, peer: int = 0, act_codec: CodecArg = "none", return_codec: CodecArg | None = None,
          meter: BandwidthMeter | None = None, timeout: float = 300.0, group=None,
          delay: DelayLine | None = None, channel_mean: bool = False, alpha: float = ALPHA,
          channel_scale: bool = False, limits: ServerLimits = ServerLimits()) -> int:
    """Run the server's stage for the client at global rank ``peer`` until it sends :data:`END`; returns
    the number of steps served. Codecs: the client's (``act_codec`` decodes what it sends, ``return_codec``,
    default ``act_codec``, codes the answers). ``delay``: hold every answer back by its latency
    (benchmarks; as :class:`RemoteServer`'s). ``channel_mean``/``alpha``/``channel_scale``: the client's.
    ``limits``: what the client may make the server hold (:class:`ServerLimits`); every message is checked
    against them, its size bounded by :meth:`ServerLimits.message_bytes`, before anything is decoded.

    Raises:
        ValueError: a message whose meta, payload count, header, shape, dtype or size does not fit what is
            served: one line, ``client (rank N) sent ...`` (or the transport's ``corrupt message from rank N``).
        TransportError: the client died or sent nothing within ``timeout`` seconds.
    """
    recv_stream, send_stream = Receiver(peer, group, TAG), Sender(peer, group, TAG + 1, delay)
    gate = _Gate(blocks, peer, limits, Stream(act_codec, channel_mean, alpha, channel_scale))
    back = Stream(act_codec if return_codec is None else return_codec, channel_mean, alpha, channel_scale)
    from_client, to_client = Link("client->server", meter), Link("server->client", meter)
    tracker: Tracker | None = None
    steps, pending = 0, None
    while True:
        incoming = from_client.receive(recv_stream, "cpu", timeout, gate.max_bytes)
        if pending is not None:
            pending.wait(timeout)
        kind, b, length = gate.admit(incoming.meta, incoming.payloads)
        if kind == END:
            return steps
        if kind == PREFILL:
            tracker = Tracker(gate.mask(incoming.payloads[1]))
            blocks.reset()
        else:
            assert tracker is not None  # the gate admits a decode step only after a prefill
            tracker.advance()
        keys = tracker.keys(length, kind == PREFILL)
        with from_client.decoding("generate", incoming):
            hidden = gate.hidden(incoming.payloads[0], keys)
            ids = gate.ids(incoming.payloads[-1]) if blocks.needs_ids else None
        out = blocks(hidden, tracker.mask, tracker.positions, ids)
        with to_client.encoding("generate") as message:
            message.add(back.encode(out, keys), out.numel() * out.element_size())
        pending = to_client.send(send_stream, message, [HIDDEN, gate.past if kind == DECODE else 0, b, length],
                                 "server->client")
        gate.served(b, length, kind == PREFILL)
        steps += 1
