"""Lanes: how one tuple position of a boundary value becomes a payload and back.

Every lane has the same shape -- ``encode(tensor, context) -> Payload`` on the sender,
``decode(payload, context) -> tensor`` on the receiver -- and one kind, the flag the
message carries for that position (:mod:`dgpipe.pipeline.message`):

- :class:`LosslessLane` (``LOSSLESS``): integer and bool tensors (masks) packed in the
  fewest bits their range needs (``intpack``: a 0/1 mask at 1 bit a value), floating
  tensors as they are (``none``);
- :class:`CodedLane` (``CODED``): through a codec (activation or gradient codec, one
  instance per boundary, direction, micro-batch slot and position);
- :class:`DeltaLane` (``DELTA_CODED``): the change against the per-example cache, coded by
  the activation codec (AQ-SGD, :mod:`dgpipe.compression.wrappers.delta`); the payload
  carries the activation's dtype in its header;
- :class:`DeltaWarmupLane` (``DELTA_WARMUP``): the tensor losslessly, stored in the cache
  on both sides (a full-precision warm-up visit);
- :class:`ReferenceLane` (``CODED`` + ``REFERENCE``): the residual against the per-token
  reference of the message's token ids, coded by the activation codec
  (:mod:`dgpipe.compression.wrappers.reference`); training messages update the table on both
  sides, evaluation reads it.

The two delta lanes of one position share one :class:`~dgpipe.compression.wrappers.delta.DeltaCoder`;
the sample ids of the rows travel once per message and reach them in the :class:`LaneContext`, and so
does a row mask: a position sent as its kept rows (:data:`~dgpipe.pipeline.message.ROWS`) goes
through a delta lane with the context's ``keep`` -- the change of the kept rows, or (warm-up) the
kept rows with the others stored as zeros on both sides -- while the boundary cuts and restores
the rows of the other lanes itself (:func:`put_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpipe.compression import Codec, Payload, get_codec
from dgpipe.compression.wrappers.delta import DeltaCoder
from dgpipe.compression.wrappers.reference import ReferenceCoder

from .message import CODED, DELTA_CODED, DELTA_WARMUP, LOSSLESS

__all__ = ["LaneContext", "Lane", "LosslessLane", "CodedLane", "DeltaLane", "DeltaWarmupLane", "ReferenceLane",
           "LOSSLESS_LANE",
           "encode_ids", "decode_ids", "put_rows"]

_NONE = get_codec("none")
_INTS = get_codec("intpack")
_LOSSLESS_BY_ID = {c.codec_id: c for c in (_NONE, _INTS)}


@dataclass(frozen=True)
class LaneContext:
    """What the lanes of one message share.

    Attributes:
        ids: int64 ``(B,)`` sample ids of the rows (training forward messages with delta
            coding), else ``None``.
        device: where the receiver's tensors go.
        keep: bool ``(B, L)`` rows that travel, for a delta lane of a position sent as rows; else ``None``.
        tokens: int64 ``(B, L)`` token ids of the message, for a reference lane; else ``None``.
        update: a training message: reference lanes fold what they code into their table.
    """

    ids: torch.Tensor | None = None
    device: torch.device = torch.device("cpu")
    keep: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    update: bool = False

    def need_ids(self) -> torch.Tensor:
        """The ids, for a delta lane.

        Raises:
            ValueError: the message carried none.
        """
        if self.ids is None:
            raise ValueError("a delta-coded tensor without sample ids")
        return self.ids


class Lane:
    """One tuple position's way over the wire (module docstring)."""

    kind: int

    def encode(self, t: torch.Tensor, ctx: LaneContext) -> Payload:
        """The payload of ``t`` (detached, any shape)."""
        raise NotImplementedError

    def decode(self, payload: Payload, ctx: LaneContext) -> torch.Tensor:
        """The tensor of ``payload``.

        Raises:
            ValueError: a corrupt payload, or one that does not fit this lane.
        """
        raise NotImplementedError


class LosslessLane(Lane):
    """``none`` for floating tensors, ``intpack`` for the others; decode follows the header's codec id."""

    kind = LOSSLESS

    def encode(self, t: torch.Tensor, ctx: LaneContext) -> Payload:
        return (_NONE if t.is_floating_point() else _INTS).encode(t)

    def decode(self, payload: Payload, ctx: LaneContext) -> torch.Tensor:
        h = payload.header
        codec = _LOSSLESS_BY_ID.get(int(h[1])) if h.dim() == 1 and h.numel() > 1 else None
        if codec is None:
            raise ValueError("corrupt payload: a lossless tensor's header names neither 'none' nor 'intpack'")
        return codec.decode(payload)


