"""One stage boundary as seen from one rank: micro-batches through codecs, transport and meter.

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
  the activation codec if ``compress`` is set, others losslessly.

One message (a :class:`dgpipe.comm.transport.Sender` stream per direction) carries one
payload per present tensor and the meta ``[head, n_micro, slot, loss, flag_0 ..
flag_{n-1}]``, where ``head`` = 1 if the value is one tensor (not a tuple) + 2 if
sample ids come first, ``flag`` = kind (0 absent, 1 lossless, 2 coded) + 4 if the
tensor requires grad + 8 if it is delta-coded, in which case ``flag >> 4`` is the
activation's dtype code, and ``loss`` is the step's mean loss as the bits of a float64
(backward messages; 0 forward).

Delta coding (AQ-SGD, :mod:`dgpipe.compression.wrappers.delta`): when the pipeline has a
:class:`~dgpipe.compression.wrappers.delta.DeltaSpec`, every training forward message starts
with the sample ids of its rows (a lossless int64 payload, counted in the wire bytes
and not in the raw ones), and on a delta-coded boundary each tensor that requires
grad goes through a :class:`~dgpipe.compression.wrappers.delta.DeltaCoder` with one cache per
tuple position on each side: coded (the change against the cache, by the activation
codec) or, during a warm-up, lossless (the cache stores it). Evaluation carries no
ids and uses the activation codec directly.

In training every forward message is answered by one backward
message, even when no tensor needs a gradient, so the loss computed on the last stage
reaches every rank with the gradients, without a collective. Shapes and dtypes travel
in the payload headers, so they may change from step to step. Forward messages of
boundary i use tag ``2i``, backward ones ``2i+1``. The receiving side posts the
receive of each message it knows will come before it is needed: the first forward
message of a step when the step starts (:meth:`Boundary.expect_forward`), the next
one as soon as one arrives, and the answer to each forward message when it is sent.

Codec instances are made per (direction, micro-batch slot, tuple position), so a
stateful codec (error feedback) keeps one state per boundary, direction and slot;
evaluation uses its own instances and never touches training state.
"""

from __future__ import annotations

import struct
import time
from typing import Callable, Sequence, Union

import torch

from dgpipe.comm import BandwidthMeter, SendWork, TransportError
from dgpipe.comm.transport import Receiver, Sender
from dgpipe.compression import Codec, Payload, get_codec
from dgpipe.compression.base import DTYPE_CODES, code_from_dtype, dtype_from_code
from dgpipe.compression.wrappers.delta import DeltaCache, DeltaCoder, DeltaSpec, check_ids

__all__ = ["CodecSpec", "codec_factory", "codec_factories", "Boundary", "MAX_BOUNDARY_TENSORS"]

CodecSpec = Union[str, tuple, Callable[[], Codec], Codec]
MAX_BOUNDARY_TENSORS = 16
ABSENT, LOSSLESS, CODED, REQUIRES_GRAD, DELTA = 0, 1, 2, 4, 8
ATOMIC, HAS_IDS = 1, 2  # bits of the meta's head
DTYPE_SHIFT = 4  # a delta-coded tensor's flag carries its dtype code above the kind bits
_VALID_FLAGS = {ABSENT, LOSSLESS, CODED, LOSSLESS | REQUIRES_GRAD, CODED | REQUIRES_GRAD}
_FLOAT_CODES = {c for d, c in DTYPE_CODES.items() if d.is_floating_point}
_LOSSLESS = get_codec("none")
_INTS = get_codec("intpack")  # integer and bool tensors (masks): lossless, in the fewest bits their range needs
_LOSSLESS_BY_ID = {c.codec_id: c for c in (_LOSSLESS, _INTS)}


def _lossless(t: torch.Tensor) -> Codec:
    """The lossless codec of a tensor: ``none`` for floating tensors, ``intpack`` for the others."""
    return _LOSSLESS if t.is_floating_point() else _INTS


