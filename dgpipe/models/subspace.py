"""A residual stream in a shared subspace: every stage boundary of a decoder LM coded exactly in ``k`` channels.

Subspace Networks (Ramasinghe et al., "Protocol Models: Scaling Decentralized Training with Communication-Efficient
Model Parallelism", arXiv 2506.01260) constrain what a decoder's layers write to its residual stream to one
``k``-dimensional subspace shared by the whole model, spanned by an orthonormal basis ``U`` ``(H, k)``, and keep
the token-specific part outside it in a fixed table ``T`` ``(V, H)`` that every stage rebuilds from the token ids.
The residual stream after any layer is then ``x = T[ids] + U c`` with ``c`` ``(..., k)``, so the boundary pair
``c = U^T (x - T[ids])`` / ``x = U c + T[ids]`` loses nothing: ``k`` channels cross forward, and their gradient
``U^T dL/dx`` -- exact -- crosses back. The codecs code those ``k`` channels; the ids cross forward beside them.

Here (:func:`constrain_layers`):

- ``T`` is the token embedding as initialised (with the family's own scaling, e.g. Gemma 3's ``sqrt(H)``), fixed;
  the trained embedding ``E`` enters the stream only through the subspace: ``x_0 = T[ids] + P (E[ids] - T[ids])``
  with ``P = U U^T`` (at initialisation ``x_0 = E[ids]``; a tied LM head still reads all of ``E``);
- every decoder block's update is projected: ``x_out = x_in + P (block(x_in) - x_in)`` -- for a pre-norm block
  the same as projecting the rows of its attention output and MLP down projections, and family-agnostic;
- the pairs (:func:`subspace_pairs`) are the anchored bottlenecks of :mod:`dgpipe.models.bottleneck` with
  ``W_e = U^T``, ``W_d = U``, zero biases, frozen; the anchor is this module (``ids -> T[ids]``).

``U`` is a random orthonormal basis drawn from a seed and fixed (the paper's Grassmann updates of ``U`` are not
done). The constraint is for training from scratch: a pretrained model's blocks write outside any such subspace.

With *stage tables* instead (``anchors`` of :func:`subspace_pairs`, ``constrain_layers(..., embeddings=False)``),
the table need not be one: each stage adds and subtracts its own trained token table ``T_j`` -- the first stage the
model's embedding ``E`` itself, unconstrained (``x_0 = E[ids]``), every later one a table started as a copy of
``E`` -- so the stream inside stage ``j`` is ``T_j[ids] + U c`` and its pair's round trip is still exact, while
every stage's blocks read a token embedding that trains (MAPL's per-stage anchor embeddings, arXiv 2606.05484,
with the subspace constraint); the tables add ``(S - 1) V H`` parameters and no multiply-adds (lookups).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .bottleneck import BottleneckDecoder, BottleneckEncoder, insert_bottlenecks
from .causal_lm import CausalEmbeddings, DecoderBlock

__all__ = ["ResidualSubspace", "residual_subspace", "constrain_layers", "subspace_pairs"]


class ResidualSubspace(nn.Module):
    """The basis and the fixed token table of a residual stream in a shared subspace (module docstring).

    Both are non-persistent buffers (not in a state dict): every rank rebuilds them from the seed and the model as
    initialised (:func:`residual_subspace`).

    Attributes:
        basis: float32 ``(H, k)``, orthonormal columns ``U``.
        table: ``(V, H)`` in the embedding's dtype: ``T``, the token embedding as initialised; None with stage
            tables (then nothing calls this module with ids).
    """

    basis: torch.Tensor
    table: torch.Tensor | None

    def __init__(self, basis: torch.Tensor, table: torch.Tensor | None) -> None:
        super().__init__()
        if basis.dim() != 2 or table is not None and (table.dim() != 2 or basis.shape[0] != table.shape[1]):
            raise ValueError(f"a basis (H, k) and a token table (V, H), got {tuple(basis.shape)} and "
                             f"{None if table is None else tuple(table.shape)}")
        self.register_buffer("basis", basis.float(), persistent=False)
        self.register_buffer("table", table, persistent=False)

    @property
    def width(self) -> int:
        """``k``: the channels that cross a boundary."""
        return int(self.basis.shape[1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``T[ids]``: int64 ``(...)`` -> ``(..., H)`` (the pairs' anchor).

        Raises:
            ValueError: a subspace built without its table (stage tables).
        """
        if self.table is None:
            raise ValueError("this residual subspace has no fixed token table (built for stage tables)")
        return nn.functional.embedding(ids, self.table)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``P x = U U^T x`` over the last dimension: ``(..., H)`` -> ``(..., H)``, ``x``'s dtype."""
        basis = self.basis.to(x.dtype)
        return (x @ basis) @ basis.T

    def constrain(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """``old + P (new - old)``: the update from ``old`` to ``new`` (both ``(..., H)``) kept in the subspace."""
        return old + self.project(new - old)


@torch.no_grad()
def residual_subspace(embed_tokens: nn.Module, vocab_size: int, width: int, seed: int,
                      table: bool = True) -> ResidualSubspace:
    """The subspace of ``width`` channels of a model whose token embedding is ``embed_tokens`` (as initialised).

    Args:
        embed_tokens: ``ids -> (..., H)``; its outputs for all ``vocab_size`` ids become the fixed table ``T``.
        width: ``k`` in ``[1, H]``.
        seed: the basis is the Q of a QR decomposition of a standard normal ``(H, k)`` matrix drawn from it.
        table: build ``T``; False with stage tables, which never read it.

    Raises:
        ValueError: ``width`` outside ``[1, H]``.
    """
    device = next(iter(embed_tokens.parameters())).device
    ids = torch.arange(vocab_size if table else 1, device=device)
    fixed = embed_tokens(ids).detach().clone()
    hidden_size = fixed.shape[1]
    if not 1 <= width <= hidden_size:
        raise ValueError(f"a residual subspace of {width} channels: must be in [1, {hidden_size}]")
    basis, _ = torch.linalg.qr(torch.randn(hidden_size, width, generator=torch.Generator().manual_seed(seed)))
    return ResidualSubspace(basis.to(device), fixed if table else None)


def constrain_layers(layers: Sequence[nn.Module], subspace: ResidualSubspace, embeddings: bool = True) -> None:
    """Constrain a decoder LM's layers (:func:`~dgpipe.models.causal_lm.causal_lm_layers`, built with
    ``carry_ids=True``) to ``subspace``, in place: the embeddings (unless ``embeddings`` is false: with stage
    tables) and every block (module docstring).

    Raises:
        ValueError: layers that do not carry the token ids, or no embeddings layer.
    """
    if not any(isinstance(layer, CausalEmbeddings) for layer in layers):
        raise ValueError("a residual subspace constrains a decoder LM's layers: no embeddings layer among them")
    for layer in layers:
        if isinstance(layer, DecoderBlock) or embeddings and isinstance(layer, CausalEmbeddings):
            if not layer.carry_ids:
                raise ValueError("a residual subspace needs the token ids beside the hidden states on every stage: "
                                 "build the layers with carry_ids=True")
            layer.subspace = subspace


def subspace_pairs(stages: Sequence[nn.Module], subspace: ResidualSubspace,
                   anchors: Sequence[nn.Module] | None = None) -> list[nn.Sequential]:
    """The stages with a frozen pair of ``subspace.width`` channels at every boundary: ``U^T (x - T[ids])`` out of
    each stage but the last, ``U c + T[ids]`` into each but the first (:func:`~.bottleneck.insert_bottlenecks`).

    Args:
        anchors: one token table ``ids -> (..., H)`` per stage, the stage's pairs' ``T`` (stage tables, module
            docstring); None: ``subspace``'s fixed table everywhere.

    Raises:
        ValueError: fewer than two stages, or not one anchor per stage.
    """
    if anchors is not None and len(anchors) != len(stages):
        raise ValueError(f"{len(anchors)} token tables for {len(stages)} stages: give one per stage")
    shaped = insert_bottlenecks(stages, subspace.width, subspace.basis.shape[0], "orthonormal", anchor=subspace)
    with torch.no_grad():
        for j, stage in enumerate(shaped):
            for layer in stage.children():
                if isinstance(layer, (BottleneckEncoder, BottleneckDecoder)):
                    layer.anchor = subspace if anchors is None else anchors[j]
                    weight = subspace.basis.T if isinstance(layer, BottleneckEncoder) else subspace.basis
                    layer.proj.weight.copy_(weight)
                    layer.proj.bias.zero_()
                    layer.proj.requires_grad_(False)
    return shaped
