"""The meta of one boundary message: which lane carries each tuple position, and the step's counters.

A boundary message (:class:`dgpipe.comm.transport.Sender`) carries payloads and a short
list of int64 meta fields. :class:`Message` is that meta as a value, with its own wire
form::

    [head, n_micro, slot, loss, flag_0 .. flag_{n-1}]

- ``head``: 1 if the value is one tensor (not a tuple) + 2 if the first payload is the
  rows' sample ids;
- ``n_micro``: the sender's number of micro-batches in this step; ``slot``: this
  message's micro-batch;
- ``loss``: the step's mean loss as the bits of a float64 (backward messages; 0 forward);
- ``flag``: the lane of one tuple position (:data:`ABSENT`, :data:`LOSSLESS`,
  :data:`CODED`, :data:`DELTA_WARMUP`, :data:`DELTA_CODED`; see
  :mod:`dgpipe.pipeline.lanes`) + :data:`REQUIRES_GRAD` if the tensor requires grad
  (delta lanes always do) + :data:`ROW_MASK` on the tensor whose nonzero entries mark the
  rows that travel (a lossless integer ``(B, L)`` tensor, e.g. an attention mask) +
  :data:`ROWS` on a floating ``(B, L, ...)`` tensor sent as its kept rows only
  (``(kept, ...)``; padding rows stay behind and arrive as zeros, or, delta-coded, as cached).
  A backward message's :data:`ROWS` gradients use the row mask of the forward message of
  the same micro-batch. With a per-token reference (:mod:`dgpipe.compression.wrappers.reference`):
  :data:`TOKEN_IDS` on the message's token ids (a lossless integer ``(B, L)`` tensor) and
  :data:`REFERENCE` on a coded ``(B, L, d)`` tensor sent as its residual against the table.

One payload follows per present tensor, after the ids payload if ``head`` says so.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ABSENT", "LOSSLESS", "CODED", "DELTA_WARMUP", "DELTA_CODED", "REQUIRES_GRAD", "ROWS", "ROW_MASK",
           "TOKEN_IDS", "REFERENCE", "MAX_BOUNDARY_TENSORS", "Message", "check_declared"]

#: Lane kinds (the low bits of a flag).
ABSENT, LOSSLESS, CODED = 0, 1, 2
DELTA = 8
DELTA_WARMUP, DELTA_CODED = DELTA | LOSSLESS, DELTA | CODED
#: Flag bit: the tensor requires grad (it arrives as a leaf and its gradient comes back).
REQUIRES_GRAD = 4
#: Flag bit: the tensor travels as the rows its message's row mask keeps.
ROWS = 16
#: Flag bit: the tensor is the message's row mask (nonzero: the row travels).
ROW_MASK = 32
#: Flag bit: the tensor is the message's token ids (the per-token reference's keys).
TOKEN_IDS = 64
#: Flag bit: the coded tensor is the residual against the per-token reference of the message's token ids.
REFERENCE = 128
#: Most tensors one boundary value (a tuple) may hold.
MAX_BOUNDARY_TENSORS = 16
_ATOMIC, _HAS_IDS = 1, 2  # bits of the head
_BASE_FLAGS = frozenset({ABSENT, LOSSLESS, CODED, LOSSLESS | REQUIRES_GRAD, CODED | REQUIRES_GRAD,
                         DELTA_WARMUP | REQUIRES_GRAD, DELTA_CODED | REQUIRES_GRAD})
_VALID_FLAGS = (_BASE_FLAGS | {f | ROWS for f in _BASE_FLAGS if f != ABSENT}
                | {LOSSLESS | ROW_MASK, LOSSLESS | TOKEN_IDS} | {CODED | REFERENCE, CODED | REFERENCE | REQUIRES_GRAD})


def _float_bits(x: float) -> int:
    """The IEEE float64 bits of ``x`` as a signed int64 (to travel in int64 meta)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True)
