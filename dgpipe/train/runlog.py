"""Run logs: JSON-lines records (one per epoch, then a summary) and their readable form.

Record schema (other tools, e.g. ``benchmarks/plot_ablation.py``, read these fields)::

    {"event": "epoch", "epoch": 1, "train_loss": 1.93, "val_acc": 0.41,   # or the task's metric
     "samples_per_s": 210.5,
     "boundaries": [{"name": "0->1", "direction": "forward", "raw_bytes": 1048576,
                     "wire_bytes": 263168, "recv_bytes": 263168, "recv_seconds": 0.21,
                     "recv_bytes_per_s": 1253180.9, "frame_bytes": 640,
                     "encode_seconds": 0.05, "decode_seconds": 0.04}, ...]}
    {"event": "summary", "metric": "val_acc", "value": 0.52, "samples_per_s": 208.1,
     "raw_bytes": 5242880, "wire_bytes": 1315840, "wall_seconds": 61.3, "args": {...},
     "metrics": {...}, "steps": 40, "train_seconds": 25.2, "top_class": [130, 512]}

An epoch record of dgpipe's own pipeline also holds ``"profile"``: the step's tasks and messages
(:class:`~dgpipe.pipeline.timeline.StepProfile`: ``ranks`` per segment, ``micro``, ``forward`` /
``backward`` seconds of one micro-batch's task per segment, ``forward_bytes`` / ``backward_bytes`` of one
message per boundary), which the link projection of ``--compare-to`` plays out.

``top_class``: how many of the last evaluation's examples the most predicted class got,
of how many (null for regression); equal numbers mean the model predicts one class.

Bytes are bytes; seconds are wall-clock seconds; ``raw_bytes`` is what the tensors
would take uncompressed, ``wire_bytes`` what was sent (headers included). The main
jobs sum each boundary entry over the ranks and add ``frame_bytes`` (transport
framing) and ``encode_seconds``/``decode_seconds`` (time in the codec; for the
data-parallel baseline, the time in its DDP communication hook).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = [
    "BOUNDARY_FIELDS",
    "boundary_record",
    "epoch_record",
    "summary_record",
    "JsonlLog",
    "read_records",
    "read_summary",
    "direction_bits",
    "format_boundaries",
    "format_epoch",
    "format_summary",
    "one_class_warning",
]

#: Fields of one boundary entry, in order.
BOUNDARY_FIELDS = ("name", "direction", "raw_bytes", "wire_bytes", "recv_bytes", "recv_seconds", "recv_bytes_per_s")


def _rate(nbytes: float, seconds: float) -> float | None:
    """bytes/s, or None (JSON null) when no time was measured."""
    return nbytes / seconds if seconds > 0 else None


def boundary_record(name: str, direction: str, raw_bytes: int, wire_bytes: int, recv_bytes: int,
                    recv_seconds: float) -> dict[str, Any]:
    """One boundary entry: ``recv_bytes_per_s = recv_bytes / recv_seconds`` (None without time)."""
    return {
        "name": str(name),
        "direction": str(direction),
        "raw_bytes": int(raw_bytes),
        "wire_bytes": int(wire_bytes),
        "recv_bytes": int(recv_bytes),
        "recv_seconds": float(recv_seconds),
        "recv_bytes_per_s": _rate(recv_bytes, recv_seconds),
    }


def epoch_record(epoch: int, train_loss: float, metrics: Mapping[str, float], samples_per_s: float,
                 boundaries: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The record of one epoch.

    Args:
        epoch: 1-based epoch number.
        train_loss: mean training loss over the epoch's steps.
        metrics: validation metrics by name (e.g. ``{"val_acc": 0.41}``); each becomes a field.
        samples_per_s: training examples per second of training wall time.
        boundaries: entries made by :func:`boundary_record`.
        extra: more fields (e.g. ``steps``, ``lr``).
    """
    record: dict[str, Any] = {"event": "epoch", "epoch": int(epoch), "train_loss": float(train_loss)}
    record.update({k: float(v) for k, v in metrics.items()})
    record["samples_per_s"] = float(samples_per_s)
    record["boundaries"] = list(boundaries)
    record.update(extra)
    return record


