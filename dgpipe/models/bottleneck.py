"""Boundary bottlenecks: a trained encoder at the end of the stage before a boundary (``H -> d`` channels) and a
decoder at the start of the stage after it (``d -> H``), so that ``d`` channels cross the boundary forward and
``d`` channels of gradient come back; the boundary's codecs code those ``d`` channels.

The pair is affine: ``y = W_e x + b_e`` with ``W_e`` ``(d, H)``, ``x_hat = W_d y + b_d`` with ``W_d`` ``(H, d)``.
It starts as one of:

- the identity (``d == H``: ``W_e = W_d = I``, zero biases): a model with it computes what the model without it
  computes, so a run with ``d = H`` and codec ``none`` equals the unsplit model;
- a random orthonormal basis ``Q`` ``(H, d)`` (``W_e = Q^T``, ``W_d = Q``): ``x_hat`` is ``x`` projected onto a
  random ``d``-dimensional subspace (pretraining from scratch);
- the boundary states' principal components (:func:`fit_principal_components`): the mean ``mu`` and the top-``d``
  right singular vectors ``V_d`` of the centred states (``W_e = V_d^T``, ``b_e = -V_d^T mu``, ``W_d = V_d``,
  ``b_d = mu``) -- the best rank-``d`` affine code of what crosses, in squared error, before any training
  (Eckart and Young, 1936).

Then both train with the model (the LM loss, or distillation to the unsplit model). Only the value's first tensor
(the hidden states, float ``(..., H)``) goes through the pair; a padding mask and token ids that ride with it pass
unchanged.

With an *anchor* -- the model's own token embedding, shared with its first layer -- the pair codes what the
blocks added to the residual stream: the encoder projects ``x - E[ids]`` and the decoder returns
``W_d y + b_d + E[ids]``, rebuilding the token-specific part from the ids, which then ride with the value
(the last tensor; the boundary carries them losslessly, ~12 bits a token at a 4,096-token vocabulary). The
shared embedding is one parameter of every stage that holds a pair: its gradients are summed across ranks
like tied embeddings (:class:`~dgpipe.pipeline.tied.TiedParameters`). Subspace Networks (arXiv 2506.01260)
rebuild the token embeddings on every stage from the ids the same way; MAPL (arXiv 2606.05484) adds a
per-stage anchor embedding of the ids at each boundary.

References: IOTA (arXiv 2507.17766; macrocosm-os/iota's bottleneck outputs and ``BottleneckDecoder``), ResBM
(arXiv 2604.11947), MAPL (arXiv 2606.05484: learned projections at pipeline boundaries).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

import torch
from torch import nn

__all__ = ["BottleneckEncoder", "BottleneckDecoder", "bottleneck_pair", "insert_bottlenecks",
           "fit_principal_components", "fit_bottlenecks", "parse_width", "parse_widths", "describe_pairs"]

INITS = ("identity", "orthonormal")


def _first(value) -> tuple[torch.Tensor, tuple]:
    """``(hidden, rest)`` of a layer value: a tensor, or a tuple whose first tensor is the hidden states."""
    if isinstance(value, torch.Tensor):
        return value, ()
    parts = tuple(value)
    return parts[0], parts[1:]


def _join(hidden: torch.Tensor, rest: tuple):
    return hidden if not rest else (hidden, *rest)


def _anchored(anchor: nn.Module | None, rest: tuple) -> torch.Tensor | None:
    """The anchor's embedding of the value's token ids (its last tensor), or None without an anchor.

    Raises:
        ValueError: an anchor but no integer token ids at the end of the value.
    """
    if anchor is None:
        return None
    if not rest or rest[-1].is_floating_point():
        raise ValueError("an anchored bottleneck needs the token ids as the value's last tensor (carry_ids)")
    return anchor(rest[-1])


class BottleneckEncoder(nn.Module):
    """``H -> d``: the value's hidden states float ``(..., H)`` -> ``(..., d)``; other tensors of the value pass.

    Attributes:
        proj: ``nn.Linear(H, d)`` (weight ``W_e`` ``(d, H)``, bias ``b_e`` ``(d,)``).
        anchor: the token embedding subtracted first (ids: the value's last tensor), or None.
    """

    def __init__(self, hidden_size: int, width: int, anchor: nn.Module | None = None) -> None:
        super().__init__()
        self.proj, self.anchor = nn.Linear(hidden_size, width), anchor

    def forward(self, value):
        hidden, rest = _first(value)
        base = _anchored(self.anchor, rest)
        return _join(self.proj(hidden if base is None else hidden - base), rest)


class BottleneckDecoder(nn.Module):
    """``d -> H``: the value's coded channels float ``(..., d)`` -> hidden states ``(..., H)``; other tensors pass.

    Attributes:
        proj: ``nn.Linear(d, H)`` (weight ``W_d`` ``(H, d)``, bias ``b_d`` ``(H,)``).
        anchor: the token embedding added back (ids: the value's last tensor), or None.
    """

    def __init__(self, hidden_size: int, width: int, anchor: nn.Module | None = None) -> None:
        super().__init__()
        self.proj, self.anchor = nn.Linear(width, hidden_size), anchor

    def forward(self, value):
        hidden, rest = _first(value)
        base = _anchored(self.anchor, rest)
        out = self.proj(hidden)
        return _join(out if base is None else out + base, rest)


def parse_width(text: str | int, hidden_size: int) -> int:
    """A bottleneck width from ``D`` or a ratio ``1/N`` of ``hidden_size`` (``"1/16"`` of 576 -> 36).

    Raises:
        ValueError: not a number or ratio, or a width outside ``[1, hidden_size]``.
    """
    s = str(text).strip()
    try:
        if "/" in s:
            num, den = (int(v) for v in s.split("/"))
            width = hidden_size * num // den
        else:
            width = int(s)
    except ValueError:
        raise ValueError(f"bottleneck width {text!r}: give channels D or a ratio such as 1/16") from None
    if not 1 <= width <= hidden_size:
        raise ValueError(f"bottleneck width {text!r} = {width} channels: must be in [1, {hidden_size}] (the model's "
                         "width)")
    return width


def parse_widths(spec: str, hidden_size: int, boundaries: int) -> dict[int, int]:
    """The widths of ``--bottleneck SPEC``: ``D`` or ``1/N`` at every one of ``boundaries`` boundaries, or
    ``I:W,J:W`` at boundaries ``I``, ``J`` (each ``W`` a width or a ratio, :func:`parse_width`).

    Raises:
        ValueError: a bad width, a boundary index outside ``[0, boundaries)``, one given twice, or no boundary.
    """
    if boundaries < 1:
        raise ValueError("--bottleneck sits at a stage boundary: this partition has none")
    if ":" not in spec:
        width = parse_width(spec, hidden_size)
        return dict.fromkeys(range(boundaries), width)
    widths: dict[int, int] = {}
    for item in spec.split(","):
        index, _, text = item.partition(":")
        try:
            i = int(index)
        except ValueError:
            raise ValueError(f"--bottleneck {spec}: {item!r} is not BOUNDARY:WIDTH") from None
        if not 0 <= i < boundaries or i in widths:
            raise ValueError(f"--bottleneck {spec}: boundary {i} is not one of 0..{boundaries - 1} or is given twice")
        widths[i] = parse_width(text, hidden_size)
    return widths


@torch.no_grad()
def bottleneck_pair(hidden_size: int, width: int, init: str = "identity", generator: torch.Generator | None = None,
                    anchor: nn.Module | None = None) -> tuple[BottleneckEncoder, BottleneckDecoder]:
    """An encoder/decoder pair of ``width`` channels for hidden states of ``hidden_size``, float32.

    Args:
        init: ``"identity"`` (needs ``width == hidden_size``) or ``"orthonormal"`` (a random orthonormal basis from
            ``generator``; module docstring).
        anchor: a token embedding ``ids -> (..., H)`` both sides share (module docstring), or None.

    Raises:
        ValueError: an unknown ``init``, a width outside ``[1, hidden_size]``, or identity with ``width < H``.
    """
    if init not in INITS:
        raise ValueError(f"bottleneck init {init!r}: one of {', '.join(INITS)}")
    if not 1 <= width <= hidden_size:
        raise ValueError(f"bottleneck width {width}: must be in [1, {hidden_size}]")
    if init == "identity" and width != hidden_size:
        raise ValueError(f"an identity bottleneck has the model's width {hidden_size}, not {width}")
    enc, dec = BottleneckEncoder(hidden_size, width, anchor), BottleneckDecoder(hidden_size, width, anchor)
    if init == "identity":
        basis = torch.eye(hidden_size)
    else:
        basis, _ = torch.linalg.qr(torch.randn(hidden_size, width, generator=generator))
    enc.proj.weight.copy_(basis.T)
    dec.proj.weight.copy_(basis)
    enc.proj.bias.zero_()
    dec.proj.bias.zero_()
    return enc, dec


@torch.no_grad()
def fit_principal_components(encoder: BottleneckEncoder, decoder: BottleneckDecoder, states: torch.Tensor) -> float:
    """Set the pair to the mean and top-``d`` principal directions of ``states`` (module docstring).

    Args:
        states: float ``(N, H)`` hidden states that cross the boundary (a sample of training tokens), ``N >= 1``.

    Returns:
        The fraction of the centred states' energy (sum of squares) the ``d`` directions keep, in ``[0, 1]``.

    Raises:
        ValueError: ``states`` not ``(N, H)`` for the pair's ``H``.
    """
    width, hidden_size = encoder.proj.weight.shape
    if states.dim() != 2 or states.shape[1] != hidden_size or states.shape[0] < 1:
        raise ValueError(f"principal components of states {tuple(states.shape)}: want (N >= 1, {hidden_size})")
    x = states.double()
    mean = x.mean(0)
    _, s, vh = torch.linalg.svd(x - mean, full_matrices=False)
    basis = torch.zeros(hidden_size, width, dtype=torch.float64)
    k = min(width, vh.shape[0])
    basis[:, :k] = vh[:k].T
    if k < width:  # fewer states than channels: complete the basis with orthonormal directions
        extra, _ = torch.linalg.qr(torch.randn(hidden_size, width, dtype=torch.float64))
        basis, _ = torch.linalg.qr(torch.cat([basis[:, :k], extra[:, : width - k]], 1))
    encoder.proj.weight.copy_(basis.T)
    encoder.proj.bias.copy_(-(basis.T @ mean))
    decoder.proj.weight.copy_(basis)
    decoder.proj.bias.copy_(mean)
    energy = float((s**2).sum())
    return float((s[:k] ** 2).sum()) / energy if energy > 0 else 1.0


@torch.no_grad()
def fit_bottlenecks(stages: Sequence[nn.Module], inputs) -> dict[int, float]:
    """Start every pair in ``stages`` (as :func:`insert_bottlenecks` placed them) from the principal components of
    what crosses its boundary when ``inputs`` run through the stages in order: each encoder is fitted
    (:func:`fit_principal_components`, with its decoder, the first layer of the next stage) on the hidden states
    that reach it -- less the anchor's embedding where it has one -- just before they go through it, so a later
    boundary is fitted on what its stage computes from the earlier pairs' reconstruction, as in training.

    Args:
        stages: ``nn.Sequential`` stages with bottleneck pairs.
        inputs: the first stage's input (e.g. token ids int64 ``(B, L)``; a sample of training text).

    Returns:
        ``{boundary index: fraction of the centred states' energy the pair keeps}``.

    Raises:
        ValueError: an encoder whose next stage does not start with a decoder.
    """
    value, kept = inputs, {}
    for i, stage in enumerate(stages):
        for layer in stage.children():
            if isinstance(layer, BottleneckEncoder):
                hidden, rest = _first(value)
                base = _anchored(layer.anchor, rest)
                states = hidden if base is None else hidden - base
                decoder = next(iter(stages[i + 1].children()))
                if not isinstance(decoder, BottleneckDecoder):
                    raise ValueError(f"stage {i + 1} does not start with the decoder of boundary {i}'s encoder")
                kept[i] = fit_principal_components(layer, decoder, states.reshape(-1, states.shape[-1]).float())
            value = layer(value)
    return kept


def insert_bottlenecks(stages: Sequence[nn.Module], widths: int | Mapping[int, int], hidden_size: int,
                       init: str = "identity", seed: int = 0, anchor: nn.Module | None = None) -> list[nn.Sequential]:
    """Stages with a bottleneck pair at chosen boundaries: stage ``i`` ends with the encoder and stage ``i + 1``
    starts with the decoder of boundary ``i`` (``stage{i}->stage{i+1}``).

    Args:
        stages: the partition (each an ``nn.Sequential`` or any module), in order; not modified.
        widths: one width for every boundary, or ``{boundary index: width}``.
        hidden_size: the width ``H`` of what crosses without a bottleneck.
        init: ``"identity"`` or ``"orthonormal"`` (:func:`bottleneck_pair`); each boundary's basis is drawn from
            ``seed + i``.
        anchor: the token embedding every pair subtracts and adds back (module docstring), or None.

    Returns:
        One ``nn.Sequential`` per stage, sharing the original layers; a stage's own children keep their names,
        the encoder is ``"bottleneck_encoder"`` and the decoder ``"bottleneck_decoder"``.

    Raises:
        ValueError: fewer than two stages, a boundary index outside ``[0, len(stages) - 1)``, or a bad width.
    """
    n = len(stages)
    if n < 2:
        raise ValueError("a bottleneck sits at a stage boundary: the partition has none (one stage)")
    chosen = dict.fromkeys(range(n - 1), widths) if isinstance(widths, int) else dict(widths)
    for i in chosen:
        if not 0 <= i < n - 1:
            raise ValueError(f"bottleneck at boundary {i}: the partition's boundaries are 0..{n - 2}")
    out = []
    pairs = {i: bottleneck_pair(hidden_size, w, init, torch.Generator().manual_seed(seed + i), anchor)
             for i, w in chosen.items()}
    for i, stage in enumerate(stages):
        named = list(stage.named_children()) if isinstance(stage, nn.Sequential) else [("0", stage)]
        if i - 1 in pairs:
            named.insert(0, ("bottleneck_decoder", pairs[i - 1][1]))
        if i in pairs:
            named.append(("bottleneck_encoder", pairs[i][0]))
        out.append(nn.Sequential(OrderedDict(named)))
    return out


def describe_pairs(shaped: Sequence[nn.Module], stages: Sequence[nn.Module]) -> str:
    """One line on the pairs in ``shaped`` (the ``stages`` with pairs inserted): how many, their widths, the
    parameters they add (and whether they train) as a share of the stages', the multiply-adds a token they cost
    (one per weight: ``2 H d`` a pair), and the parameters of anchors that are not the model's own (token tables:
    lookups, no multiply-adds)."""
    pairs = [m for s in shaped for m in s.children() if isinstance(m, (BottleneckEncoder, BottleneckDecoder))]
    added = sum(p.numel() for m in pairs for p in m.proj.parameters())
    trains = any(p.requires_grad for m in pairs for p in m.proj.parameters())
    own = {id(p): p for s in stages for p in s.parameters()}
    model = sum(p.numel() for p in own.values())
    tables = {id(p): p for m in pairs if m.anchor is not None for p in m.anchor.parameters() if id(p) not in own}
    extra = sum(p.numel() for p in tables.values())
    encoders = [m for m in pairs if isinstance(m, BottleneckEncoder)]
    widths = ", ".join(str(e.proj.out_features) for e in encoders)
    hidden_size = encoders[0].proj.in_features if encoders else 0
    return (f"bottlenecks: {len(encoders)} pairs of {widths} channels of {hidden_size}, "
            f"{added:,} {'trained' if trains else 'frozen'} parameters ({100 * added / max(model, 1):.2f}% of the "
            f"model's); about {added:,} multiply-adds a token"
            + (f"; token tables: {extra:,} trained parameters (lookups)" if extra else ""))