class Message:
    """The meta of one boundary message (module docstring), validated at construction.

    Attributes:
        flags: one per tuple position: lane kind + :data:`REQUIRES_GRAD`.
        n_micro: the sender's number of micro-batches in this step.
        slot: this message's micro-batch.
        loss: the step's mean loss (backward messages), 0.0 forward.
        atomic: the value is one tensor, not a tuple (then there is exactly one flag).
        has_ids: the first payload is the rows' sample ids (int64 ``(B,)``).

    Raises:
        ValueError: an unknown flag, too many or (for an atomic value) more than one flag,
            more than one row mask or token ids position, a reference-coded tensor without token
            ids, or a negative count; the message says "corrupt message meta".
    """

    flags: tuple[int, ...]
    n_micro: int = 0
    slot: int = 0
    loss: float = 0.0
    atomic: bool = False
    has_ids: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "flags", tuple(int(f) for f in self.flags))
        ok = len(self.flags) <= MAX_BOUNDARY_TENSORS and all(f in _VALID_FLAGS for f in self.flags)
        ok = ok and sum(bool(f & ROW_MASK) for f in self.flags) <= 1
        tokens = sum(bool(f & TOKEN_IDS) for f in self.flags)
        ok = ok and tokens <= 1 and (tokens == 1 or not any(f & REFERENCE for f in self.flags))
        ok = ok and self.n_micro >= 0 and self.slot >= 0 and (not self.atomic or len(self.flags) == 1)
        if not ok:
            raise ValueError(f"corrupt message meta: flags {list(self.flags)[:MAX_BOUNDARY_TENSORS]}, "
                             f"n_micro {self.n_micro}, slot {self.slot}, atomic {self.atomic}")

    @property
    def n_payloads(self) -> int:
        """Payloads the message carries: one per present tensor, plus the ids payload."""
        return sum(f != ABSENT for f in self.flags) + self.has_ids

    def kind(self, pos: int) -> int:
        """The lane kind of tuple position ``pos`` (its flag without :data:`REQUIRES_GRAD`, :data:`ROWS`,
        :data:`ROW_MASK`, :data:`TOKEN_IDS` and :data:`REFERENCE`)."""
        return self.flags[pos] & ~(REQUIRES_GRAD | ROWS | ROW_MASK | TOKEN_IDS | REFERENCE)

    def referenced(self, pos: int) -> bool:
        """Whether tuple position ``pos`` is coded against the per-token reference (:data:`REFERENCE`)."""
        return bool(self.flags[pos] & REFERENCE)

    @property
    def token_ids(self) -> int | None:
        """The tuple position of the token ids (:data:`TOKEN_IDS`), or None."""
        return next((pos for pos, f in enumerate(self.flags) if f & TOKEN_IDS), None)

    def rows(self, pos: int) -> bool:
        """Whether tuple position ``pos`` travels as its kept rows (:data:`ROWS`)."""
        return bool(self.flags[pos] & ROWS)

    @property
    def row_mask(self) -> int | None:
        """The tuple position of the row mask (:data:`ROW_MASK`), or None."""
        return next((pos for pos, f in enumerate(self.flags) if f & ROW_MASK), None)

    def requires_grad(self, pos: int) -> bool:
        """Whether tuple position ``pos`` requires grad."""
        return bool(self.flags[pos] & REQUIRES_GRAD)

    def to_meta(self) -> list[int]:
        """The int64 meta fields ``[head, n_micro, slot, loss bits, *flags]``."""
        head = (_ATOMIC if self.atomic else 0) | (_HAS_IDS if self.has_ids else 0)
        return [head, self.n_micro, self.slot, _float_bits(self.loss), *self.flags]

    @classmethod
    def from_meta(cls, meta: Sequence[int], n_payloads: int) -> Message:
        """Parse and check meta fields against the number of payloads that came with them.

        Raises:
            ValueError: "corrupt message meta: ..." for fewer than 4 fields, an unknown head
                bit, an invalid flag, or a payload count other than the flags imply.
        """
        if len(meta) < 4 or not 0 <= meta[0] <= _ATOMIC | _HAS_IDS:
            raise ValueError(f"corrupt message meta: {list(meta[:8])}")
        try:
            message = cls(tuple(meta[4:]), meta[1], meta[2], _bits_float(meta[3]), bool(meta[0] & _ATOMIC),
                          bool(meta[0] & _HAS_IDS))
        except ValueError:
            raise ValueError(f"corrupt message meta: {list(meta[:8])}") from None
        if message.n_payloads != n_payloads:
            raise ValueError(f"corrupt message meta: {list(meta[:8])} implies {message.n_payloads} payloads, "
                             f"{n_payloads} came")
        return message


def check_declared(pos: int, shape: tuple[int, ...], keep: torch.Tensor | None, tokens: torch.Tensor | None) -> None:
    """Before a received tensor is decoded: the ``shape`` its header declares fits the message's
    row mask (``keep``: one row per kept entry) and token ids (``tokens``: ``(B, L, ...)``).

    Raises:
        ValueError: another number of rows, or another ``(B, L)``, than they imply.
    """
    if keep is not None and (not shape or shape[0] != int(keep.sum())):
        raise ValueError(f"tensor {pos} declares {shape} rows for a row mask that keeps {int(keep.sum())}")
    if tokens is not None and shape[:2] != tuple(tokens.shape):
        raise ValueError(f"tensor {pos} declares shape {shape} for token ids {tuple(tokens.shape)}")
