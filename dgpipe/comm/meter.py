"""``BandwidthMeter``: bytes and seconds per stage boundary and direction.

For every (boundary name, direction) pair -- direction ``"forward"`` (activations),
``"backward"`` (gradients) or ``"eval"`` (activations of evaluation passes) -- the
meter sums:

==================  =======================================================  ========
field               meaning                                                  recorded
==================  =======================================================  ========
``raw_bytes``       bytes the tensors take uncompressed (numel * itemsize)   sender
``wire_bytes``      bytes of the payloads sent (``Payload.nbytes``)          sender
``frame_bytes``     framing around the payloads (preambles, message meta)    sender
``encode_seconds``  seconds spent in ``codec.encode``                        sender
``count``           messages sent                                            sender
``recv_bytes``      bytes of the payloads received                           receiver
``recv_seconds``    seconds blocked in receive (waiting *and* transfer)      receiver
``decode_seconds``  seconds spent in ``codec.decode``                        receiver
``recv_count``      messages received                                        receiver
==================  =======================================================  ========

On a CUDA device the codec seconds are GPU time between two CUDA events around the codec's
work (:func:`timer`, :class:`DeviceSpan`), read when the meter is read, so that timing a
message never makes the host wait for the GPU; on CPU they are ``time.perf_counter`` spans.

The meter reports ``recv_bytes_per_s = recv_bytes / recv_seconds``; since receive time includes waiting
for the sender to compute, it is a lower bound on the link's bandwidth -- and ``ratio = wire_bytes / raw_bytes``,
the achieved compression ratio (1.0 uncompressed, about 0.25 at 8 bits of float32).

Each rank records what it sends and receives; :meth:`BandwidthMeter.gather` merges
all ranks' records on one rank with tensor collectives (names travel as UTF-8 bytes
in a ``uint8`` tensor; nothing is pickled).

Usage::

    meter = BandwidthMeter()
    meter.record_send("stage0->stage1", "forward", raw_bytes=4096, wire_bytes=1100)
    meter.record_recv("stage0->stage1", "forward", recv_bytes=1100, recv_seconds=0.002)
    merged = meter.gather(dst=0)        # BandwidthMeter on rank 0, None elsewhere
    for rec in merged.records(): print(rec)
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from .transport import wire_device

__all__ = ["BandwidthMeter", "DeviceSpan", "FIELDS", "timer"]

FIELDS = (
    "raw_bytes",
    "wire_bytes",
    "frame_bytes",
    "encode_seconds",
    "count",
    "recv_bytes",
    "recv_seconds",
    "decode_seconds",
    "recv_count",
)
_KEY_SEP, _RECORD_SEP = "\x1f", "\x1e"


def _derived(rec: dict) -> dict:
    """Add ``recv_bytes_per_s`` (bytes/s, 0 when nothing was received) and ``ratio``."""
    rec["recv_bytes_per_s"] = rec["recv_bytes"] / rec["recv_seconds"] if rec["recv_seconds"] > 0 else 0.0
    rec["ratio"] = rec["wire_bytes"] / rec["raw_bytes"] if rec["raw_bytes"] > 0 else 0.0
    return rec


class DeviceSpan:
    """The GPU time, in seconds, of the work queued on ``device``'s current stream between this object's
    creation and :meth:`stop` -- two CUDA events (``torch.cuda.Event(enable_timing=True)``): recording them
    does not wait for the GPU; :meth:`seconds` does, for the end event alone."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.current_stream(device)
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._start.record(self._stream)

    def stop(self) -> "DeviceSpan":
        """Mark the end of the span (after the work queued so far); returns ``self``."""
        self._end.record(self._stream)
        return self

    def done(self) -> bool:
        """Whether the GPU has passed the end of the span (no wait)."""
        return self._end.query()

    def seconds(self) -> float:
        """The span's GPU time in seconds; waits for its end."""
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


