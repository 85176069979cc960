"""Split generation for decoder LMs: a client holds the embeddings, the first and last blocks and the head,
a server the blocks between, and text is generated through the link, each side with a KV cache.

The layers are those of :func:`dgpipe.models.causal_lm.causal_lm_layers` (shared with the model), cut as
``client_server_split`` cuts them for training: the client runs ``[embeddings, blocks[:k]]``, the server
``blocks[k:N-k]``, the client ``[blocks[N-k:], head]``. Generation is a prefill of the prompts (a batch,
left-padded, with their attention mask) and then one token per step; every step sends one message each
way: the client's hidden states ``(B, L, H)`` to the server (L = the prompt length at prefill, 1 after),
the server's back. Each direction has its own codec (any of :func:`dgpipe.compression.get_codec`'s, as in
training: ``act_codec`` client -> server, ``return_codec`` server -> client); the prompt's padding mask goes
once, losslessly (``intpack``), at prefill; the server keeps its own copy, grown by one column a step, and
derives the positions from it exactly as the client does. Each block keeps its keys and values in its
stage's ``transformers.DynamicCache``.

What the unsplit ``model.generate`` computes, step for step: positions ``cumsum(mask) - 1`` (0 at pads)
and one more per step; no mask at all when the prompts have no padding; greedy decoding or sampling with
temperature, top-k and top-p applied in that order to the last position's logits (as ``transformers``'
logits warpers do) and ``torch.multinomial`` on the softmax; rows that produced EOS go on with the pad
token until every row has or the token budget is spent. With a lossless codec (``none``) the tokens are
the unsplit model's, and sampling with the same seed draws the same tokens (tested).

With ``channel_mean``, each direction is coded as its residual against running per-channel means that both
sides keep alike (:func:`~dgpipe.compression.wrappers.reference.position_keys`: a sequence's first position,
later positions, padding), updated from every message's decoded rows; no token id crosses the link. A decoder's
hidden states carry a large mean per channel and a far larger first position (SmolLM2-135M: the 4-bit
codebook's perplexity cost falls from +8.8% to +1.7%, ``benchmarks/lm_generate_quality.py``). With
``channel_scale`` the residual's channels are also weighed by their running variance ** -1/4 (4 bits: +1.2%;
5 levels: +4.0%).

The wire: every message is a :class:`dgpipe.comm.transport.Sender` message whose meta is integers
(:data:`PREFILL`, :data:`DECODE`, :data:`END`, :data:`HIDDEN`, the past length, the batch size and the
step's length), checked on arrival -- nothing is unpickled. The server trusts nothing a client sends
(:class:`ServerLimits`): before it decodes or allocates anything it checks the meta (batch >= 1, length >= 1,
``past + length`` within the context it serves, ``batch x (past + length)`` within its token budget) and
every payload's header (the stream's codec; hidden states ``(batch, length, H)`` in the blocks' dtype; a
prompt mask ``(batch, length)`` of integers), and bounds the message's size by what those limits allow; a
message that does not fit is refused with a one-line ``ValueError`` that names the peer and the field
(``client (rank 0) sent ...``), and :func:`serve` ends. The client checks the server's answers the same way
(``server (rank 1) sent ...``). A dead or stalled peer raises the transport's ``TransportError`` within
``timeout``. The :class:`~dgpipe.comm.BandwidthMeter` records each
direction (``client->server`` / ``server->client``, direction ``"generate"``).

Reference: split inference of decoder LMs over a network as in Petals (Borzunov et al., "Petals:
Collaborative Inference and Fine-tuning of Large Models", ACL 2023 demo), which sends 16-bit hidden states.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from dgpipe.comm import BandwidthMeter
from dgpipe.comm.delay import DelayLine
from dgpipe.comm.transport import Receiver, Sender
from dgpipe.compression import Codec, Payload, get_codec, parse_header, raise_deferred
from dgpipe.compression.wrappers.reference import (
    POSITION_KEYS, ReferenceCoder, ScaledReferenceCoder, TokenTable, position_keys,
)
from dgpipe.models.causal_lm import CausalEmbeddings, CausalLMHead, DecoderBlock
from dgpipe.pipeline.coders import CodecArg, codec_factory

__all__ = ["Sampling", "StageBlocks", "ClientStages", "LocalServer", "RemoteServer", "ServerLimits", "serve",
           "generate", "score", "ALPHA",
           "PREFILL", "DECODE", "END", "HIDDEN"]

ALPHA = 1e-3
"""Least weight of a new row in the running channel means (``channel_mean``): about the last thousand rows of a
key count, enough for a model whose weights do not change while it serves."""

PREFILL, DECODE, END, HIDDEN = 1, 2, 3, 4
"""Message kinds (the first meta value): the client's prefill and one-token steps and its goodbye; the
server's hidden states."""
TAG = 7000
"""Tag of the generation streams (client -> server on ``TAG``, back on ``TAG + 1``)."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the last position's logits.

    Attributes:
        do_sample: False: greedy (argmax); True: sample from the softmax after the warpers below.
        temperature: logits divided by it (> 0; 1.0: unchanged).
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of tokens whose probabilities sum to at least ``top_p`` (1.0: all).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling: temperature > 0, top_k >= 0 and 0 < top_p <= 1, got {self}")

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Next token ids int64 ``(B,)`` from float ``logits`` ``(B, vocab)``."""
        if not self.do_sample:
            return logits.argmax(-1)
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
        )

        scores = logits.float()
        if self.temperature != 1.0:
            scores = TemperatureLogitsWarper(self.temperature)(None, scores)
        if self.top_k:
            scores = TopKLogitsWarper(self.top_k)(None, scores)
        if self.top_p < 1.0:
            scores = TopPLogitsWarper(self.top_p)(None, scores)
        return torch.multinomial(torch.softmax(scores, -1), 1, generator=generator).squeeze(1)