def _decode_lossless(payload: Payload) -> torch.Tensor:
    """Decode a lossless payload with the codec its header names (``none`` or ``intpack``).

    Raises:
        ValueError: the header names another codec, or is corrupt.
    """
    h = payload.header
    codec = _LOSSLESS_BY_ID.get(int(h[1])) if h.dim() == 1 and h.numel() > 1 else None
    if codec is None:
        raise ValueError("corrupt payload: a lossless tensor's header names neither 'none' nor 'intpack'")
    return codec.decode(payload)


def codec_factory(spec: CodecSpec) -> Callable[[], Codec]:
    """Turn a codec spec into a zero-argument factory of fresh codec instances.

    Args:
        spec: a registered codec name (``"sortquant"``), a ``(name, options)`` tuple
            (``("sortquant", {"quant_bits": 6, "split_bits": 2})``), a zero-argument
            callable returning a :class:`Codec`, or a stateless :class:`Codec`
            instance (shared; stateful codecs need a factory).

    Raises:
        ValueError: unknown name, bad options, a stateful instance, or anything else.
    """
    if isinstance(spec, str):
        get_codec(spec)
        return lambda: get_codec(spec)
    if isinstance(spec, tuple):
        if len(spec) != 2 or not isinstance(spec[0], str) or not isinstance(spec[1], dict):
            raise ValueError(f"a codec tuple must be (name, options dict), got {spec!r}")
        name, options = spec
        get_codec(name, **options)
        return lambda: get_codec(name, **options)
    if isinstance(spec, Codec):
        if spec.stateful:
            raise ValueError(
                f"{spec!r} is stateful and would share its state across boundaries; pass a factory, "
                f"e.g. lambda: make_codec(), so that each boundary, direction and micro-batch gets its own"
            )
        return lambda: spec
    if callable(spec):
        made = spec()
        if not isinstance(made, Codec):
            raise ValueError(f"codec factory {spec!r} returned {type(made).__name__}, not a Codec")
        return spec
    raise ValueError(f"codec spec must be a name, (name, options), a factory or a Codec; got {spec!r}")


def codec_factories(spec: CodecSpec | list, n_boundaries: int, what: str) -> list[Callable[[], Codec]]:
    """One factory per stage boundary: ``spec`` for all, or a list with one spec per boundary.

    Raises:
        ValueError: a list of the wrong length (``what`` names the argument), or a bad spec.
    """
    if isinstance(spec, list):
        if len(spec) != n_boundaries:
            raise ValueError(f"{what} lists {len(spec)} codecs but there are {n_boundaries} stage boundaries")
        return [codec_factory(s) for s in spec]
    factory = codec_factory(spec)
    return [factory] * n_boundaries


def _valid_flag(flag: int) -> bool:
    """A plain flag, or a delta flag: coded or lossless, requires grad, a floating dtype code."""
    if flag in _VALID_FLAGS:
        return True
    low, code = flag & ((1 << DTYPE_SHIFT) - 1), flag >> DTYPE_SHIFT
    return low in (CODED | REQUIRES_GRAD | DELTA, LOSSLESS | REQUIRES_GRAD | DELTA) and code in _FLOAT_CODES


