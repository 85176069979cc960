"""Compression sweep: a main job run for a fixed number of steps under each boundary codec,
and one table of the measured traffic.

Used by ``bandwidth/test_cv_bandwidth.py`` and ``bandwidth/test_nlp_bandwidth.py``. A script passes its main job's
parser and :class:`~dgpipe.train.job.Job` class to :func:`main`, so every model, data,
chunk, partition and process flag means exactly what it means in the main job. For each
setting of ``--settings`` (labels of :data:`~dgpipe.train.codecs.SETTINGS`, default
:data:`SWEEP_SETTINGS`) the parsed arguments get that setting's boundary codecs and the job's own rank body,
:func:`dgpipe.train.loop.worker`, runs
``--max-steps`` optimizer steps; all settings run one after another in the same ranks
(spawned on this machine, or the processes ``torchrun`` / ``bandwidth/slow_link.py``
started). Each run writes its JSON-lines log (:mod:`dgpipe.train.runlog`) to a temporary
folder (``--keep-logs DIR`` keeps them); rank 0 then reads the logs and prints one table
(:func:`table_rows`, :func:`format_table`): per setting, boundary and training direction
(with ``--bandwidth``; without it, per setting over all boundaries and directions) the
raw bytes, wire bytes, wire/raw, seconds blocked in receive, ``recv_bytes /
recv_seconds`` (bytes/s; waiting for the peer's compute included, so a lower bound on
the link) and the run's training samples/s. Evaluation traffic is left out.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from dgpipe.pipeline import SpawnError

from .codecs import SETTINGS
from .config import RunConfig
from .job import Job
from .loop import launch, parse_config
from .report import EVAL_DIRECTIONS
from .runlog import read_records

__all__ = ["SWEEP_SETTINGS", "add_sweep_flags", "prepare_runs", "table_rows", "format_table", "main"]

#: The settings a sweep runs by default: uncompressed, sort quantization at 16/12/8/4 bits per
#: value, uniform quantization at 8 and 4 bits.
SWEEP_SETTINGS = ("none", "sortquant16", "sortquant12", "sortquant8", "sortquant4", "quant8", "quant4")

#: Flags whose work the sweep does itself (it sets the codecs and writes one log per setting).
_OWN_FLAGS = {
    "sortquant": "--sortquant", "quant": "--quant", "split": "--split", "codec": "--codec",
    "codec_opt": "--codec-opt", "grad_quant": "--grad-quant", "grad_split": "--grad-split",
    "grad_codec": "--grad-codec", "grad_codec_opt": "--grad-codec-opt", "log": "--log", "save": "--save",
    "save_every": "--save-every", "resume": "--resume",
}


def add_sweep_flags(parser: argparse.ArgumentParser, steps: int = 10) -> argparse.ArgumentParser:
    """Add the sweep's own flags to a main job's parser and set its defaults for a short run.

    Adds ``--settings LABEL,...`` (default: :data:`SWEEP_SETTINGS`) and ``--keep-logs DIR``;
    ``--max-steps`` defaults to ``steps``. ``--bandwidth`` selects the per-boundary table.
    Returns ``parser``.
    """
    g = parser.add_argument_group("compression sweep")
    g.add_argument("--settings", default=",".join(SWEEP_SETTINGS), metavar="LABEL,...",
                   help=f"settings to run, in order; choose from {', '.join(SETTINGS)}")
    g.add_argument("--keep-logs", metavar="DIR",
                   help="write each setting's JSON-lines log (<label>.jsonl) and output (<label>.out) here "
                        "(default: a temporary folder)")
    parser.set_defaults(max_steps=steps)
    return parser


def prepare_runs(parser: argparse.ArgumentParser, job_cls: type[Job], argv: Sequence[str] | None,
                 default_log_dir: str | os.PathLike) -> tuple[RunConfig, list[tuple[str, RunConfig]]]:
    """Parse and check the arguments, then derive one config per setting, before any process starts.

    Defaults for a short measuring run: ``--train-subset`` = ``--batch-size`` x
    ``--max-steps`` (the examples the steps use), ``--eval-subset`` = ``--batch-size``.

    Args:
        parser: the main job's parser with :func:`add_sweep_flags` applied.
        job_cls: the main job (its ``check`` runs once).
        argv: command line (default ``sys.argv[1:]``).
        default_log_dir: folder of the per-setting logs unless ``--keep-logs DIR`` is given
            (then ``DIR``, created).

    Returns:
        ``(base config, [(label, config of that setting), ...])``; each setting's
        ``log.log`` is ``<log_dir>/<label>.jsonl``.

    Raises:
        SystemExit: through ``parser.error``, for any bad flag (compression or log flags,
        which the sweep sets itself; ``--mode dataparallel``; unknown settings; anything
        the main job rejects).
    """
    base = parser.parse_args(argv)
    given = [flag for key, flag in _OWN_FLAGS.items() if getattr(base, key, None) not in (None, False, [])]
    if given:
        parser.error(f"{', '.join(given)}: the sweep sets the boundary codecs itself (--settings) and writes one "
                     "log per setting (--keep-logs DIR); drop these flags")
    if base.mode != "pipeline":
        parser.error("the sweep measures pipeline boundaries; drop --mode dataparallel")
    labels = [s.strip() for s in base.settings.split(",") if s.strip()]
    unknown = [s for s in labels if s not in SETTINGS]
    if not labels or unknown or len(set(labels)) != len(labels):
        parser.error(f"--settings {base.settings!r}: give distinct labels out of {', '.join(SETTINGS)}")
    log_dir = Path(default_log_dir if base.keep_logs is None else base.keep_logs)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--keep-logs {base.keep_logs}: {e}")
    parser.set_defaults(train_subset=base.batch_size * base.max_steps, eval_subset=base.batch_size)
    config = parse_config(job_cls, parser, argv, own=("settings", "keep_logs"))  # the main job's validation
    # the sweep prints its own table: no per-run bandwidth table or progress bars
    runs = [(label, config.replace(codec={"compression": SETTINGS[label]},
                                   log={"log": str(log_dir / f"{label}.jsonl"), "bandwidth": False, "progress": False}))
            for label in labels]
    return config, runs


def table_rows(records: Mapping[str, list[dict[str, Any]]], per_boundary: bool = True) -> list[dict[str, Any]]:
    """Aggregate the run logs of a sweep into table rows.

    Args:
        records: setting label -> the records of its log (:func:`~dgpipe.train.runlog.read_records`),
            in the order the rows should have.
        per_boundary: one row per (boundary, training direction), sorted by boundary
            then direction; else one row per setting (boundary ``"all"``, direction
            ``"all"``).

    Returns:
        dicts with ``setting``, ``boundary``, ``direction``, ``raw_bytes``, ``wire_bytes``,
        ``recv_bytes`` (ints: sums over the log's epoch records), ``recv_seconds``,
        ``ratio`` (wire/raw; ``None`` without raw bytes), ``recv_bytes_per_s``
        (``None`` without receive time) and ``samples_per_s`` (the summary's).
        Evaluation traffic (:data:`~dgpipe.train.report.EVAL_DIRECTIONS`) is left out.

    Raises:
        ValueError: a log without a summary record (the run did not finish).
    """
    rows = []
    for label, recs in records.items():
        summary = next((r for r in reversed(recs) if r.get("event") == "summary"), None)
        if summary is None:
            raise ValueError(f"setting {label}: its log has no summary record (the run did not finish)")
        sums: dict[tuple[str, str], dict[str, float]] = {}
        for rec in recs:
            if rec.get("event") != "epoch":
                continue
            for b in rec["boundaries"]:
                if b["direction"] in EVAL_DIRECTIONS:
                    continue
                key = (b["name"], b["direction"]) if per_boundary else ("all", "all")
                s = sums.setdefault(key, dict.fromkeys(("raw_bytes", "wire_bytes", "recv_bytes", "recv_seconds"), 0))
                for field in s:
                    s[field] += b[field]
        for (name, direction), s in sorted(sums.items()):
            rows.append({
                "setting": label, "boundary": name, "direction": direction,
                "raw_bytes": int(s["raw_bytes"]), "wire_bytes": int(s["wire_bytes"]),
                "recv_bytes": int(s["recv_bytes"]), "recv_seconds": float(s["recv_seconds"]),
                "ratio": s["wire_bytes"] / s["raw_bytes"] if s["raw_bytes"] else None,
                "recv_bytes_per_s": s["recv_bytes"] / s["recv_seconds"] if s["recv_seconds"] > 0 else None,
                "samples_per_s": float(summary["samples_per_s"]),
            })
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width table of :func:`table_rows` output: bytes exact, ``recv MB/s`` in 10^6
    bytes/s, ``-`` where a value is missing."""
    head = ("setting", "boundary", "direction", "raw bytes", "wire bytes", "wire/raw", "recv s", "recv MB/s",
            "samples/s")
    table = [head]
    for r in rows:
        table.append((r["setting"], r["boundary"], r["direction"], str(r["raw_bytes"]), str(r["wire_bytes"]),
                      "-" if r["ratio"] is None else f"{r['ratio']:.4f}", f"{r['recv_seconds']:.3f}",
                      "-" if r["recv_bytes_per_s"] is None else f"{r['recv_bytes_per_s'] / 1e6:.3f}",
                      f"{r['samples_per_s']:.1f}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))).rstrip() for row in table)


def main(job_cls: type[Job], parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Run the sweep of ``job_cls`` (see the module docstring); returns the exit status.

    ``parser`` is the main job's parser; :func:`add_sweep_flags` is applied here. Under
    torchrun-style environment variables every rank calls this and rank 0 prints the
    table; otherwise ``--world-size`` local processes are spawned and this process prints it.
    """
    add_sweep_flags(parser)
    with tempfile.TemporaryDirectory(prefix="dgpipe-sweep-") as tmp:
        base, runs = prepare_runs(parser, job_cls, argv, tmp)
        try:
            env = launch(job_cls, runs, capture=True)
        except SpawnError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
        if env.rank != 0:
            return 0
        records = {label: read_records(config.log.log) for label, config in runs}
    print(f"{job_cls.__name__}: {base.train.max_steps} steps per setting, batch {base.data.batch_size}, "
          f"{base.pipeline.chunk} micro-batches, {base.pipeline.partition} partition; training traffic "
          + ("per boundary and direction" if base.log.bandwidth else "over all boundaries (--bandwidth: per boundary)"))
    print(format_table(table_rows(records, per_boundary=base.log.bandwidth)), flush=True)
    return 0