@dataclass(frozen=True)
class ServerLimits:
    """What one client may make a generation server (:func:`serve`) hold, checked before anything is decoded
    or allocated.

    Attributes:
        max_length: tokens per sequence (the prompt and every generated token: ``past + length``); ``None``:
            the model's context (``config.max_position_embeddings``).
        max_tokens: tokens the server holds for the client at once, ``batch x (past + length)``: a prefill's
            size and the KV cache's. It bounds what one message makes the server allocate: the message
            itself (:meth:`message_bytes`), the decoded hidden states and the blocks' activations
            (``max_tokens x H`` values each) and the KV cache (``max_tokens`` tokens per block); a prefill's
            attention scores take ``batch x length^2`` values per head, at most ``max_tokens x max_length``.
            The default, 4096, is a prompt of 4096 tokens or 64 sequences of 64.

    Raises:
        ValueError: a limit below 1.
    """

    max_length: int | None = None
    max_tokens: int = 4096

    def __post_init__(self) -> None:
        if (self.max_length is not None and self.max_length < 1) or self.max_tokens < 1:
            raise ValueError(f"server limits: max_length and max_tokens must be >= 1, got {self}")

    def context(self, config) -> int:
        """The tokens per sequence served: ``max_length``, at most the model's context where it has one.

        Raises:
            ValueError: neither ``max_length`` nor ``config.max_position_embeddings`` is set.
        """
        model = getattr(config, "max_position_embeddings", None)
        if self.max_length is None and model is None:
            raise ValueError("server limits: the model config has no max_position_embeddings; give max_length")
        return min(v for v in (self.max_length, model) if v is not None)

    def message_bytes(self, hidden_size: int, itemsize: int) -> int:
        """Most bytes of one client message: ``max_tokens`` hidden states of ``hidden_size`` values of
        ``itemsize`` bytes uncoded, an int64 mask value per token and 64 KiB of headers and framing."""
        return self.max_tokens * (hidden_size * itemsize + 8) + (1 << 16)