def _float_bits(x: float) -> int:
    """The IEEE float64 bits of ``x`` as a signed int64 (to travel in int64 meta)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _as_tensors(value, where: str) -> tuple[bool, list[torch.Tensor]]:
    atomic = isinstance(value, torch.Tensor)
    tensors = [value] if atomic else list(value) if isinstance(value, (tuple, list)) else None
    if tensors is None or any(not isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{where} must be a tensor or a tuple of tensors, got {type(value).__name__}")
    if not 1 <= len(tensors) <= MAX_BOUNDARY_TENSORS:
        raise ValueError(f"{where} has {len(tensors)} tensors; a boundary carries 1..{MAX_BOUNDARY_TENSORS}")
    return atomic, tensors


class Boundary:
    """The boundary after stage ``index``, between ranks ``src`` (sender of activations) and ``dst``.

    Args:
        index: stage index i of ``stage{i}->stage{i+1}``.
        src, dst: global ranks holding stage i and stage i+1.
        act_factory, grad_factory: codec factories (see :func:`codec_factory`).
        meter: where bytes and seconds are recorded.
        device: device of received tensors on this rank.
        timeout: seconds for each receive and send completion.
        rank: this rank (``src`` or ``dst``).
        delta: the pipeline's delta spec (``None``: no sample ids travel); this boundary
            delta-codes its activations if the spec covers ``index``.
        report: where cache allocations are reported (one line each).
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
        delta: DeltaSpec | None = None,
        report: Callable[[str], None] | None = print,
    ) -> None:
        self.name = f"stage{index}->stage{index + 1}"
        self.src, self.dst = src, dst
        self.rank = src if rank is None else rank
        self.delta = delta
        self.delta_coded = delta is not None and delta.covers(index)
        self._deltas: dict[int, DeltaCoder] = {}
        self._report = report
        self._tags = {"forward": 2 * index, "eval": 2 * index, "backward": 2 * index + 1}
        self._factories = {"forward": act_factory, "eval": act_factory, "backward": grad_factory}
        self._codecs: dict[tuple[str, int, int], Codec] = {}
        self._meter, self._device, self._timeout = meter, device, timeout
        # One stream per direction: forward (and eval) src -> dst, backward dst -> src.
        self._senders: dict[str, Sender] = {}
        self._receivers: dict[str, Receiver] = {}
        self._grads_due = 0  # backward messages this rank will still receive in this step

    def _stream(self, direction: str, sending: bool) -> Sender | Receiver:
        key = "backward" if direction == "backward" else "forward"
        table, cls = (self._senders, Sender) if sending else (self._receivers, Receiver)
        if key not in table:
            src, dst = (self.dst, self.src) if key == "backward" else (self.src, self.dst)
            table[key] = cls(dst if sending else src, tag=self._tags[key])
        return table[key]

    def _codec(self, direction: str, slot: int, pos: int) -> Codec:
        key = (direction, slot, pos)
        if key not in self._codecs:
            self._codecs[key] = self._factories[direction]()
        return self._codecs[key]

    def _delta_coder(self, pos: int) -> DeltaCoder:
        """The delta coder of tuple position ``pos`` on this rank's side (made on first use)."""
        if pos not in self._deltas:
            side = "sender" if self.rank == self.src else "receiver"
            spec = self.delta
            path = None
            if spec.cache_dir is not None:
                stem = self.name.replace("->", "-")
                path = f"{spec.cache_dir}/{stem}.tensor{pos}.{side}.rank{self.rank}.bin"
            cache = DeltaCache(spec.examples, spec.cache_dtype, path, spec.max_bytes,
                               f"rank {self.rank}: delta cache {self.name} tensor {pos} ({side})", self._report)
            self._deltas[pos] = DeltaCoder(self._factories["forward"](), cache)
        return self._deltas[pos]

    # -- forward ---------------------------------------------------------------------------

    def send_forward(
        self, slot: int, value, n_micro: int, direction: str, compress: bool = True,
        ids: torch.Tensor | None = None, refresh: bool = False,
    ) -> tuple[list[SendWork], list[torch.Tensor]]:
        """Send micro-batch ``slot``'s stage output ``value`` (tensor or tuple) to ``dst``.

        Args:
            n_micro: number of micro-batches in this step (travels in the meta).
            direction: ``"forward"`` (training) or ``"eval"``.
            compress: in eval, whether floating tensors go through the activation codec.
            ids: training only, with a delta spec: the sample ids (int64 ``(B,)``) of the rows.
            refresh: on a delta-coded boundary, send the tensors that require grad
                losslessly and store them in the caches (warm-up) instead of coding the change.

        Returns:
            The send handles and the tensors that require grad (their gradients come
            back through :meth:`recv_backward`, in this order).

        Raises:
            ValueError: a delta-coded boundary in training without ``ids``.
        """
        atomic, tensors = _as_tensors(value, f"output of the stage before {self.name}")
        if direction == "forward" and self.delta_coded and ids is None:
            raise ValueError(f"{self.name} is delta-coded: training steps need sample_ids")
        flags = []
        for t in tensors:
            if direction == "forward":
                rg = t.is_floating_point() and t.requires_grad
                flag = (CODED | REQUIRES_GRAD) if rg else LOSSLESS
                if rg and self.delta_coded:
                    flag = ((LOSSLESS if refresh else CODED) | REQUIRES_GRAD | DELTA
                            | code_from_dtype(t.dtype) << DTYPE_SHIFT)
                flags.append(flag)
            else:
                flags.append(CODED if compress and t.is_floating_point() else LOSSLESS)
        works = self._send(direction, slot, tensors, flags, atomic, n_micro, ids=ids if direction == "forward" else None)
        if direction == "forward":  # a backward message will answer it: have the receive ready
            self._grads_due += 1
            self._stream("backward", sending=False).post()
        return works, [t for t, f in zip(tensors, flags) if f & REQUIRES_GRAD]

    def expect_forward(self) -> None:
        """Post the receive of the next forward message (this rank is ``dst``; one will come)."""
        self._stream("forward", sending=False).post()

    def recv_forward(self, slot: int, direction: str) -> tuple[object, list[torch.Tensor], int, torch.Tensor | None]:
        """Receive micro-batch ``slot``'s input from ``src``.

        Returns:
            ``(value, leaves, n_micro, ids)``: the tensor or tuple, the received leaves that
            require grad (pass their ``.grad`` to :meth:`send_backward`), the sender's
            number of micro-batches in this step, and the rows' sample ids (or ``None``).
        """
        atomic, n_micro, _, tensors, flags, ids = self._recv(direction, slot, self.src)
        if slot + 1 < n_micro:
            self.expect_forward()
        if any(t is None for t in tensors):
            raise ValueError(f"{self.name}: forward message from rank {self.src} has absent tensors")
        leaves = []
        for i, f in enumerate(flags):
            if f & REQUIRES_GRAD:
                tensors[i] = tensors[i].detach().requires_grad_()
                leaves.append(tensors[i])
        return (tensors[0] if atomic else tuple(tensors)), leaves, n_micro, ids

    # -- backward --------------------------------------------------------------------------

    def send_backward(self, slot: int, grads: Sequence[torch.Tensor | None], loss: float) -> list[SendWork]:
        """Send the gradients of the leaves :meth:`recv_forward` returned for ``slot`` (maybe
        none) and the step's mean ``loss`` to ``src``."""
        flags = [ABSENT if g is None else CODED for g in grads]
        return self._send("backward", slot, list(grads), flags, False, 0, loss)

    def recv_backward(self, slot: int, n_expected: int) -> tuple[list[torch.Tensor | None], float]:
        """Receive the gradients for the ``n_expected`` tensors :meth:`send_forward` returned.

        Returns:
            ``(grads, loss)``: one gradient or ``None`` per tensor, and the step's mean loss.
        """
        _, _, loss, grads, _, _ = self._recv("backward", slot, self.dst)
        self._grads_due -= 1
        if self._grads_due > 0:
            self._stream("backward", sending=False).post()
        if len(grads) != n_expected:
            raise ValueError(f"{self.name}: rank {self.dst} sent {len(grads)} gradients, expected {n_expected}")
        return grads, loss

    # -- wire ------------------------------------------------------------------------------

    def _send(self, direction, slot, tensors, flags, atomic, n_micro, loss: float = 0.0,
              ids: torch.Tensor | None = None) -> list[SendWork]:
        start = _now(self._device)
        payloads: list[Payload] = []
        raw = 0
        with torch.no_grad():
            if ids is not None:  # lossless, first; wire bytes but no raw bytes (a plain pipeline sends none)
                payloads.append(_LOSSLESS.encode(ids.cpu()))
            for pos, (t, f) in enumerate(zip(tensors, flags)):
                if f == ABSENT:
                    continue
                raw += t.numel() * t.element_size()
                if f & DELTA:
                    coder = self._delta_coder(pos)
                    if f & CODED:
                        payloads.append(coder.encode(t.detach(), ids))
                        continue
                    coder.refresh(t.detach(), ids)
                codec = self._codec(direction, slot, pos) if f & CODED else _lossless(t)
                payloads.append(codec.encode(t.detach()))
        encode_seconds = _now(self._device) - start
        meta = [int(atomic) | (HAS_IDS if ids is not None else 0), n_micro, slot, _float_bits(loss), *flags]
        work = self._stream(direction, sending=True).send(payloads, meta=meta,
                                                           label=f"{self.name} {direction}, micro-batch {slot}")
        wire = sum(p.nbytes for p in payloads)
        self._meter.record_send(self.name, direction, raw_bytes=raw, wire_bytes=wire,
                                frame_bytes=work.nbytes - wire, encode_seconds=encode_seconds)  # fmt: skip
        return [work]

    def _recv(self, direction, slot, peer):
        start = time.perf_counter()
        where = f"{self.name} {direction}, micro-batch {slot}"
        try:
            payloads, meta = self._stream(direction, sending=False).recv(self._device, self._timeout)
        except TransportError as err:
            raise TransportError(f"{where}: {err}", err.peer) from err
        except ValueError as err:  # a corrupt message: name the boundary too
            raise ValueError(f"{where}: {err}") from err
        recv_seconds = time.perf_counter() - start
        atomic, has_ids, n_micro, loss, flags = self._parse_meta(meta, len(payloads), slot, peer)
        start = _now(self._device)
        tensors, it, ids = [], iter(payloads), None
        try:
            if has_ids:
                ids = self._parse_ids(_LOSSLESS.decode(next(it)), direction, peer)
            for pos, f in enumerate(flags):
                if f == ABSENT:
                    tensors.append(None)
                elif f & DELTA:
                    tensors.append(self._recv_delta(pos, f, next(it), ids))
                elif f & CODED:
                    tensors.append(self._codec(direction, slot, pos).decode(next(it)))
                else:
                    tensors.append(_decode_lossless(next(it)))
        except ValueError as err:
            raise ValueError(f"{where}: corrupt payload from rank {peer}: {err}") from err
        decode_seconds = _now(self._device) - start
        self._meter.record_recv(self.name, direction, recv_bytes=sum(p.nbytes for p in payloads),
                                recv_seconds=recv_seconds, decode_seconds=decode_seconds)  # fmt: skip
        return atomic, n_micro, loss, tensors, flags, ids

    def _parse_ids(self, ids: torch.Tensor, direction: str, peer: int) -> torch.Tensor:
        """Check a message's sample ids against the delta spec (the rows are checked where they
        meet a cache: :meth:`DeltaCoder.decode <dgpipe.compression.wrappers.delta.DeltaCoder.decode>`)."""
        if direction != "forward" or self.delta is None:
            raise ValueError(f"sample ids in a {direction} message, but this rank expects none "
                             f"(is delta coding configured alike on every rank?)")
        check_ids(ids, self.delta.examples, where=f"sample ids from rank {peer}")
        return ids

    def _recv_delta(self, pos: int, flag: int, payload: Payload, ids: torch.Tensor | None) -> torch.Tensor:
        """Decode a delta-coded (or warm-up lossless) tensor against this side's cache."""
        if ids is None or not self.delta_coded:
            raise ValueError("a delta-coded tensor " + ("without sample ids" if ids is None else
                             "on a boundary this rank does not delta-code (configure delta alike on every rank)"))
        dtype = dtype_from_code(flag >> DTYPE_SHIFT, "delta dtype")
        coder = self._delta_coder(pos)
        if flag & CODED:
            return coder.decode(payload, ids, dtype).to(self._device)
        x = _LOSSLESS.decode(payload)
        if x.dtype != dtype or x.dim() < 1 or x.shape[0] != ids.numel():
            raise ValueError(f"warm-up tensor {x.dtype} {tuple(x.shape)} for {ids.numel()} ids of {dtype}")
        coder.refresh(x, ids)
        return x

    def _parse_meta(self, meta: list[int], n_payloads: int, slot: int, peer: int):
        """Check ``[head, n_micro, slot, loss, *flags]``; returns (atomic, has_ids, n_micro, loss, flags)."""
        flags = meta[4:]
        ok = len(meta) >= 4 and 0 <= meta[0] <= ATOMIC | HAS_IDS and meta[1] >= 0 and len(flags) <= MAX_BOUNDARY_TENSORS
        ok = ok and all(_valid_flag(f) for f in flags) and (not meta[0] & ATOMIC or len(flags) == 1)
        has_ids = ok and bool(meta[0] & HAS_IDS)
        ok = ok and n_payloads == sum(f != ABSENT for f in flags) + has_ids
        if not ok:
            raise ValueError(f"{self.name}: corrupt message meta from rank {peer}: {meta[:8]}")
        if meta[2] != slot:
            raise ValueError(f"{self.name}: rank {peer} sent micro-batch {meta[2]}, expected {slot} "
                             f"(ranks out of step)")  # fmt: skip
        return bool(meta[0] & ATOMIC), has_ids, meta[1], _bits_float(meta[3]), flags

    # -- state -----------------------------------------------------------------------------

    def codec_state(self) -> dict[str, object]:
        """``state_dict()`` of every codec instance that has one, keyed ``direction/slot/position``."""
        return {
            f"{d}/{s}/{p}": c.state_dict() for (d, s, p), c in self._codecs.items() if hasattr(c, "state_dict")
        }

    def load_codec_state(self, state: dict[str, object]) -> None:
        """Restore :meth:`codec_state` output, creating the codec instances it names."""
        for key, value in state.items():
            d, s, p = key.split("/")
            if d not in self._factories:
                raise ValueError(f"{self.name}: codec state key {key!r} has unknown direction {d!r}")
            codec = self._codec(d, int(s), int(p))
            if not hasattr(codec, "load_state_dict"):
                raise ValueError(f"{self.name}: codec {codec!r} has no load_state_dict for state {key!r}")
            codec.load_state_dict(value)

    def delta_state(self) -> dict[str, dict]:
        """``state_dict()`` of this side's delta cache per tuple position (``{}`` if none)."""
        return {str(pos): coder.cache.state_dict() for pos, coder in sorted(self._deltas.items())}

    def load_delta_state(self, state: dict[str, dict]) -> None:
        """Restore :meth:`delta_state` output.

        Raises:
            ValueError: the boundary is not delta-coded on this rank, or a cache does not fit.
        """
        if state and not self.delta_coded:
            raise ValueError(f"{self.name}: saved delta caches, but this boundary is not delta-coded; resume with "
                             f"the same --delta options")
        for pos, cache_state in state.items():
            self._delta_coder(int(pos)).cache.load_state_dict(cache_state)

    def take_delta_stats(self) -> torch.Tensor:
        """float64 ``(3,)``: this side's :attr:`DeltaCoder.stats <dgpipe.compression.wrappers.delta.DeltaCoder>`
        summed over tuple positions (zeros on the receiving side), then reset."""
        total = torch.zeros(3, dtype=torch.float64)
        for coder in self._deltas.values():
            total += coder.take_stats()
        return total

    def delta_digests(self) -> dict[int, str]:
        """SHA-256 of this side's cache per tuple position (equal on the two sides of the boundary)."""
        return {pos: coder.cache.digest() for pos, coder in sorted(self._deltas.items())}
