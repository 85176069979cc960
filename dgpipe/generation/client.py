"""The client of split generation: the next token's choice, the link to a server process, and the generation and
scoring loops (:mod:`dgpipe.generation`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dgpipe.comm import BandwidthMeter
from dgpipe.comm.delay import DelayLine
from dgpipe.comm.link import Link
from dgpipe.comm.transport import Receiver, Sender
from dgpipe.compression import get_codec
from dgpipe.pipeline.coders import CodecArg

from .protocol import ALPHA, DECODE, END, HIDDEN, PREFILL, TAG, Stream, Tracker, checked_header
from .stages import ClientStages

__all__ = ["Sampling", "RemoteServer", "generate", "score"]


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


class RemoteServer:
    """The client's end of the link to a server process (:func:`serve`) at global rank ``peer``.

    ``delay``: a :class:`~dgpipe.comm.delay.DelayLine` that holds every message to the server back by
    its latency (benchmarks on kernels without ``netem``; ``None``: send at once). The meter records per
    direction the payload bytes (``wire_bytes``), the transport's framing around them (``frame_bytes``:
    the message's meta and size fields) and the codec's seconds. ``channel_mean``: code each direction against
    the running per-channel means both sides keep (module docstring; ``alpha``: the least weight of a new row,
    :data:`ALPHA`); ``channel_scale``: also weigh each channel of the residual by its running variance to the
    power -1/4 (:class:`~dgpipe.compression.wrappers.reference.ScaledReferenceCoder`). :func:`serve` must be
    given the same; a ``channel_scale`` without ``channel_mean`` is a ``ValueError``. ``answer_width``: the
    channels of the server's answers (its last bottleneck's width, :attr:`StageBlocks.width_out`; ``None``: as
    many as the client sends). ``send_ids``: every message also carries the new tokens' ids (``intpack``), which a
    server whose pairs are anchored needs (:attr:`ClientStages.sends_ids`); the prompt's text then leaves the client.
    """

    def __init__(self, peer: int = 1, act_codec: CodecArg = "none", return_codec: CodecArg | None = None,
                 meter: BandwidthMeter | None = None, timeout: float = 300.0, group=None,
                 delay: DelayLine | None = None, channel_mean: bool = False, alpha: float = ALPHA,
                 channel_scale: bool = False, answer_width: int | None = None, send_ids: bool = False) -> None:
        self.send_stream, self.recv_stream = Sender(peer, group, TAG, delay), Receiver(peer, group, TAG + 1)
        self.answer_width, self.send_ids = answer_width, send_ids
        self.codec = Stream(act_codec, channel_mean, alpha, channel_scale)
        self.back = Stream(act_codec if return_codec is None else return_codec, channel_mean, alpha, channel_scale)
        self.int_codec = get_codec("intpack")
        self.meter = meter
        self.timeout, self.peer = timeout, peer
        self.past = 0
        self.tracker: Tracker | None = None

    def __call__(self, hidden: torch.Tensor, prompt_mask: torch.Tensor | None,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
        """The server's hidden states of one step: ``hidden`` ``(B, L, H)`` the front's, ``prompt_mask`` int
        ``(B, L)`` at prefill (None after), ``ids`` int64 ``(B, L)`` the new tokens (sent with ``send_ids``).

        Raises:
            ValueError: ``send_ids`` without ``ids``; an answer whose meta, header or payload does not fit.
            TransportError: the server died or did not answer within the timeout.
        """
        if self.send_ids and ids is None:
            raise ValueError("send_ids: give the new tokens' ids with every step")
        b, length = hidden.shape[:2]
        if prompt_mask is not None:
            self.past, self.tracker = 0, Tracker(prompt_mask)
        else:
            self.tracker.advance()
        keys = self.tracker.keys(length, prompt_mask is not None)
        to_server, from_server = Link("client->server", self.meter), Link("server->client", self.meter)
        with to_server.encoding("generate") as message:
            message.add(self.codec.encode(hidden, keys), hidden.numel() * hidden.element_size())
            if prompt_mask is not None:
                message.add(self.int_codec.encode(prompt_mask.long()))
            if self.send_ids and ids is not None:
                message.add(self.int_codec.encode(ids))
        kind = PREFILL if prompt_mask is not None else DECODE
        to_server.send(self.send_stream, message, [kind, self.past, b, length], "client->server").wait(
            self.timeout)
        who = f"server (rank {self.peer})"
        shape = (b, length, hidden.shape[2] if self.answer_width is None else self.answer_width)
        answer = from_server.receive(self.recv_stream, "cpu", self.timeout, self.max_bytes(shape))
        if answer.meta != [HIDDEN, self.past, b, length] or len(answer.payloads) != 1:
            raise ValueError(f"{who} answered {answer.meta} with {len(answer.payloads)} payloads to a "
                             f"{['', 'prefill', 'decode'][kind]} of {b}x{length} tokens at past {self.past}")
        checked_header(answer.payloads[0], self.back.codec, shape, None, who, "hidden states")
        with from_server.decoding("generate", answer):
            try:
                out = self.back.decode(answer.payloads[0], keys)
            except ValueError as err:
                raise ValueError(f"{who} sent hidden states that do not decode: {err}") from None
            if not out.is_floating_point():
                raise ValueError(f"{who} sent hidden states of dtype {out.dtype}, want a floating dtype")
        self.past += length
        return out.to(hidden.dtype)

    @staticmethod
    def max_bytes(shape: tuple[int, ...]) -> int:
        """Most bytes of a server's answer of hidden states of ``shape``: its values uncoded in float64 and 64 KiB
        of headers and framing."""
        return math.prod(shape) * 8 + (1 << 16)

    def close(self) -> None:
        """Tell the server this client is done (it returns from :func:`serve`)."""
        self.send_stream.send([], [END, self.past, 0, 0], "client->server").wait(self.timeout)


def _through(client: ClientStages, server: Callable, ids: torch.Tensor, tracker: Tracker,
             prompt_mask: torch.Tensor | None) -> torch.Tensor:
    """The client's front, the server (``prompt_mask`` at prefill, None after; the ids) and the client's back blocks
    on the new tokens ``ids`` ``(B, L)``: the last block's hidden states ``(B, L, H)``."""
    hidden = client.first(client.embeddings.step(ids, tracker.positions), tracker.mask, tracker.positions, ids)
    return client.last(server(hidden, prompt_mask, ids), tracker.mask, tracker.positions, ids)