def _checked_header(payload: Payload, codec: Codec, shape: tuple[int, ...], dtype: torch.dtype | None,
                    who: str, what: str) -> None:
    """Before ``payload`` is decoded: its header is ``codec``'s, of ``shape`` and (unless None) ``dtype``.

    Raises:
        ValueError: ``{who} sent {what} ...``, naming the field that does not fit.
    """
    try:
        header = parse_header(payload.header, codec.codec_id)
    except ValueError as err:
        raise ValueError(f"{who} sent {what} with a {err}") from None
    if header.shape != shape:
        raise ValueError(f"{who} sent {what} of shape {header.shape}, want {shape}")
    if dtype is not None and header.dtype != dtype:
        raise ValueError(f"{who} sent {what} of dtype {header.dtype}, want {dtype}")


class StageBlocks:
    """A stage's decoder blocks with their KV cache: ``hidden`` ``(B, L, H)`` -> ``(B, L, H)`` per step.

    Args:
        blocks: consecutive :class:`~dgpipe.models.causal_lm.DecoderBlock` layers.
        config: the model config (sizes the cache).
    """

    def __init__(self, blocks: Iterable[nn.Module], config) -> None:
        blocks = list(blocks)
        if not all(isinstance(b, DecoderBlock) for b in blocks):
            raise ValueError("a stage of split generation holds DecoderBlock layers only")
        self.blocks, self.config = blocks, config
        self.cache = None
        self.dtype = next((p.dtype for b in blocks for p in b.parameters() if p.is_floating_point()), torch.float32)
        """The blocks' floating dtype: what the hidden states they take must be."""

    def reset(self) -> None:
        """Drop the cache (a new batch of prompts)."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.config)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block.step(hidden, mask, positions, self.cache)
        return hidden


class _Tracker:
    """The padding mask and positions of a generation, as ``transformers``' ``generate`` keeps them."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = None if bool((mask == 1).all()) else mask.long()
        self.length = mask.shape[1]
        if self.mask is None:
            self.positions = torch.arange(self.length, device=mask.device).unsqueeze(0).expand(mask.shape[0], -1)
        else:
            self.positions = (self.mask.cumsum(-1) - 1).masked_fill(self.mask == 0, 0)

    def keys(self, length: int, first: bool) -> torch.Tensor:
        """The running-mean keys int64 ``(B, length)`` of the newest ``length`` positions
        (:func:`~dgpipe.compression.wrappers.reference.position_keys`; ``first``: a prefill)."""
        return position_keys(self.mask, self.positions.shape[0], length, first)

    def advance(self) -> None:
        """One more token per row."""
        self.positions = self.positions[:, -1:] + 1
        self.length += 1
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], 1)


class _Stream:
    """One side's coder of one direction: ``codec``, and with ``channel_mean`` the residual against the running
    per-channel means of the stream's decoded rows (:func:`~dgpipe.compression.wrappers.reference.position_keys`:
    first positions, later ones, padding), which the sender and the receiver update alike from every message
    in message order, so their tables stay equal (the sender folds in its own payload's decoding)."""

    def __init__(self, codec: CodecArg, channel_mean: bool, alpha: float, channel_scale: bool = False) -> None:
        if channel_scale and not channel_mean:
            raise ValueError("channel_scale weighs the residual against the channel means: set channel_mean too")
        self.codec = codec_factory(codec)()
        self.reference: ReferenceCoder | None = None
        if channel_scale:
            self.reference = ScaledReferenceCoder(self.codec, TokenTable(POSITION_KEYS, alpha),
                                                  TokenTable(POSITION_KEYS, alpha))
        elif channel_mean:
            self.reference = ReferenceCoder(self.codec, TokenTable(POSITION_KEYS, alpha))

    def encode(self, hidden: torch.Tensor, keys: torch.Tensor) -> tuple[Payload, float]:
        """The payload of ``hidden`` ``(B, L, H)`` (``keys``: int64 ``(B, L)``, :meth:`_Tracker.keys`) and the
        seconds it took."""
        start = time.perf_counter()
        if self.reference is None:
            payload = self.codec.encode(hidden)
        else:
            payload = self.reference.encode(hidden, keys, update=True)
        return payload, time.perf_counter() - start

    def decode(self, payload: Payload, keys: torch.Tensor) -> torch.Tensor:
        """The hidden states ``(B, L, H)`` of ``payload`` (``keys`` as for :meth:`encode`).

        Raises:
            ValueError: a corrupt payload, or (with the reference) one whose shape does not fit ``keys``, or a grid
                that is not finite (read here on a device: the next token waits for these states anyway).
        """
        hidden = self.codec.decode(payload) if self.reference is None else self.reference.decode(payload, keys,
                                                                                                  update=True)
        raise_deferred()
        return hidden


