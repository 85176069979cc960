"""The layers each side of split generation runs: a stage's decoder blocks with their KV cache, and the client's
embeddings, first and last blocks and head (:mod:`dgpipe.generation`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from dgpipe.models.bottleneck import BottleneckDecoder, BottleneckEncoder
from dgpipe.models.causal_lm import CausalEmbeddings, CausalLMHead, DecoderBlock

__all__ = ["StageBlocks", "ClientStages"]


class StageBlocks:
    """A stage's decoder blocks with their KV cache: hidden states ``(B, L, width_in)`` -> ``(B, L, width_out)``
    per step; with boundary bottlenecks (:mod:`dgpipe.models.bottleneck`) the stage starts with the decoder of the
    pair before it (``d -> H``) and ends with the encoder of the pair after it (``H -> d``), so what crosses
    each boundary is the pair's ``d`` channels.

    Args:
        layers: an optional :class:`~dgpipe.models.bottleneck.BottleneckDecoder`, consecutive
            :class:`~dgpipe.models.causal_lm.DecoderBlock` layers, an optional
            :class:`~dgpipe.models.bottleneck.BottleneckEncoder`.
        config: the model config (sizes the cache).

    An anchored pair (``--bottleneck-anchor`` or ``--bottleneck-subspace``: :mod:`dgpipe.models.bottleneck`) adds
    or subtracts a token table's rows of the new tokens' ids, so such a stage is called with them
    (:attr:`needs_ids`; between processes they cross beside the hidden states).

    Raises:
        ValueError: other layers.
    """

    def __init__(self, layers: Iterable[nn.Module], config) -> None:
        layers = list(layers)
        first, last = (layers[0], layers[-1]) if layers else (None, None)
        self.decoder = first if isinstance(first, BottleneckDecoder) else None
        self.encoder = last if isinstance(last, BottleneckEncoder) else None
        layers = layers[self.decoder is not None: len(layers) - (self.encoder is not None)]
        if not all(isinstance(b, DecoderBlock) for b in layers):
            raise ValueError("a stage of split generation holds DecoderBlock layers only (with a bottleneck's "
                             "decoder first and an encoder last)")
        self.needs_ids: bool = any(pair is not None and pair.anchor is not None
                                   for pair in (self.decoder, self.encoder))
        """The stage's pairs are anchored: it takes the new tokens' ids."""
        self.blocks, self.config = layers, config
        self.cache = None
        self._blocks_dtype: torch.dtype = next((p.dtype for b in layers for p in b.parameters()
                                                if p.is_floating_point()), torch.float32)
        self.dtype: torch.dtype = self._blocks_dtype if self.decoder is None else self.decoder.proj.weight.dtype
        """What the hidden states the stage takes must be: the blocks' floating dtype, or its bottleneck's."""
        hidden_size = int(config.hidden_size)
        self.width_in: int = hidden_size if self.decoder is None else self.decoder.proj.in_features
        """Channels of the hidden states the stage takes: a bottleneck's width, else the model's."""
        self.width_out: int = hidden_size if self.encoder is None else self.encoder.proj.out_features
        """Channels of the hidden states the stage gives."""

    def reset(self) -> None:
        """Drop the cache (a new batch of prompts)."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.config)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
        """One step: ``hidden`` ``(B, L, width_in)`` of the new tokens at ``positions`` int64 ``(B, L)`` (``mask``:
        :meth:`DecoderBlock.step`'s; ``ids``: their token ids, int64 ``(B, L)``, for anchored pairs) ->
        ``(B, L, width_out)``.

        Raises:
            ValueError: anchored pairs called without ``ids``.
        """
        if self.needs_ids and ids is None:
            raise ValueError("this stage's bottlenecks are anchored: call it with the new tokens' ids")
        if self.decoder is not None:
            hidden = _pair(self.decoder, hidden.to(self.dtype), ids).to(self._blocks_dtype)
        for block in self.blocks:
            hidden = block.step(hidden, mask, positions, self.cache)
        if self.encoder is not None:
            hidden = _pair(self.encoder, hidden.to(self.encoder.proj.weight.dtype), ids)
        return hidden


def _pair(layer: BottleneckDecoder | BottleneckEncoder, hidden: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """A pair's half on ``hidden``, with the token ids its anchor reads where it has one."""
    return layer(hidden) if layer.anchor is None else layer((hidden, ids))[0]


class ClientStages:
    """The client's layers of a split LM: the embeddings and first blocks (``front``), the last blocks and
    the head (``back``), each block run with the client's KV cache (:class:`StageBlocks`) -- the client's
    stages of ``client_server_split(causal_lm_layers(model), k, (1, 1))`` (:mod:`dgpipe.models.split`), or of a
    run's client/server partition with boundary bottlenecks (``front`` then ends with an encoder, ``back`` starts
    with a decoder).

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
        self.sends_ids: bool = self.first.needs_ids or self.last.needs_ids
        """The client's pairs are anchored, so are the server's: the token ids go to the server too."""
