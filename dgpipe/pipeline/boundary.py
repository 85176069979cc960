"""One stage boundary as seen from one rank: micro-batches through its lanes and its metered link.

A boundary ``stage{i}->stage{i+1}`` joins two stages held by different ranks. Forward,
it carries stage i's output for one micro-batch -- one tensor or a tuple of tensors
-- from the sender rank to the receiver rank; backward, the gradients of the tensors
that required grad, the other way.

Which tensors are compressed:

- training forward: floating tensors that require grad go through the boundary's
  activation codec and arrive as leaves that require grad; every other tensor goes
  losslessly: integer or bool tensors (masks) packed in the fewest bits their range
  needs (``intpack``: a 0/1 mask at 1 bit a value), floating tensors without grad as
  they are (``none``);
- backward: every gradient goes through the gradient codec; a ``None`` gradient (the
  tensor did not influence the loss) is sent as "absent";
- evaluation (no gradients exist to tell tensors apart): floating tensors go through
  the activation codec if the spec's ``compress_eval`` is set, others losslessly.

Each tuple position travels in a lane (:mod:`dgpipe.pipeline.lanes`: lossless, coded,
delta, delta warm-up); one message (a :class:`dgpipe.comm.transport.Sender` stream per
direction) carries one payload per present tensor and a :class:`~dgpipe.pipeline.message.Message`
as its meta: the lane of each position, the micro-batch, and the step's mean loss
(backward messages). :class:`Boundary` codes each position in its lane and moves the message through a
:class:`~dgpipe.comm.link.Link` (timed, framed, metered there).

Delta coding (AQ-SGD, :mod:`dgpipe.compression.wrappers.delta`): when the pipeline has a
:class:`~dgpipe.compression.wrappers.delta.DeltaSpec`, every training forward message starts
with the sample ids of its rows (a lossless int64 payload, counted in the wire bytes
and not in the raw ones; the lanes get them in a :class:`~dgpipe.pipeline.lanes.LaneContext`),
and on a delta-coded boundary each tensor that requires grad takes a delta lane with one
cache per tuple position on each side: the change against the cache, coded by the
activation codec, or, during a warm-up, the tensor losslessly (the cache stores it).
Evaluation carries no ids and uses the activation codec directly.

In training every forward message is answered by one backward
message, even when no tensor needs a gradient, so the loss computed on the last stage
reaches every rank with the gradients, without a collective. Shapes and dtypes travel
in the payload headers, so they may change from step to step. Forward messages of
boundary i use tag ``2i``, backward ones ``2i+1``. The receiving side posts the
receive of each message it knows will come before it is needed: the first forward
message of a step when the step starts (:meth:`Boundary.expect_forward`), the next
one as soon as one arrives, and the answer to each forward message when it is sent.

Padding rows left behind (``row_mask``) and the per-token reference (``token_reference``): see
:mod:`dgpipe.pipeline.spec`.

The codec instances, delta coders and token tables of this rank's side, and their saved state:
:class:`~dgpipe.pipeline.coders.Coders` (``Boundary.coders``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dgpipe.comm import BandwidthMeter, SendWork, TransportError
from dgpipe.comm.delay import DelayLine
from dgpipe.comm.link import Link
from dgpipe.comm.transport import Receiver, Sender
from dgpipe.compression import Codec, Payload, parse_header
from dgpipe.compression.wrappers.delta import check_ids
from dgpipe.compression.wrappers.reference import check_tokens

from .coders import Coders
from .lanes import LOSSLESS_LANE, LaneContext, decode_ids, encode_ids, put_rows
from .message import (ABSENT, CODED, DELTA, DELTA_CODED, DELTA_WARMUP, LOSSLESS, MAX_BOUNDARY_TENSORS, REFERENCE,
                      REQUIRES_GRAD, ROW_MASK, ROWS, TOKEN_IDS, Message, check_declared)
from .spec import BoundarySpec

__all__ = ["Boundary", "MAX_BOUNDARY_TENSORS", "boundary_name"]


def _as_tensors(value, where: str) -> tuple[bool, list[torch.Tensor]]:
    atomic = isinstance(value, torch.Tensor)
    tensors = [value] if atomic else list(value) if isinstance(value, (tuple, list)) else None
    if tensors is None or any(not isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{where} must be a tensor or a tuple of tensors, got {type(value).__name__}")
    if not 1 <= len(tensors) <= MAX_BOUNDARY_TENSORS:
        raise ValueError(f"{where} has {len(tensors)} tensors; a boundary carries 1..{MAX_BOUNDARY_TENSORS}")
    return atomic, tensors


def boundary_name(index: int) -> str:
    """The name of the boundary after stage ``index`` (its meter records and logs): ``"stage{i}->stage{i+1}"``."""
    return f"stage{index}->stage{index + 1}"


class Boundary:
    """The boundary after stage ``index``, between ranks ``src`` (sender of activations) and ``dst``.

    Args:
        index: stage index i of ``stage{i}->stage{i+1}``.
        src, dst: global ranks holding stage i and stage i+1.
        act_factory, grad_factory: codec factories (see :func:`~dgpipe.pipeline.coders.codec_factory`).
        meter: where bytes and seconds are recorded.
        device: device of received tensors on this rank.
        timeout: seconds for each receive and send completion.
        rank: this rank (``src`` or ``dst``).
        spec: the pipeline's boundary options (:class:`~dgpipe.pipeline.spec.BoundarySpec`); this boundary
            delta-codes its activations if ``spec.delta`` covers ``index``.
        report: where cache allocations are reported (one line each).
        delay: hold every message this rank sends back by the line's latency
            (:class:`~dgpipe.comm.delay.DelayLine`, benchmarks only); ``None``: send at once.
        down_group: the process group of the messages that go to the lower of the two ranks (``None``: the
            default group, as every message to the higher one); see :class:`~dgpipe.pipeline.Pipeline`.
    """

    def __init__(
        self,
        index: int,
        src: int,
        dst: int,
        act_factory: Callable[[], Codec],
        grad_factory: Callable[[], Codec],
        meter: BandwidthMeter,
        device: torch.device,
        timeout: float,
        rank: int | None = None,
        spec: BoundarySpec = BoundarySpec(),
        report: Callable[[str], None] | None = print,
        delay: DelayLine | None = None,
        down_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.name = boundary_name(index)
        self._delay, self._down_group = delay, down_group
        self.spec = spec
        self.token_reference = spec.token_reference
        # micro-batch slot -> (the row mask's kept rows, bool (B, L); the leaves sent as rows) of the
        # training forward message of that slot, for its backward message (sender and receiver alike)
        self._kept: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}
        self.src, self.dst = src, dst
        self.rank = src if rank is None else rank
        delta = spec.delta
        self.delta_coded = delta is not None and delta.covers(index)
        self.coders = Coders(self.name, self.rank, "sender" if self.rank == src else "receiver", act_factory,
                             grad_factory, delta if self.delta_coded else None, spec.token_reference, report)
        self._tags = {"forward": 2 * index, "eval": 2 * index, "backward": 2 * index + 1}
        self._link, self._device, self._timeout = Link(self.name, meter, device=device), device, timeout
        # One stream per direction: forward (and eval) src -> dst, backward dst -> src.
        self._senders: dict[str, Sender] = {}
        self._receivers: dict[str, Receiver] = {}
        self._grads_due = 0  # backward messages this rank will still receive in this step

    def _ends(self, direction: str) -> tuple[str, int, int, int, dist.ProcessGroup | None]:
        """``(key, src, dst, tag, group)`` of ``direction``'s stream (eval shares forward's)."""
        key = "backward" if direction == "backward" else "forward"
        src, dst = (self.dst, self.src) if key == "backward" else (self.src, self.dst)
        return key, src, dst, self._tags[key], self._down_group if dst < src else None

    def _sender(self, direction: str) -> Sender:
        key, _, dst, tag, group = self._ends(direction)
        if key not in self._senders:
            self._senders[key] = Sender(dst, group, tag, self._delay)
        return self._senders[key]

    def _receiver(self, direction: str) -> Receiver:
        key, src, _, tag, group = self._ends(direction)
        if key not in self._receivers:
            self._receivers[key] = Receiver(src, group, tag)
        return self._receivers[key]

    # -- forward ---------------------------------------------------------------------------

    def send_forward(
        self, slot: int, value, n_micro: int, direction: str, ids: torch.Tensor | None = None,
        refresh: bool = False,
    ) -> tuple[list[SendWork], list[torch.Tensor]]:
        """Send micro-batch ``slot``'s stage output ``value`` (tensor or tuple) to ``dst``.

        Args:
            n_micro: number of micro-batches in this step (travels in the meta).
            direction: ``"forward"`` (training) or ``"eval"``.
            ids: training only, with a delta spec: the sample ids (int64 ``(B,)``) of the rows.
            refresh: on a delta-coded boundary, send the tensors that require grad
                losslessly and store them in the caches (warm-up) instead of coding the change.

        Returns:
            The send handles and the tensors that require grad (their gradients come
            back through :meth:`recv_backward`, in this order).

        Raises:
            ValueError: a delta-coded boundary in training without ``ids``, or a value without the spec's row
                mask.
        """
        atomic, tensors = _as_tensors(value, f"output of the stage before {self.name}")
        if direction == "forward" and self.delta_coded and ids is None:
            raise ValueError(f"{self.name} is delta-coded: training steps need sample_ids")
        flags = []
        for t in tensors:
            if direction == "forward":
                rg = t.is_floating_point() and t.requires_grad
                kind = CODED if rg else LOSSLESS
                if rg and self.delta_coded:
                    kind = DELTA_WARMUP if refresh else DELTA_CODED
                flags.append(kind | (REQUIRES_GRAD if rg else 0))
            else:
                flags.append(CODED if self.spec.compress_eval and t.is_floating_point() else LOSSLESS)
        keep = None
        mask_pos = self.spec.row_mask
        if mask_pos is not None:
            self.spec.check_row_mask(tensors, self.name)
            keep = tensors[mask_pos] != 0
            flags[mask_pos] |= ROW_MASK
            for pos, t in enumerate(tensors):
                if t.is_floating_point() and t.dim() >= 3 and t.shape[:2] == keep.shape:
                    flags[pos] |= ROWS
        tokens = None
        if self.token_reference is not None:
            tokens = self._mark_reference(tensors, flags)
        ids = ids if direction == "forward" else None
        message = Message(tuple(flags), n_micro, slot, atomic=atomic, has_ids=ids is not None)
        works = self._send(direction, message, tensors, ids, keep, tokens)
        if direction == "forward":  # a backward message will answer it: have the receive ready
            self._grads_due += 1
            self._receiver("backward").post()
            self._remember_rows(message, keep)
        return works, [t for t, f in zip(tensors, flags) if f & REQUIRES_GRAD]

    def _mark_reference(self, tensors: list[torch.Tensor], flags: list[int]) -> torch.Tensor:
        """Flag the last tensor as the token ids and the coded ``(B, L, d)`` tensors as reference-coded;
        returns the ids (int64 ``(B, L)``).

        Raises:
            ValueError: the last tensor is not integer token ids of a floating tensor's ``(B, L)``.
        """
        last = tensors[-1]
        floating = [t for t in tensors if t.is_floating_point() and t.dim() == 3]
        if not floating:
            raise ValueError(f"{self.name}: a token reference needs a floating (B, L, d) tensor in the value")
        tokens = check_tokens(last, self.token_reference.vocab, tuple(floating[0].shape[:2]),
                              f"{self.name}: the value's last tensor")
        flags[-1] |= TOKEN_IDS
        for pos, t in enumerate(tensors):
            if flags[pos] & CODED and t.is_floating_point() and t.dim() == 3 and t.shape[:2] == last.shape:
                flags[pos] |= REFERENCE
        return tokens

    def _remember_rows(self, message: Message, keep: torch.Tensor | None) -> None:
        """Keep a training forward message's row mask for the gradients of its micro-batch."""
        if keep is None:
            return
        leaves = [pos for pos in range(len(message.flags)) if message.requires_grad(pos)]
        self._kept[message.slot] = (keep, frozenset(i for i, pos in enumerate(leaves) if message.rows(pos)))

    def expect_forward(self) -> None:
        """Post the receive of the next forward message (this rank is ``dst``; one will come)."""
        self._receiver("forward").post()

    def recv_forward(self, slot: int, direction: str) -> tuple[object, list[torch.Tensor], int, torch.Tensor | None]:
        """Receive micro-batch ``slot``'s input from ``src``.

        Returns:
            ``(value, leaves, n_micro, ids)``: the tensor or tuple, the received leaves that
            require grad (pass their ``.grad`` to :meth:`send_backward`), the sender's
            number of micro-batches in this step, and the rows' sample ids (or ``None``).
        """
        message, tensors, ids = self._recv(direction, slot, self.src)
        if slot + 1 < message.n_micro:
            self.expect_forward()
        if any(t is None for t in tensors):
            raise ValueError(f"{self.name}: forward message from rank {self.src} has absent tensors")
        if direction == "forward" and message.row_mask is not None:
            self._remember_rows(message, tensors[message.row_mask] != 0)
        leaves = []
        for pos in range(len(tensors)):
            if message.requires_grad(pos):
                tensors[pos] = tensors[pos].detach().requires_grad_()
                leaves.append(tensors[pos])
        return (tensors[0] if message.atomic else tuple(tensors)), leaves, message.n_micro, ids

    # -- backward --------------------------------------------------------------------------

    def send_backward(self, slot: int, grads: Sequence[torch.Tensor | None], loss: float) -> list[SendWork]:
        """Send the gradients of the leaves :meth:`recv_forward` returned for ``slot`` (maybe
        none) and the step's mean ``loss`` to ``src``."""
        keep, rows = self._kept.pop(slot, (None, frozenset()))
        message = Message(tuple(ABSENT if g is None else CODED | (ROWS if i in rows else 0)
                                for i, g in enumerate(grads)), 0, slot, loss)
        return self._send("backward", message, list(grads), keep=keep)

    def recv_backward(self, slot: int, n_expected: int) -> tuple[list[torch.Tensor | None], float]:
        """Receive the gradients for the ``n_expected`` tensors :meth:`send_forward` returned.

        Returns:
            ``(grads, loss)``: one gradient or ``None`` per tensor, and the step's mean loss.
        """
        keep, rows = self._kept.pop(slot, (None, frozenset()))
        message, grads, _ = self._recv("backward", slot, self.dst, keep, rows)
        self._grads_due -= 1
        if self._grads_due > 0:
            self._receiver("backward").post()
        if len(grads) != n_expected:
            raise ValueError(f"{self.name}: rank {self.dst} sent {len(grads)} gradients, expected {n_expected}")
        return grads, message.loss

    # -- wire ------------------------------------------------------------------------------

    def _send(self, direction: str, message: Message, tensors: list, ids: torch.Tensor | None = None,
              keep: torch.Tensor | None = None, tokens: torch.Tensor | None = None) -> list[SendWork]:
        """Lanes -> link for one message (of the positions flagged :data:`ROWS`, the rows
        ``keep`` marks; reference lanes keyed by ``tokens``)."""
        ctx = LaneContext(ids, tokens=tokens, update=direction == "forward")
        rows_ctx = LaneContext(ids, keep=keep)
        with torch.no_grad(), self._link.encoding(direction) as out:
            if ids is not None:  # first; wire bytes but no raw bytes (a plain pipeline sends none)
                out.add(encode_ids(ids))
            for pos, t in enumerate(tensors):
                if message.kind(pos) == ABSENT:
                    continue
                lane = self.coders.lane(direction, message.slot, pos, message.kind(pos), message.referenced(pos))
                raw, t = t.numel() * t.element_size(), t.detach()
                if message.rows(pos) and message.kind(pos) & DELTA:  # the delta lane takes the rows itself
                    out.add(lane.encode(t, rows_ctx), raw)
                else:
                    out.add(lane.encode(t[keep.to(t.device)] if message.rows(pos) else t, ctx), raw)
        label = f"{self.name} {direction}, micro-batch {message.slot}"
        work = self._link.send(self._sender(direction), out, message.to_meta(), label)
        return [work]

    def _recv(self, direction: str, slot: int, peer: int, keep: torch.Tensor | None = None,
              rows: frozenset[int] = frozenset()
              ) -> tuple[Message, list[torch.Tensor | None], torch.Tensor | None]:
        """Link -> lanes for one message: ``(message, tensors or None, ids)``; tensors sent as
        rows are put back in place, by the message's row mask or (backward) by ``keep``, where the
        positions ``rows`` may travel as rows."""
        where = f"{self.name} {direction}, micro-batch {slot}"
        try:
            incoming = self._link.receive(self._receiver(direction), self._device, self._timeout)
        except TransportError as err:
            raise TransportError(f"{where}: {err}", err.peer) from err
        except ValueError as err:  # a corrupt message: name the boundary too
            raise ValueError(f"{where}: {err}") from err
        message = self._parse_meta(incoming.meta, len(incoming.payloads), slot, peer)
        try:
            with self._link.decoding(direction, incoming):
                tensors, ids = self._decode(message, incoming.payloads, direction, slot, peer, keep, rows)
        except ValueError as err:
            raise ValueError(f"{where}: corrupt payload from rank {peer}: {err}") from err
        return message, tensors, ids

    def _decode(self, message: Message, payloads: list[Payload], direction: str, slot: int, peer: int,
                keep: torch.Tensor | None, rows: frozenset[int]
                ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """Lanes for one received message: ``(tensors or None, ids)`` (as :meth:`_recv`).

        Raises:
            ValueError: a payload that does not decode or whose header declares another shape than its place.
        """
        ids = None
        it = iter(payloads)
        if message.has_ids:
            ids = self._parse_ids(decode_ids(next(it)), direction, peer)
        at = {pos: next(it) for pos in range(len(message.flags)) if message.kind(pos) != ABSENT}
        tensors: list[torch.Tensor | None] = [None] * len(message.flags)
        keep = self._row_keep(message, at, tensors, keep, rows)  # the row mask first: delta lanes need it
        tokens = self._tokens(message, at, tensors)  # the token ids too: reference lanes need them
        ctx = LaneContext(ids, self._device, tokens=tokens, update=direction == "forward")
        rows_ctx = LaneContext(ids, self._device, keep)
        for pos, payload in at.items():
            if pos in (message.row_mask, message.token_ids):
                continue
            kind = message.kind(pos)
            check_declared(pos, parse_header(payload.header).shape,
                            keep if message.rows(pos) and not kind & DELTA else None,
                            tokens if message.referenced(pos) else None)
            lane = self.coders.lane(direction, slot, pos, kind, message.referenced(pos))
            if message.rows(pos) and kind & DELTA:  # the delta lane restores the rows itself
                tensors[pos] = lane.decode(payload, rows_ctx)
            else:
                t = lane.decode(payload, ctx)
                tensors[pos] = put_rows(t, keep) if message.rows(pos) else t
        return tensors, ids

    def _row_keep(self, message: Message, payloads: dict[int, Payload], tensors: list, keep: torch.Tensor | None,
                  rows: frozenset[int]) -> torch.Tensor | None:
        """The rows that travel in ``message``: from its row mask (decoded here, losslessly, into its place
        in ``tensors``), else (backward) ``keep``, which the positions ``rows`` may use; None when no
        position is rows.

        Raises:
            ValueError: a row mask that is not an integer ``(B, L)`` tensor, or rows without a row mask
                (forward: in the message; backward: one this rank's forward message of the micro-batch sent).
        """
        positions = [pos for pos in payloads if message.rows(pos)]
        if message.row_mask is not None:
            mask = tensors[message.row_mask] = LOSSLESS_LANE.decode(payloads[message.row_mask], LaneContext())
            if mask.is_floating_point() or mask.dim() != 2:
                raise ValueError(f"the row mask is {mask.dtype} {tuple(mask.shape)}, not an integer (B, L) tensor")
            return mask.to(self._device) != 0
        if positions and (keep is None or any(pos not in rows for pos in positions)):
            raise ValueError("tensors sent as rows without a row mask for them")
        return keep

    def _tokens(self, message: Message, payloads: dict[int, Payload], tensors: list) -> torch.Tensor | None:
        """The message's token ids (decoded here, losslessly, into their place in ``tensors``), or None.

        Raises:
            ValueError: token ids on a rank without a token reference, or ids that are not integer
                ``(B, L)`` values in ``[0, vocab)``.
        """
        pos = message.token_ids
        if pos is None:
            return None
        if self.token_reference is None:
            raise ValueError("token ids in a message, but this rank has no token reference "
                             "(configure it alike on every rank)")
        t = tensors[pos] = LOSSLESS_LANE.decode(payloads[pos], LaneContext())
        if t.dim() != 2:
            raise ValueError(f"token ids {t.dtype} {tuple(t.shape)}, not an integer (B, L) tensor")
        return check_tokens(t, self.token_reference.vocab, tuple(t.shape), "token ids")

    def _parse_ids(self, ids: torch.Tensor, direction: str, peer: int) -> torch.Tensor:
        """Check a message's sample ids against their range (with delta coding, the rows are checked
        where they meet a cache: :meth:`DeltaCoder.decode <dgpipe.compression.wrappers.delta.DeltaCoder.decode>`)."""
        if direction != "forward" or self.spec.id_examples is None:
            raise ValueError(f"sample ids in a {direction} message, but this rank expects none "
                             f"(are delta coding and per-example dropout configured alike on every rank?)")
        check_ids(ids, self.spec.id_examples, where=f"sample ids from rank {peer}")
        return ids

    def _parse_meta(self, meta: list[int], n_payloads: int, slot: int, peer: int) -> Message:
        """The :class:`Message` of ``meta``, from rank ``peer``, for micro-batch ``slot``.

        Raises:
            ValueError: corrupt meta, or another micro-batch (ranks out of step).
        """
        try:
            message = Message.from_meta(meta, n_payloads)
        except ValueError as err:
            raise ValueError(f"{self.name}: {err} (from rank {peer})") from None
        if message.slot != slot:
            raise ValueError(f"{self.name}: rank {peer} sent micro-batch {message.slot}, expected {slot} "
                             f"(ranks out of step)")  # fmt: skip
        return message