class LocalServer:
    """The server's stage in the client's process: the same codecs both ways (encode, decode), no transport;
    for tests and single-machine use. ``act_codec``/``return_codec``/``channel_mean``/``alpha``/``channel_scale``:
    as for
    :func:`generate`'s servers (:class:`RemoteServer`). The meter records the payload bytes a
    :class:`RemoteServer` sends and receives (the prompt mask included), not the transport's framing."""

    def __init__(self, blocks: StageBlocks, act_codec: CodecArg = "none", return_codec: CodecArg | None = None,
                 meter: BandwidthMeter | None = None, channel_mean: bool = False, alpha: float = ALPHA,
                 channel_scale: bool = False) -> None:
        self.stage = blocks
        ret = act_codec if return_codec is None else return_codec
        # one coder per side and direction, as between processes: (sender, receiver)
        self.act = (_Stream(act_codec, channel_mean, alpha, channel_scale),
                    _Stream(act_codec, channel_mean, alpha, channel_scale))
        self.back = (_Stream(ret, channel_mean, alpha, channel_scale), _Stream(ret, channel_mean, alpha, channel_scale))
        self.mask_codec = get_codec("intpack")
        self.meter = meter
        self.tracker: _Tracker | None = None

    def __call__(self, hidden: torch.Tensor, prompt_mask: torch.Tensor | None) -> torch.Tensor:
        if prompt_mask is not None:
            self.stage.reset()
            self.tracker = _Tracker(prompt_mask)
        else:
            self.tracker.advance()
        keys = self.tracker.keys(hidden.shape[1], prompt_mask is not None)
        mask = [self.mask_codec.encode(prompt_mask.long())] if prompt_mask is not None else []
        hidden = self._hop(self.act, hidden, keys, "client->server", mask)
        hidden = self.stage(hidden, self.tracker.mask, self.tracker.positions)
        return self._hop(self.back, hidden, keys, "server->client")

    def _hop(self, coders: tuple["_Stream", "_Stream"], hidden: torch.Tensor, keys: torch.Tensor, name: str,
             extra: Sequence[Payload] = ()) -> torch.Tensor:
        """``hidden`` through a direction's coders (encode, meter with the ``extra`` payloads a message to a
        server process carries beside it -- the prompt mask at prefill --, decode)."""
        payload, seconds = coders[0].encode(hidden, keys)
        if self.meter is not None:
            self.meter.record_send(name, "generate", raw_bytes=hidden.numel() * hidden.element_size(),
                                   wire_bytes=payload.nbytes + sum(p.nbytes for p in extra), encode_seconds=seconds)
        return coders[1].decode(payload, keys)

    def close(self) -> None:
        """Nothing to end in process."""