@torch.no_grad()
def generate(client: ClientStages, server: Callable[..., torch.Tensor],
             input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
             sampling: Sampling = Sampling(), eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None,
             generator: torch.Generator | None = None, max_length: int | None = None,
             timings: list[float] | None = None) -> torch.Tensor:
    """Generate through the link: prefill, then one token per step until every row produced
    ``eos_token_id`` or ``max_new_tokens`` were generated.

    Args:
        client: the client's layers.
        server: :class:`LocalServer` or :class:`RemoteServer` (called with the front's hidden states, the prompt
            mask at prefill or None, and the new tokens' ids; returns the server's hidden states).
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
    tracker = Tracker(mask)
    client.first.reset()
    client.last.reset()
    out, ids, prompt_mask = input_ids, input_ids, mask
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        start = time.perf_counter()
        hidden = _through(client, server, ids, tracker, prompt_mask)
        token = sampling.pick(client.head.step(hidden[:, -1:])[:, -1], generator)
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
def score(client: ClientStages, server: Callable[..., torch.Tensor],
          input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of every position of ``input_ids`` int64 ``(B, L)`` computed through the link as a
    prefill (the KV-cache path of :func:`generate`): float ``(B, L, vocab)``. Held-out perplexity and
    teacher-forced top-1 agreement through a codec come from these."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    tracker = Tracker(mask)
    client.first.reset()
    client.last.reset()
    return client.head.step(_through(client, server, input_ids, tracker, mask))