def timer(device: torch.device) -> Callable[[], "float | DeviceSpan"]:
    """Start timing work on ``device``; the function returned stops it and gives its seconds: a float on CPU
    (``time.perf_counter``), a :class:`DeviceSpan` on a CUDA device (which :class:`BandwidthMeter` reads
    when it is read)."""
    if device.type == "cuda":
        return DeviceSpan(device).stop
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


_SETTLE_AT = 64
"""Spans a meter keeps unread before it reads those the GPU has finished."""


class BandwidthMeter:
    """Sums of bytes and seconds per (boundary name, direction); see the module docstring."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], dict[str, float]] = {}
        self._spans: list[tuple[dict[str, float], str, DeviceSpan]] = []

    def _add_seconds(self, e: dict[str, float], field: str, seconds: "float | DeviceSpan") -> None:
        if not isinstance(seconds, DeviceSpan):
            e[field] += seconds
            return
        self._spans.append((e, field, seconds))
        if len(self._spans) >= _SETTLE_AT:
            self._settle(finished_only=True)

    def _settle(self, finished_only: bool = False) -> None:
        """Add the GPU spans recorded so far to their sums (with ``finished_only``, those the GPU has passed)."""
        keep = []
        for e, field, span in self._spans:
            if finished_only and not span.done():
                keep.append((e, field, span))
            else:
                e[field] += span.seconds()
        self._spans = keep

    def _entry(self, name: str, direction: str) -> dict[str, float]:
        if _KEY_SEP in name or _RECORD_SEP in name or _KEY_SEP in direction or _RECORD_SEP in direction:
            raise ValueError(f"boundary name/direction must not contain control characters: {name!r}, {direction!r}")
        return self._data.setdefault((name, direction), dict.fromkeys(FIELDS, 0.0))

    def record_send(
        self,
        name: str,
        direction: str,
        *,
        raw_bytes: int,
        wire_bytes: int,
        frame_bytes: int = 0,
        encode_seconds: "float | DeviceSpan" = 0.0,
    ) -> None:
        """Record one message sent across boundary ``name`` in ``direction``.

        Args:
            raw_bytes: uncompressed bytes of the tensors in the message.
            wire_bytes: sum of ``Payload.nbytes`` of their payloads.
            frame_bytes: bytes of framing (preambles, message meta) around them.
            encode_seconds: seconds spent encoding (a :class:`DeviceSpan`: read later).
        """
        e = self._entry(name, direction)
        e["raw_bytes"] += raw_bytes
        e["wire_bytes"] += wire_bytes
        e["frame_bytes"] += frame_bytes
        self._add_seconds(e, "encode_seconds", encode_seconds)
        e["count"] += 1

    def record_recv(
        self,
        name: str,
        direction: str,
        *,
        recv_bytes: int,
        recv_seconds: float,
        decode_seconds: "float | DeviceSpan" = 0.0,
    ) -> None:
        """Record one message received across boundary ``name`` in ``direction``.

        Args:
            recv_bytes: sum of ``Payload.nbytes`` of the payloads received.
            recv_seconds: seconds blocked receiving them.
            decode_seconds: seconds spent decoding (a :class:`DeviceSpan`: read later).
        """
        e = self._entry(name, direction)
        e["recv_bytes"] += recv_bytes
        e["recv_seconds"] += recv_seconds
        self._add_seconds(e, "decode_seconds", decode_seconds)
        e["recv_count"] += 1

    def records(self) -> list[dict]:
        """One dict per (name, direction), sorted by name then direction.

        Keys: ``name``, ``direction``, every field in :data:`FIELDS` (bytes and counts
        as ``int``, seconds as ``float``), ``recv_bytes_per_s`` and ``ratio``.
        """
        self._settle()
        out = []
        for (name, direction), e in sorted(self._data.items()):
            rec = {"name": name, "direction": direction}
            rec.update({k: (v if k.endswith("seconds") else int(v)) for k, v in e.items()})
            out.append(_derived(rec))
        return out

    def totals(self, direction: str | None = None) -> dict:
        """Sums over all boundaries (of one ``direction`` if given), with derived fields."""
        self._settle()
        tot = dict.fromkeys(FIELDS, 0.0)
        for (_, d), e in self._data.items():
            if direction is None or d == direction:
                for k in FIELDS:
                    tot[k] += e[k]
        return _derived({k: (v if k.endswith("seconds") else int(v)) for k, v in tot.items()})

    def reset(self) -> None:
        """Forget everything recorded (e.g. at the start of an epoch)."""
        self._data.clear()
        self._spans.clear()

    def state_dict(self) -> dict[str, dict[str, float]]:
        """The sums recorded so far, ``{"<name><US><direction>": {field: value}}`` (for a checkpoint)."""
        self._settle()
        return {n + _KEY_SEP + d: dict(e) for (n, d), e in self._data.items()}

    def load_state_dict(self, state: dict[str, dict[str, float]]) -> None:
        """Replace the sums with :meth:`state_dict` output.

        Raises:
            ValueError: a key without the separator, or a field set other than :data:`FIELDS`.
        """
        data = {}
        for key, fields in state.items():
            name, sep, direction = key.partition(_KEY_SEP)
            if not sep or set(fields) != set(FIELDS):
                raise ValueError(f"meter state entry {key!r} is not a boundary record")
            data[(name, direction)] = {f: float(fields[f]) for f in FIELDS}
        self._data = data
        self._spans.clear()

    def gather(self, dst: int = 0, group: dist.ProcessGroup | None = None) -> "BandwidthMeter | None":
        """Merge every rank's records on global rank ``dst``; a collective (call on all ranks).

        Names travel as UTF-8 bytes in ``uint8`` tensors and values as ``float64``
        tensors (exact for byte counts below 2**53); nothing is pickled.

        Returns:
            On ``dst``: a new meter holding the sums over all ranks; elsewhere ``None``.
        """
        self._settle()
        dev = wire_device(group)
        world = dist.get_world_size(group)
        keys = sorted(self._data)
        blob = torch.tensor(
            list(_RECORD_SEP.join(n + _KEY_SEP + d for n, d in keys).encode("utf-8")), dtype=torch.uint8
        )
        values = torch.tensor([[self._data[k][f] for f in FIELDS] for k in keys], dtype=torch.float64)
        values = values.reshape(len(keys), len(FIELDS))
        sizes = torch.tensor([blob.numel(), len(keys)], dtype=torch.int64, device=dev)
        all_sizes = [torch.empty_like(sizes) for _ in range(world)]
        dist.all_gather(all_sizes, sizes, group=group)
        all_sizes = [s.tolist() for s in all_sizes]
        max_blob = max(s[0] for s in all_sizes)
        max_rows = max(s[1] for s in all_sizes)
        blob_pad = torch.zeros(max_blob, dtype=torch.uint8, device=dev)
        blob_pad[: blob.numel()] = blob.to(dev)
        values_pad = torch.zeros(max_rows, len(FIELDS), dtype=torch.float64, device=dev)
        values_pad[: len(keys)] = values.to(dev)
        me = dist.get_rank()
        blobs = [torch.empty_like(blob_pad) for _ in range(world)] if me == dst else None
        vals = [torch.empty_like(values_pad) for _ in range(world)] if me == dst else None
        dist.gather(blob_pad, blobs, dst=dst, group=group)
        dist.gather(values_pad, vals, dst=dst, group=group)
        if me != dst:
            return None
        merged = BandwidthMeter()
        for (n_blob, n_rows), b, v in zip(all_sizes, blobs, vals):
            text = bytes(b[:n_blob].cpu().tolist()).decode("utf-8")
            names = [r.split(_KEY_SEP) for r in text.split(_RECORD_SEP)] if n_rows else []
            if len(names) != n_rows or any(len(p) != 2 for p in names):
                raise ValueError(f"corrupt meter records: {n_rows} rows but names {names!r}")
            for (name, direction), row in zip(names, v[:n_rows].cpu().tolist()):
                e = merged._entry(name, direction)
                for k, x in zip(FIELDS, row):
                    e[k] += x
        return merged