class RemoteServer:
    """The client's end of the link to a server process (:func:`serve`) at global rank ``peer``.

    ``delay``: a :class:`~dgpipe.comm.delay.DelayLine` that holds every message to the server back by
    its latency (benchmarks on kernels without ``netem``; ``None``: send at once). The meter records per
    direction the payload bytes (``wire_bytes``), the transport's framing around them (``frame_bytes``:
    the message's meta and size fields) and the codec's seconds. ``channel_mean``: code each direction against
    the running per-channel means both sides keep (module docstring; ``alpha``: the least weight of a new row,
    :data:`ALPHA`); ``channel_scale``: also weigh each channel of the residual by its running variance to the
    power -1/4 (:class:`~dgpipe.compression.wrappers.reference.ScaledReferenceCoder`). :func:`serve` must be
    given the same; a ``channel_scale`` without ``channel_mean`` is a ``ValueError``.
    """

    def __init__(self, peer: int = 1, act_codec: CodecArg = "none", return_codec: CodecArg | None = None,
                 meter: BandwidthMeter | None = None, timeout: float = 300.0, group=None,
                 delay: DelayLine | None = None, channel_mean: bool = False, alpha: float = ALPHA,
                 channel_scale: bool = False) -> None:
        self.send_stream, self.recv_stream = Sender(peer, group, TAG, delay), Receiver(peer, group, TAG + 1)
        self.codec = _Stream(act_codec, channel_mean, alpha, channel_scale)
        self.back = _Stream(act_codec if return_codec is None else return_codec, channel_mean, alpha, channel_scale)
        self.mask_codec = get_codec("intpack")
        self.meter, self.timeout, self.peer = meter, timeout, peer
        self.past = 0
        self.tracker: _Tracker | None = None

    def __call__(self, hidden: torch.Tensor, prompt_mask: torch.Tensor | None) -> torch.Tensor:
        b, length = hidden.shape[:2]
        if prompt_mask is not None:
            self.past, self.tracker = 0, _Tracker(prompt_mask)
        else:
            self.tracker.advance()
        keys = self.tracker.keys(length, prompt_mask is not None)
        payload, seconds = self.codec.encode(hidden, keys)
        payloads = [payload] + ([self.mask_codec.encode(prompt_mask.long())] if prompt_mask is not None else [])
        kind = PREFILL if prompt_mask is not None else DECODE
        work = self.send_stream.send(payloads, [kind, self.past, b, length], "client->server")
        work.wait(self.timeout)
        if self.meter is not None:
            wire = sum(p.nbytes for p in payloads)
            self.meter.record_send("client->server", "generate", raw_bytes=hidden.numel() * hidden.element_size(),
                                   wire_bytes=wire, frame_bytes=work.nbytes - wire, encode_seconds=seconds)
        who = f"server (rank {self.peer})"
        start = time.perf_counter()
        back, meta = self.recv_stream.recv("cpu", self.timeout, self.max_bytes(hidden))
        waited = time.perf_counter() - start
        if meta != [HIDDEN, self.past, b, length] or len(back) != 1:
            raise ValueError(f"{who} answered {meta} with {len(back)} payloads to a "
                             f"{['', 'prefill', 'decode'][kind]} of {b}x{length} tokens at past {self.past}")
        _checked_header(back[0], self.back.codec, tuple(hidden.shape), None, who, "hidden states")
        start = time.perf_counter()
        try:
            out = self.back.decode(back[0], keys)
        except ValueError as err:
            raise ValueError(f"{who} sent hidden states that do not decode: {err}") from None
        decoded = time.perf_counter() - start
        if not out.is_floating_point():
            raise ValueError(f"{who} sent hidden states of dtype {out.dtype}, want a floating dtype")
        if self.meter is not None:
            self.meter.record_recv("server->client", "generate", recv_bytes=back[0].nbytes, recv_seconds=waited,
                                   decode_seconds=decoded)
        self.past += length
        return out.to(hidden.dtype)

    @staticmethod
    def max_bytes(hidden: torch.Tensor) -> int:
        """Most bytes of the server's answer to ``hidden``: its values uncoded in float64 and 64 KiB of
        headers and framing."""
        return hidden.numel() * 8 + (1 << 16)

    def close(self) -> None:
        """Tell the server this client is done (it returns from :func:`serve`)."""
        self.send_stream.send([], [END, self.past, 0, 0], "client->server").wait(self.timeout)