def summary_record(metric: str, value: float, samples_per_s: float, raw_bytes: int, wire_bytes: int,
                   wall_seconds: float, args: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """The last record of a run.

    Args:
        metric: name of the main validation metric (e.g. ``"val_acc"``).
        value: its final value.
        samples_per_s: training examples per second over the whole run.
        raw_bytes, wire_bytes: totals over all boundaries, directions and epochs.
        wall_seconds: the run's wall time, setup included.
        args: the command-line arguments (JSON-serialisable values).
        extra: more fields (e.g. all final metrics).
    """
    record = {
        "event": "summary",
        "metric": metric,
        "value": float(value),
        "samples_per_s": float(samples_per_s),
        "raw_bytes": int(raw_bytes),
        "wire_bytes": int(wire_bytes),
        "wall_seconds": float(wall_seconds),
        "args": dict(args),
    }
    record.update(extra)
    return record


def _json_safe(value: Any) -> Any:
    """Floats that JSON cannot hold (inf, NaN) become None; containers recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class JsonlLog:
    """Append-only JSON-lines file; ``path=None`` makes a log that writes nothing.

    Each :meth:`write` appends one line and flushes, so a crashed run keeps the epochs
    it finished.

    Args:
        path: the log file; parent folders are created.
        append: keep existing records (resume) instead of starting a new file.
    """

    def __init__(self, path: str | os.PathLike | None, append: bool = False) -> None:
        self.path = None if path is None else Path(path)
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one JSON line (inf/NaN written as null)."""
        if self._file is not None:
            self._file.write(json.dumps(_json_safe(dict(record)), allow_nan=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "JsonlLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a JSON-lines log, in order (blank lines skipped).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object (names file and line number).
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: a record must be a JSON object")
            records.append(record)
    return records


def read_summary(path: str | os.PathLike) -> dict[str, Any]:
    """The last ``summary`` record of a log.

    Raises:
        ValueError: the log has no summary record (the run did not finish).
    """
    summaries = [r for r in read_records(path) if r.get("event") == "summary"]
    if not summaries:
        raise ValueError(f"{path}: no summary record (did the run finish?)")
    return summaries[-1]


def direction_bits(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Measured bits per value of each training direction of a pipeline run (all epochs, all boundaries).

    ``8 * wire_bytes / values``, where ``values`` counts the floating values the
    boundaries carry: raw backward bytes / ``value_bytes`` of each epoch record (4: float32, 2 under
    ``--precision bf16``/``fp16``; the gradients mirror the floating forward tensors, so the forward
    direction's lossless extras -- an attention mask, headers -- count against it: all-in).

    Args:
        records: the records of a run log (:func:`read_records`).

    Returns:
        ``{"forward": bits, "backward": bits}``; NaN for both when no backward bytes were
        logged (evaluation-only or data-parallel runs).
    """
    wire = {"forward": 0, "backward": 0}
    values = 0.0
    for rec in records:
        for b in rec.get("boundaries", []) if rec.get("event") == "epoch" else []:
            if b["direction"] in wire:
                wire[b["direction"]] += b["wire_bytes"]
                values += b["raw_bytes"] / rec.get("value_bytes", 4) if b["direction"] == "backward" else 0
    return {d: 8 * w / values if values else math.nan for d, w in wire.items()}


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ratio(wire: int, raw: int) -> str:
    return f"{wire / raw:.3f}" if raw else "-"


def format_boundaries(boundaries: Iterable[Mapping[str, Any]]) -> str:
    """A fixed-width table of boundary entries (one row each), for ``--bandwidth``."""
    rows = [("boundary", "direction", "raw", "wire", "wire/raw", "recv", "recv s", "recv MB/s")]
    for b in boundaries:
        rate = b["recv_bytes_per_s"]
        rows.append((b["name"], b["direction"], _human_bytes(b["raw_bytes"]), _human_bytes(b["wire_bytes"]),
                     _ratio(b["wire_bytes"], b["raw_bytes"]), _human_bytes(b["recv_bytes"]),
                     f"{b['recv_seconds']:.3f}", "-" if rate is None else f"{rate / 1e6:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) if i >= 2 else cell.ljust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))).rstrip() for row in rows)


def format_epoch(record: Mapping[str, Any], metric: str) -> str:
    """One line: epoch, train loss, the metric, samples/s."""
    value = record.get(metric)
    shown = "-" if value is None else f"{value:.4f}"
    return (f"epoch {record['epoch']}: train_loss {record['train_loss']:.4f}  {metric} {shown}  "
            f"{record['samples_per_s']:.1f} samples/s")


def format_summary(record: Mapping[str, Any]) -> str:
    """A few readable lines from a summary record."""
    raw, wire = record["raw_bytes"], record["wire_bytes"]
    ratio = f"{wire / raw:.4f} (x{raw / wire:.2f} smaller)" if raw and wire else "-"
    lines = [
        "== summary ==",
        f"{record['metric']}: {record['value']:.4f}",
        f"throughput: {record['samples_per_s']:.1f} samples/s",
        f"traffic: raw {_human_bytes(raw)}, wire {_human_bytes(wire)}, wire/raw {ratio}",
        f"wall time: {record['wall_seconds']:.1f} s",
    ]
    warning = one_class_warning(record)
    return "\n".join(lines + ([warning] if warning else []))


def one_class_warning(record: Mapping[str, Any]) -> str | None:
    """``"warning: predicted one class for 872/872 examples ..."`` when a summary's last
    evaluation put every example in one class (its ``top_class`` field), else None."""
    top = record.get("top_class")
    if not top or top[0] != top[1]:
        return None
    return (f"warning: predicted one class for {top[0]}/{top[1]} examples: the model has not learnt the task "
            "(the metric is the majority share or less); train longer, on more data, or with another --lr")
