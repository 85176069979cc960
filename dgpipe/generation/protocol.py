"""The split-generation link's protocol: message kinds, what a server admits, the checks of a payload's header,
the running per-channel means both sides keep, and the positions of a generation (:mod:`dgpipe.generation`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpipe.compression import Codec, Payload, parse_header, raise_deferred
from dgpipe.compression.wrappers.reference import (
    POSITION_KEYS, ReferenceCoder, ScaledReferenceCoder, TokenTable, position_keys,
)
from dgpipe.pipeline.coders import CodecArg, codec_factory

__all__ = ["ALPHA", "PREFILL", "DECODE", "END", "HIDDEN", "TAG", "ServerLimits", "checked_header", "Tracker", "Stream"]

ALPHA = 1e-3
"""Least weight of a new row in the running channel means (``channel_mean``): about the last thousand rows of a
key count, enough for a model whose weights do not change while it serves."""

PREFILL, DECODE, END, HIDDEN = 1, 2, 3, 4
"""Message kinds (the first meta value): the client's prefill and one-token steps and its goodbye; the
server's hidden states."""
TAG = 7000
"""Tag of the generation streams (client -> server on ``TAG``, back on ``TAG + 1``)."""


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

    def message_bytes(self, hidden_size: int, itemsize: int, ints: int = 1) -> int:
        """Most bytes of one client message: ``max_tokens`` hidden states of ``hidden_size`` values of
        ``itemsize`` bytes uncoded, ``ints`` int64 values per token (the mask; the ids too, to anchored pairs) and
        64 KiB of headers and framing."""
        return self.max_tokens * (hidden_size * itemsize + 8 * ints) + (1 << 16)


def checked_header(payload: Payload, codec: Codec, shape: tuple[int, ...], dtype: torch.dtype | None,
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


class Tracker:
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


class Stream:
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

    def encode(self, hidden: torch.Tensor, keys: torch.Tensor) -> Payload:
        """The payload of ``hidden`` ``(B, L, H)`` (``keys``: int64 ``(B, L)``, :meth:`Tracker.keys`)."""
        if self.reference is None:
            return self.codec.encode(hidden)
        return self.reference.encode(hidden, keys, update=True)

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