class _Gate:
    """The server's checks of one client's messages (:class:`ServerLimits`), made before anything is decoded or
    allocated, and the state they are checked against: the past length and batch of the generation served."""

    def __init__(self, blocks: StageBlocks, peer: int, limits: ServerLimits, act: _Stream) -> None:
        self.who, self.act = f"client (rank {peer})", act
        self.hidden_size, self.dtype = blocks.config.hidden_size, blocks.dtype
        self.context, self.max_tokens = limits.context(blocks.config), limits.max_tokens
        self.max_bytes = limits.message_bytes(self.hidden_size, max(self.dtype.itemsize, 4))
        self.mask_codec = get_codec("intpack")
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
        want = 2 if kind == PREFILL else 1
        if len(payloads) != want:
            raise ValueError(f"{who} sent {len(payloads)} payloads with meta {meta}; a "
                             f"{'prefill' if kind == PREFILL else 'decode step'} has {want}")
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
        _checked_header(payloads[0], self.act.codec, (b, length, self.hidden_size), self.dtype, who, "hidden states")
        if kind == PREFILL:
            _checked_header(payloads[1], self.mask_codec, (b, length), None, who, "a prompt mask")
        return kind, b, length

    def mask(self, payload: Payload) -> torch.Tensor:
        """The prompt mask of an admitted prefill: int64 ``(B, L)`` of 0/1 with a token in every row.

        Raises:
            ValueError: ``client (rank N) sent a prompt mask ...`` that does not decode or fit.
        """
        try:
            mask = self.mask_codec.decode(payload)
        except ValueError as err:
            raise ValueError(f"{self.who} sent a prompt mask that does not decode: {err}") from None
        if mask.is_floating_point() or bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"{self.who} sent a prompt mask of {mask.dtype} values other than 0 and 1")
        if not bool(mask.any(1).all()):
            raise ValueError(f"{self.who} sent a prompt mask with an empty row (a prompt of no token)")
        return mask.long()

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
    gate = _Gate(blocks, peer, limits, _Stream(act_codec, channel_mean, alpha, channel_scale))
    back = _Stream(act_codec if return_codec is None else return_codec, channel_mean, alpha, channel_scale)
    tracker: _Tracker | None = None
    steps, pending = 0, None
    while True:
        start = time.perf_counter()
        payloads, meta = recv_stream.recv("cpu", timeout, gate.max_bytes)
        waited = time.perf_counter() - start
        if pending is not None:
            pending.wait(timeout)
        kind, b, length = gate.admit(meta, payloads)
        if kind == END:
            return steps
        if kind == PREFILL:
            tracker = _Tracker(gate.mask(payloads[1]))
            blocks.reset()
        else:
            assert tracker is not None  # the gate admits a decode step only after a prefill
            tracker.advance()
        keys = tracker.keys(length, kind == PREFILL)
        start = time.perf_counter()
        hidden = gate.hidden(payloads[0], keys)
        decoded = time.perf_counter() - start
        if meter is not None:
            meter.record_recv("client->server", "generate", recv_bytes=sum(p.nbytes for p in payloads),
                              recv_seconds=waited, decode_seconds=decoded)
        out = blocks(hidden, tracker.mask, tracker.positions)
        payload, seconds = back.encode(out, keys)
        pending = send_stream.send([payload], [HIDDEN, gate.past if kind == DECODE else 0, b, length],
                                   "server->client")
        if meter is not None:
            meter.record_send("server->client", "generate", raw_bytes=out.numel() * out.element_size(),
                              wire_bytes=payload.nbytes, frame_bytes=pending.nbytes - payload.nbytes,
                              encode_seconds=seconds)
        gate.served(b, length, kind == PREFILL)
        steps += 1


class ClientStages:
    """The client's layers of a split LM: the embeddings and first blocks (``front``), the last blocks and
    the head (``back``), each block run with the client's KV cache (:class:`StageBlocks`) -- the client's
    stages of ``client_server_split(causal_lm_layers(model), k, (1, 1))`` (:mod:`dgpipe.models.split`).

    Raises:
        ValueError: ``front`` does not start with the embeddings or ``back`` does not end with the head.
    """

    def __init__(self, front: Iterable[nn.Module], back: Iterable[nn.Module], config) -> None:
        front, back = list(front), list(back)
        if not front or not isinstance(front[0], CausalEmbeddings) or not back or \
                not isinstance(back[-1], CausalLMHead):
            raise ValueError("split generation takes the client stages of client_server_split(causal_lm_layers(model), "
                             "k, (1, 1)): the embeddings first, the head last")
        self.embeddings, self.head = front[0], back[-1]
        self.first, self.last = StageBlocks(front[1:], config), StageBlocks(back[:-1], config)


