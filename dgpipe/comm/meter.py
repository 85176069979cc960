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

and reports ``recv_bytes_per_s = recv_bytes / recv_seconds`` -- the "bandwidth" of
the original dgpipe; since receive time includes waiting for the sender to compute,
it is a lower bound on the link's bandwidth -- and ``ratio = wire_bytes / raw_bytes``,
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

import torch
import torch.distributed as dist

from .transport import wire_device

__all__ = ["BandwidthMeter", "FIELDS"]

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


class BandwidthMeter:
    """Sums of bytes and seconds per (boundary name, direction); see the module docstring."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], dict[str, float]] = {}

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
        encode_seconds: float = 0.0,
    ) -> None:
        """Record one message sent across boundary ``name`` in ``direction``.

        Args:
            raw_bytes: uncompressed bytes of the tensors in the message.
            wire_bytes: sum of ``Payload.nbytes`` of their payloads.
            frame_bytes: bytes of framing (preambles, message meta) around them.
            encode_seconds: seconds spent encoding.
        """
        e = self._entry(name, direction)
        e["raw_bytes"] += raw_bytes
        e["wire_bytes"] += wire_bytes
        e["frame_bytes"] += frame_bytes
        e["encode_seconds"] += encode_seconds
        e["count"] += 1

    def record_recv(
        self,
        name: str,
        direction: str,
        *,
        recv_bytes: int,
        recv_seconds: float,
        decode_seconds: float = 0.0,
    ) -> None:
        """Record one message received across boundary ``name`` in ``direction``.

        Args:
            recv_bytes: sum of ``Payload.nbytes`` of the payloads received.
            recv_seconds: seconds blocked receiving them.
            decode_seconds: seconds spent decoding.
        """
        e = self._entry(name, direction)
        e["recv_bytes"] += recv_bytes
        e["recv_seconds"] += recv_seconds
        e["decode_seconds"] += decode_seconds
        e["recv_count"] += 1

    def records(self) -> list[dict]:
        """One dict per (name, direction), sorted by name then direction.

        Keys: ``name``, ``direction``, every field in :data:`FIELDS` (bytes and counts
        as ``int``, seconds as ``float``), ``recv_bytes_per_s`` and ``ratio``.
        """
        out = []
        for (name, direction), e in sorted(self._data.items()):
            rec = {"name": name, "direction": direction}
            rec.update({k: (v if k.endswith("seconds") else int(v)) for k, v in e.items()})
            out.append(_derived(rec))
        return out

    def totals(self, direction: str | None = None) -> dict:
        """Sums over all boundaries (of one ``direction`` if given), with derived fields."""
        tot = dict.fromkeys(FIELDS, 0.0)
        for (_, d), e in self._data.items():
            if direction is None or d == direction:
                for k in FIELDS:
                    tot[k] += e[k]
        return _derived({k: (v if k.endswith("seconds") else int(v)) for k, v in tot.items()})

    def reset(self) -> None:
        """Forget everything recorded (e.g. at the start of an epoch)."""
        self._data.clear()

    def state_dict(self) -> dict[str, dict[str, float]]:
        """The sums recorded so far, ``{"<name><US><direction>": {field: value}}`` (for a checkpoint)."""
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

    def gather(self, dst: int = 0, group: dist.ProcessGroup | None = None) -> "BandwidthMeter | None":
        """Merge every rank's records on global rank ``dst``; a collective (call on all ranks).

        Names travel as UTF-8 bytes in ``uint8`` tensors and values as ``float64``
        tensors (exact for byte counts below 2**53); nothing is pickled.

        Returns:
            On ``dst``: a new meter holding the sums over all ranks; elsewhere ``None``.
        """
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