#: The one lossless lane (stateless).
LOSSLESS_LANE = LosslessLane()


class CodedLane(Lane):
    """Through ``codec`` (its state, if any, is this position's)."""

    kind = CODED

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    def encode(self, t: torch.Tensor, ctx: LaneContext) -> Payload:
        return self.codec.encode(t)

    def decode(self, payload: Payload, ctx: LaneContext) -> torch.Tensor:
        return self.codec.decode(payload)


class DeltaLane(Lane):
    """The change against ``coder``'s cache (the payload names the activation's dtype)."""

    kind = DELTA_CODED

    def __init__(self, coder: DeltaCoder) -> None:
        self.coder = coder

    def encode(self, t: torch.Tensor, ctx: LaneContext) -> Payload:
        return self.coder.encode(t, ctx.need_ids(), ctx.keep)

    def decode(self, payload: Payload, ctx: LaneContext) -> torch.Tensor:
        return self.coder.decode(payload, ctx.need_ids(), ctx.keep).to(ctx.device)


class DeltaWarmupLane(Lane):
    """The tensor losslessly (``none``), stored in ``coder``'s cache on both sides."""

    kind = DELTA_WARMUP

    def __init__(self, coder: DeltaCoder) -> None:
        self.coder = coder

    def encode(self, t: torch.Tensor, ctx: LaneContext) -> Payload:
        if ctx.keep is not None:  # the kept rows; both caches store the others as zeros
            rows = t[ctx.keep.to(t.device)]
            self.coder.refresh(put_rows(rows, ctx.keep), ctx.need_ids())
            return _NONE.encode(rows)
        self.coder.refresh(t, ctx.need_ids())
        return _NONE.encode(t)

    def decode(self, payload: Payload, ctx: LaneContext) -> torch.Tensor:
        ids = ctx.need_ids()
        x = _NONE.decode(payload)
        if not x.is_floating_point() or x.dim() < 1:
            raise ValueError(f"warm-up tensor {x.dtype} {tuple(x.shape)} for {ids.numel()} ids")
        if ctx.keep is not None:
            x = put_rows(x, ctx.keep)
        if x.shape[0] != ids.numel():
            raise ValueError(f"warm-up tensor {x.dtype} {tuple(x.shape)} for {ids.numel()} ids")
        self.coder.refresh(x, ids)
        return x


class ReferenceLane(Lane):
    """The residual against ``coder``'s per-token table, keyed by the context's token ids."""

    kind = CODED

    def __init__(self, coder: ReferenceCoder) -> None:
        self.coder = coder

    def _tokens(self, ctx: LaneContext) -> torch.Tensor:
        if ctx.tokens is None:
            raise ValueError("a reference-coded tensor without token ids")
        return ctx.tokens

    def encode(self, t: torch.Tensor, ctx: LaneContext) -> Payload:
        return self.coder.encode(t, self._tokens(ctx), ctx.update)

    def decode(self, payload: Payload, ctx: LaneContext) -> torch.Tensor:
        return self.coder.decode(payload, self._tokens(ctx).to(ctx.device), ctx.update).to(ctx.device)


def put_rows(rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``(kept, ...)`` rows back into a ``(B, L, ...)`` tensor of zeros at ``keep``'s True entries.

    Raises:
        ValueError: the row count differs from ``keep``'s (a corrupt payload).
    """
    keep = keep.to(rows.device)
    n = int(keep.sum())
    if rows.dim() < 1 or rows.shape[0] != n:
        raise ValueError(f"corrupt payload: {tuple(rows.shape)} rows for a mask that keeps {n}")
    return rows.new_zeros((*keep.shape, *rows.shape[1:])).index_put((keep,), rows)


def encode_ids(ids: torch.Tensor) -> Payload:
    """The ids payload (lossless int64; counted in the wire bytes, not the raw ones)."""
    return _NONE.encode(ids.cpu())


def decode_ids(payload: Payload) -> torch.Tensor:
    """Inverse of :func:`encode_ids` (the values are checked by the boundary's delta spec)."""
    return _NONE.decode(payload)