def _through(client: ClientStages, server: Callable, ids: torch.Tensor, tracker: _Tracker,
             prompt_mask: torch.Tensor | None) -> torch.Tensor:
    """The client's front, the server (``prompt_mask`` at prefill, None after) and the client's back blocks on
    the new tokens ``ids`` ``(B, L)``: the last block's hidden states ``(B, L, H)``."""
    hidden = client.first(client.embeddings.step(ids, tracker.positions), tracker.mask, tracker.positions)
    return client.last(server(hidden, prompt_mask), tracker.mask, tracker.positions)


@torch.no_grad()
def generate(client: ClientStages, server: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
             input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
             sampling: Sampling = Sampling(), eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None,
             generator: torch.Generator | None = None, max_length: int | None = None,
             timings: list[float] | None = None) -> torch.Tensor:
    """Generate through the link: prefill, then one token per step until every row produced
    ``eos_token_id`` or ``max_new_tokens`` were generated.

    Args:
        client: the client's layers.
        server: :class:`LocalServer` or :class:`RemoteServer` (called with the front's hidden states and,
            at prefill, the prompt mask; returns the server's hidden states).
        input_ids: int64 ``(B, L)`` prompts, left-padded.
        attention_mask: int ``(B, L)``, 1 = token (default: all ones).
        sampling: greedy or sampling (:class:`Sampling`); ``generator``: its random numbers (default: torch's
            global generator, as ``model.generate`` uses).
        eos_token_id / pad_token_id: stop token(s), and the token finished rows continue with (default: the
            first stop token).
        max_length: the model's context; prompts plus new tokens past it are refused before anything is sent.
        timings: if given, the wall seconds of each step are appended (the first: prefill, the time to
            the first token).

    Returns:
        int64 ``(B, L + n)``: the prompts followed by the ``n <= max_new_tokens`` generated tokens.

    Raises:
        ValueError: bad shapes, an empty prompt, ``max_new_tokens < 1``, or a generation past ``max_length``.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids: int64 (batch, length >= 1), got {tuple(input_ids.shape)} {input_ids.dtype}")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    if not bool(mask.any(1).all()):
        raise ValueError(f"attention_mask: row {int((~mask.any(1)).nonzero()[0])} has no token (an empty prompt)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_length is not None and input_ids.shape[1] + max_new_tokens > max_length:
        raise ValueError(f"a prompt of {input_ids.shape[1]} tokens plus {max_new_tokens} new ones is past the "
                         f"model's context of {max_length} tokens")
    stops = None if eos_token_id is None else torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=torch.long)
    pad = (int(stops[0]) if stops is not None else 0) if pad_token_id is None else pad_token_id
    tracker = _Tracker(mask)
    client.first.reset()
    client.last.reset()
    out, ids, prompt_mask = input_ids, input_ids, mask
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        start = time.perf_counter()
        hidden = _through(client, server, ids, tracker, prompt_mask)
        token = sampling.pick(client.head(hidden[:, -1:])[:, -1], generator)
        if stops is not None:
            token = torch.where(done, torch.full_like(token, pad), token)
            done |= torch.isin(token, stops)
        out = torch.cat([out, token[:, None]], 1)
        if timings is not None:
            timings.append(time.perf_counter() - start)
        if stops is not None and bool(done.all()):
            break
        ids, prompt_mask = token[:, None], None
        tracker.advance()
    return out


@torch.no_grad()
def score(client: ClientStages, server: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
          input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of every position of ``input_ids`` int64 ``(B, L)`` computed through the link as a
    prefill (the KV-cache path of :func:`generate`): float ``(B, L, vocab)``. Held-out perplexity and
    teacher-forced top-1 agreement through a codec come from these."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    tracker = _Tracker(mask)
    client.first.reset()
    client.last.reset()
    return client.head(_through(client, server, input_ids, tracker, mask))
