"""A per-token reference both sides of a link keep: a codec codes the residual against it.

Delta coding (:mod:`.delta`) codes an activation's change against the same example's last visit,
so evaluation examples, which have no last visit, are sent by direct coding with its full error.
A lower encoder layer's hidden state is, to a large part, a function of its token: with a table
``T`` of one row per vocabulary entry, the sender codes ``x - T[ids]`` and the receiver returns
``T[ids] + decode(payload)``; the codec's per-token scale then follows the residual's size. On
all-MiniLM-L6-v2's client/server boundaries the table leaves 0.36-0.41 of the energy, and the
5-level codebook's error falls from 0.078 to 0.030-0.034 (``benchmarks/token_reference.py``).

The table costs no bytes beyond the token ids: both sides build it alike from what crossed the
link. After each training message, for every token ``t`` of its ``n_t`` rows (padding rows
included: the padding token gets its own row), ``count[t] += n_t`` and
``T[t] += (sum of the decoded rows of t - n_t T[t]) * min(max(1 / count[t], alpha), 1 / n_t)`` --
the running mean of the decoded rows, in which each new row keeps at least the weight ``alpha``
(a message's rows at most 1 together), so that it follows the weights while fine-tuning moves them. Rows of a
token never seen are zero: its first visit is coded directly. Evaluation reads the table and never changes it.

With ``backoff`` a sequence's first position (a decoder's attention sink: SmolLM2's first state after a
block carries 170x the energy of the others) and the tokens never seen read two shared rows -- the running
means of first positions and of all other rows -- instead of the token's row and zero (:class:`ReferenceCoder`).

Both sides compute the same reconstruction from identical operands (the sender decodes its own
payload) and apply the same update in message order, so the two tables stay bit-identical on the
same device type (CPU ``index_add_`` sums in a fixed order; off the CPU, where ``index_add_`` adds floats
with atomics in any order, the update sums sorted rows: :meth:`TokenTable.update`).

Usage (one coder per side, same codec)::

    sender = ReferenceCoder(get_codec("codebook", count=5), TokenTable(vocab))
    receiver = ReferenceCoder(get_codec("codebook", count=5), TokenTable(vocab))
    payload = sender.encode(x, ids, update=True)     # x: (B, L, d) floating, ids: int64 (B, L)
    y = receiver.decode(payload, ids, update=True)   # y: x.dtype, equal to the sender's reconstruction
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..base import Codec, Payload
from ..kernels import deferred

__all__ = ["TokenReference", "TokenTable", "ReferenceCoder", "ScaledReferenceCoder", "check_tokens", "position_keys",
           "POSITION_KEYS"]

POSITION_KEYS = 3
"""Keys of :func:`position_keys`: 0 a token after a sequence's first, 1 a sequence's first token, 2 padding."""


@dataclass(frozen=True)
class TokenReference:
    """The pipeline's choice of a per-token reference on every boundary (the same on every rank).

    Attributes:
        vocab: number of token ids; every id is in ``[0, vocab)``.
        alpha: the least weight of a new row in the running mean, in ``(0, 1]``.
        scale: also weigh each channel of the residual before coding by its running variance to the power
            -1/4, one variance per channel over all tokens (:class:`ScaledReferenceCoder` with ``shared``).
        backoff: a sequence's first position and tokens never seen read shared rows of the table
            (:class:`ReferenceCoder`'s ``backoff``; the table has ``vocab + 2`` rows).

    Raises:
        ValueError: ``vocab < 1`` or ``alpha`` outside ``(0, 1]``.
    """

    vocab: int
    alpha: float = 0.05
    scale: bool = False
    backoff: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 1:
            raise ValueError(f"token reference: vocab must be a positive int, got {self.vocab!r}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"token reference: alpha must be in (0, 1], got {self.alpha!r}")


def check_tokens(ids: torch.Tensor, vocab: int, shape: tuple[int, ...], where: str) -> torch.Tensor:
    """``ids`` as int64 after checking it is an integer tensor of ``shape`` with values in ``[0, vocab)``.

    Raises:
        ValueError: wrong dtype, shape or range (names ``where``).
    """
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or tuple(ids.shape) != shape:
        raise ValueError(f"{where}: token ids {ids.dtype} {tuple(ids.shape)}, expected integer {shape}")
    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{where}: token ids in [{int(ids.min())}, {int(ids.max())}], outside [0, {vocab})")
    return ids


def position_keys(mask: torch.Tensor | None, batch: int, length: int, first: bool) -> torch.Tensor:
    """Keys int64 ``(batch, length)`` of a :class:`TokenTable` of :data:`POSITION_KEYS` rows that holds one running
    mean per channel instead of one per token: 1 at each row's first real position (``first``: the message
    starts the sequences), 2 at padding, 0 elsewhere. No token id is needed, so no id crosses the link.

    Why: a decoder's residual stream carries a large mean per channel (SmolLM2-135M after its 29th block: 64%
    of a token's energy; "massive activations", Sun et al., 2024), and a sequence's first token -- the
    attention sink, a function of its token alone -- carries far more (170x the others' energy there); a
    per-token scale spends the codec's levels on both. Coding the residual against these means leaves the
    varying part.

    Args:
        mask: int ``(batch, length)``, 1 = token, 0 = padding (left padding), or None: no padding.
        first: the message holds the sequences' first positions (a prefill); False: later tokens only.
    """
    keys = torch.zeros(batch, length, dtype=torch.int64)
    if mask is not None:
        mask = mask[:, -length:].to(torch.int64).cpu()
        keys[mask == 0] = 2
    if first:
        column = torch.zeros(batch, dtype=torch.int64) if mask is None else (mask != 0).int().argmax(1)
        keys[torch.arange(batch), column] = 1
    return keys


class TokenTable:
    """One side's table: ``rows`` float32 ``(vocab, d)`` (made on first use, on the tensor's device)
    and ``count`` int64 ``(vocab,)`` (module docstring)."""

    def __init__(self, vocab: int, alpha: float = 0.05) -> None:
        TokenReference(vocab, alpha)  # validates
        self.vocab, self.alpha = vocab, alpha
        self.rows: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def lookup(self, ids: torch.Tensor, d: int, device: torch.device) -> torch.Tensor:
        """float32 ``(*ids.shape, d)``: the rows of ``ids``.

        Raises:
            ValueError: ``d`` differs from the table's width.
        """
        if self.rows is None:
            self.rows = torch.zeros(self.vocab, d, device=device)
            self.count = torch.zeros(self.vocab, dtype=torch.int64, device=device)
        if self.rows.shape[1] != d:
            raise ValueError(f"token reference: a tensor of width {d} for a table of width {self.rows.shape[1]}")
        return self.rows[ids.to(self.rows.device)]

    def update(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Fold ``values`` ``(*ids.shape, d)`` (decoded rows) into the rows of ``ids`` (module docstring).

        On CPU the message's distinct tokens are summed with ``index_add_`` (a fixed order). Off the CPU
        (:func:`_update_sorted`) nothing is read back and the sums are the same on every run: the rows sorted by
        token, float64 prefix sums, one difference per token.

        Raises:
            RuntimeError: called before :meth:`lookup` made the table.
        """
        table, count = self.rows, self.count
        if table is None or count is None:
            raise RuntimeError("token reference: a table is updated after its first lookup")
        flat = ids.reshape(-1).to(table.device)
        rows = values.reshape(flat.numel(), -1).to(table.device, torch.float32)
        if not deferred.on_host(rows):
            _update_sorted(table, count, self.alpha, flat, rows)
            return
        tokens, where = torch.unique(flat, return_inverse=True)
        n = torch.bincount(where, minlength=len(tokens))
        sums = torch.zeros(len(tokens), rows.shape[1], device=rows.device).index_add_(0, where, rows)
        count[tokens] += n
        weight = torch.minimum((1.0 / count[tokens].float()).clamp(min=self.alpha), 1.0 / n.float())
        old = table[tokens]
        table[tokens] = old + (sums - n[:, None].float() * old) * weight[:, None]

    def state_dict(self) -> dict:
        """``{"rows": float32 (vocab, d) or None, "count": int64 (vocab,) or None}``: the table's own tensors,
        not copies (as ``torch.nn.Module.state_dict``; the checkpoint writer snapshots them)."""
        return {"rows": self.rows, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (on the saved tensors' device).

        Raises:
            ValueError: rows that are not float32 ``(vocab, d)`` or counts that are not int64 ``(vocab,)``,
                or one of the two without the other.
        """
        rows, count = state.get("rows"), state.get("count")
        if rows is None and count is None:
            self.rows = self.count = None
            return
        ok = isinstance(rows, torch.Tensor) and isinstance(count, torch.Tensor)
        ok = ok and rows.dtype == torch.float32 and rows.dim() == 2 and rows.shape[0] == self.vocab
        ok = ok and count.dtype == torch.int64 and tuple(count.shape) == (self.vocab,)
        if not ok:
            raise ValueError(f"token reference: saved table {getattr(rows, 'dtype', rows)} "
                             f"{tuple(getattr(rows, 'shape', ()))} / counts {getattr(count, 'dtype', count)} "
                             f"{tuple(getattr(count, 'shape', ()))} do not fit a vocabulary of {self.vocab}; "
                             "resume with the same model")
        self.rows, self.count = rows.clone(), count.clone().to(rows.device)

    def digest(self) -> str:
        """SHA-256 (hex) of the rows and counts: equal on both sides of a link."""
        h = hashlib.sha256()
        if self.rows is not None:
            h.update(self.rows.cpu().contiguous().view(torch.uint8).numpy().tobytes())
            h.update(self.count.cpu().numpy().tobytes())
        return h.hexdigest()


def _update_sorted(table: torch.Tensor, count: torch.Tensor, alpha: float, flat: torch.Tensor,
                   rows: torch.Tensor) -> None:
    """:meth:`TokenTable.update` of ``table`` and ``count`` without a read back (a device's): every row of a
    token ``t`` computes ``t``'s new row from its run in the rows sorted by token (float64 prefix sums), and the
    rows of ``t`` all write that same value."""
    n_rows = flat.numel()
    order = torch.argsort(flat, stable=True)
    keys, sorted_rows = flat[order], rows[order]
    at = torch.arange(n_rows, device=flat.device)
    new_run = torch.ones_like(keys, dtype=torch.bool)
    new_run[1:] = keys[1:] != keys[:-1]
    start = torch.cummax(torch.where(new_run, at, 0), 0).values  # the first row of each row's token
    last_run = torch.ones_like(new_run)
    last_run[:-1] = new_run[1:]
    end = torch.flip(torch.cummin(torch.flip(torch.where(last_run, at, n_rows - 1), (0,)), 0).values, (0,))
    prefix = torch.cat((rows.new_zeros(1, rows.shape[1], dtype=torch.float64), sorted_rows.double().cumsum(0)))
    sums = (prefix[end + 1] - prefix[start]).float()
    n = (end - start + 1).float()[:, None]
    count.index_add_(0, keys, torch.ones_like(keys))  # integer sums: the same in any order
    weight = torch.minimum((1.0 / count[keys].float()).clamp(min=alpha)[:, None], 1.0 / n)
    old = table[keys]
    table[keys] = old + (sums - n * old) * weight


class ReferenceCoder:
    """``codec`` on the residual against ``table`` (module docstring); the payload is ``codec``'s.

    Args:
        codec: codes the residual, computed in the activation's dtype (the table's rows are cast to it),
            so the payload names that dtype and the receiver returns it.
        table: this side's :class:`TokenTable`; with ``backoff``, of ``vocab + 2`` rows.
        backoff: rows the token does not decide read shared rows instead of the token's: a sequence's first
            position (index 0 of the last axis of ``ids``; a decoder's attention sink, whose state differs from
            every other position's) reads the table's last row (the running mean of first positions), and a
            token never seen (count 0) the row before it (the running mean of the rows after the first
            positions) instead of zero -- backing off to a less specific estimate where a token has none, as
            n-gram models do (Katz, 1987). A token's own row is updated from its rows after the first position.

    Raises:
        ValueError: ``backoff`` with a table of fewer than 3 rows.
    """

    def __init__(self, codec: Codec, table: TokenTable, backoff: bool = False) -> None:
        if backoff and table.vocab < 3:
            raise ValueError(f"token reference: backing off needs two shared rows after the tokens' in the table, "
                             f"got a table of {table.vocab} rows")
        self.codec, self.table, self.backoff = codec, table, backoff

    def _first_keyed(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with every sequence's first position on the shared row of first positions (``backoff``)."""
        keys = ids.clone()
        keys[..., 0] = self.table.vocab - 1
        return keys

    def _keys(self, ids: torch.Tensor) -> torch.Tensor:
        """The table rows a message's ``ids`` read (their own, or with ``backoff`` the shared ones; the row of
        first positions is never unseen after the first message, as every message updates it)."""
        if not self.backoff:
            return ids
        keys = self._first_keyed(ids)
        if self.table.count is not None:
            unseen = self.table.count[keys.to(self.table.count.device)].to(ids.device) == 0
            keys = torch.where(unseen, self.table.vocab - 2, keys)  # no boolean indexing: it would read back
        return keys

    def state_dict(self) -> dict:
        """The table's :meth:`TokenTable.state_dict` (its own tensors, not copies)."""
        return self.table.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: a table that does not fit (:meth:`TokenTable.load_state_dict`).
        """
        self.table.load_state_dict(state)

    def digest(self) -> str:
        """SHA-256 (hex) of this side's tables: equal on both sides of a link."""
        return self.table.digest()

    def _reference(self, ids: torch.Tensor, d: int, device: torch.device) -> torch.Tensor:
        """float32 ``(*ids.shape, d)``: the rows a message's ``ids`` are coded against."""
        return self.table.lookup(self._keys(ids), d, device)

    def _weights(self, ids: torch.Tensor, d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """Per-channel weights of the residual before coding (``None``: unweighted; :class:`ScaledReferenceCoder`)."""
        return None

    def _fold(self, ids: torch.Tensor, ref: torch.Tensor, residual: torch.Tensor) -> None:
        """Fold a message's decoded rows ``ref + residual`` into the table."""
        rows = ref + residual
        if not self.backoff:
            self.table.update(ids, rows)
            return
        self.table.update(self._first_keyed(ids), rows)
        self.table.update(torch.full_like(ids[..., 1:], self.table.vocab - 2), rows[..., 1:, :])

    def encode(self, x: torch.Tensor, ids: torch.Tensor, update: bool) -> Payload:
        """The payload of floating ``x`` ``(*ids.shape, d)``; with ``update``, fold the reconstruction
        (what the receiver will return) into the table.

        Raises:
            ValueError: ``x`` is not floating or does not fit ``ids`` and the table.
        """
        if not x.is_floating_point() or x.dim() != ids.dim() + 1 or x.shape[:-1] != ids.shape:
            raise ValueError(f"token reference: a {x.dtype} {tuple(x.shape)} tensor for token ids {tuple(ids.shape)}")
        ref = self._reference(ids, x.shape[-1], x.device).to(x.dtype)
        w = self._weights(ids, x.shape[-1], x.device, x.dtype)
        payload = self.codec.encode(x - ref if w is None else (x - ref) * w)
        if update:
            coded = self.codec.decode(payload).to(ref.device)
            self._fold(ids, ref, coded if w is None else coded / w)
        return payload

    def decode(self, payload: Payload, ids: torch.Tensor, update: bool) -> torch.Tensor:
        """``T[ids] + decode(payload)`` in the payload's dtype; with ``update``, fold it into the table.

        Raises:
            ValueError: a corrupt payload, or one whose shape does not fit ``ids``.
        """
        coded = self.codec.decode(payload)
        if coded.dim() != ids.dim() + 1 or coded.shape[:-1] != ids.shape:
            raise ValueError(f"token reference: a residual {tuple(coded.shape)} for token ids {tuple(ids.shape)}")
        ref = self._reference(ids, coded.shape[-1], coded.device).to(coded.dtype)
        w = self._weights(ids, coded.shape[-1], coded.device, coded.dtype)
        residual = coded if w is None else coded / w
        if update:
            self._fold(ids, ref, residual)
        return ref + residual


class ScaledReferenceCoder(ReferenceCoder):
    """:class:`ReferenceCoder` that also weighs each channel of the residual before coding: by ``v ** -0.25``,
    ``v`` the running mean of the channel's squared decoded residual for the row's key (a second table,
    ``squares``, updated alike on both sides), normalised to a root mean square of 1 over the channels; the
    receiver divides by the same weights. Channels whose residual varies more get less of the codec's
    precision than under a plain rotation, the quiet ones more: the weights that minimise the error's energy
    times a uniform rotated quantizer's (Cauchy-Schwarz on ``sum(s^2 v) * sum(1 / s^2)`` gives ``s^2 ~ v^-1/2``;
    classical bit allocation, Huang & Schultheiss, 1963). Keys never seen (all-zero rows) are not weighed.

    Args:
        codec, table: as for :class:`ReferenceCoder`.
        squares: this side's table of squared residuals: the same keys as ``table``, or with ``shared`` one
            row for every key (``TokenTable(1)``: one variance per channel, for tables keyed by a vocabulary
            whose rare tokens would give noisy variances).
        shared: whether ``squares`` has one row for all keys.
        backoff: as for :class:`ReferenceCoder`.

    Raises:
        ValueError: ``shared`` with a ``squares`` table of more than one row.
    """

    def __init__(self, codec: Codec, table: TokenTable, squares: TokenTable, shared: bool = False,
                 backoff: bool = False) -> None:
        super().__init__(codec, table, backoff)
        if shared and squares.vocab != 1:
            raise ValueError(f"token reference: a shared table of squares has one row, not {squares.vocab}")
        self.squares, self.shared = squares, shared

    def state_dict(self) -> dict:
        """The table's :meth:`TokenTable.state_dict` with the squares' under ``"squares"``."""
        return {**self.table.state_dict(), "squares": self.squares.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: a state without the squares, or tables that do not fit.
        """
        if not isinstance(state.get("squares"), dict):
            raise ValueError("token reference: a saved table without its squares; resume with the same "
                             "reference options")
        self.table.load_state_dict(state)
        self.squares.load_state_dict(state["squares"])

    def digest(self) -> str:
        h = hashlib.sha256(self.table.digest().encode())
        h.update(self.squares.digest().encode())
        return h.hexdigest()

    def _square_keys(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(ids) if self.shared else ids

    def _weights(self, ids: torch.Tensor, d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        v = self.squares.lookup(self._square_keys(ids), d, device)
        floor = 1e-6 * v.mean(-1, keepdim=True)
        w = v.clamp(min=1e-30).maximum(floor).pow(-0.25)
        w = w / w.pow(2).mean(-1, keepdim=True).sqrt()
        return torch.where(v.amax(-1, keepdim=True) > 0, w, torch.ones_like(w)).to(dtype)

    def _fold(self, ids: torch.Tensor, ref: torch.Tensor, residual: torch.Tensor) -> None:
        super()._fold(ids, ref, residual)
        self.squares.update(self._square_keys(ids), residual.float().pow(2))
