"""The layers each side of split generation runs: a stage's decoder blocks with their KV cache, and the client's
embeddings, first and last blocks and head (:mod:`dgpipe.generation`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from dgpipe.models.causal_lm import CausalEmbeddings, CausalLMHead, DecoderBlock

__all__ = ["StageBlocks", "ClientStages"]


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
