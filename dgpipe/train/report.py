"""What rank 0 writes and prints of a run: the progress it counts, each boundary's log entry, the first lines, each
epoch's record and the summary (:mod:`.runlog` holds the record formats).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import runlog
from .config import RunConfig
from .job import Job

__all__ = ["VALUE_BYTES", "EVAL_DIRECTIONS", "Progress", "boundary_entries", "announce", "report_epoch",
           "write_summary"]

#: Bytes of one floating value crossing a boundary uncompressed, per ``--precision`` (epoch records' ``value_bytes``).
VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Meter directions that are evaluation traffic (not counted in the summary's bytes).
EVAL_DIRECTIONS = ("eval",)


#: Meter fields logged with each boundary entry besides :data:`~dgpipe.train.runlog.BOUNDARY_FIELDS`:
#: framing bytes and the seconds spent in the codec (for DDP: in the communication hook),
#: each summed over the ranks.
_METER_EXTRAS = ("frame_bytes", "encode_seconds", "decode_seconds")


def boundary_entries(meter, delta: dict[str, dict] | None = None, job: Job | None = None) -> list[dict[str, Any]]:
    """Boundary entries of the log; ``delta``: the delta-coded boundaries' statistics by name
    (:meth:`PipelineEngine.delta_stats <dgpipe.train.engine.PipelineEngine.delta_stats>`): their
    training forward entries get ``"delta": true`` and those fields, every other entry ``false``.
    ``job``: its :meth:`~dgpipe.train.job.Job.raw_scale` scales each boundary's raw bytes (a bottleneck's
    boundary counts the model's width)."""
    delta = delta or {}
    out = []
    for r in meter.records():
        raw = r["raw_bytes"] * (job.raw_scale(r["name"]) if job is not None else 1)
        entry = runlog.boundary_record(r["name"], r["direction"], round(raw), r["wire_bytes"], r["recv_bytes"],
                                       r["recv_seconds"]) | {k: r[k] for k in _METER_EXTRAS}
        coded = r["direction"] == "forward" and r["name"] in delta
        out.append(entry | {"delta": coded} | (delta[r["name"]] if coded else {}))
    return out


@dataclasses.dataclass
class Progress:
    """Where a run stands -- saved in every checkpoint, so that a resumed run continues its sums.

    Attributes:
        epoch: the epoch being trained (0-based); ``epoch_step``: its steps done.
        step: optimizer steps done in the run.
        loss_sum: sum of this epoch's step losses; ``recent``: the losses since the last ``eval`` record.
        train_seconds, samples: training time (s) and examples of the run so far.
        raw_bytes, wire_bytes: the run's training traffic over all boundaries in finished epochs.
    """

    epoch: int = 0
    epoch_step: int = 0
    step: int = 0
    loss_sum: float = 0.0
    recent: list[float] = dataclasses.field(default_factory=list)
    train_seconds: float = 0.0
    samples: float = 0.0
    raw_bytes: int = 0
    wire_bytes: int = 0


def announce(log: runlog.JsonlLog, config: RunConfig, engine, progress: Progress, steps_per_epoch: int, *,
             resumed: bool, restart: int, repeated: int | None) -> None:
    """Rank 0's first lines: a resumed run's ``resume`` record and line (``restart``: torchrun's restart count;
    ``repeated``: the steps the log holds past the checkpoint, None if unknown), then what runs (the engine, the
    codec, the steps per epoch)."""
    if resumed:
        log.write({"event": "resume", "step": progress.step, "epoch": progress.epoch + 1, "restart": restart,
                   "repeated_steps": repeated})
        print(f"resumed at step {progress.step} (epoch {progress.epoch + 1}, restart {restart}"
              + (f", {repeated} steps repeated" if repeated is not None else "") + ")", flush=True)
    print(f"dgpipe {config.pipeline.mode}: {engine.describe()}; "
          + (f"codec {config.codec.compression}; " if config.codec.compression else "")
          + f"{steps_per_epoch} steps/epoch of {config.data.batch_size} examples", flush=True)


def report_epoch(log: runlog.JsonlLog, job: Job, config: RunConfig, progress: Progress, *, epoch: int, steps: int,
                 train_loss: float, rate: float, lr, metrics: dict[str, float], merged, eval_traffic,
                 delta_stats: dict[str, dict], profile) -> None:
    """Rank 0's record and lines of epoch ``epoch`` (1-based): ``steps`` optimizer steps, ``rate`` samples/s,
    ``lr`` the scheduler's last learning rate, ``merged`` and ``eval_traffic`` the gathered training and evaluation
    meters, ``delta_stats`` the delta-coded boundaries' statistics, ``profile`` the step profile or None. The
    training traffic (evaluations inside the epoch left out) is added to ``progress``'s byte counts."""
    boundaries = [b for b in boundary_entries(merged, delta_stats, job) if b["direction"] not in EVAL_DIRECTIONS]
    progress.raw_bytes += sum(b["raw_bytes"] for b in boundaries)
    progress.wire_bytes += sum(b["wire_bytes"] for b in boundaries)
    boundaries += [b for b in boundary_entries(eval_traffic, job=job) if b["direction"] in EVAL_DIRECTIONS]
    record = runlog.epoch_record(epoch, train_loss, metrics, rate, boundaries, steps=steps, step=progress.step,
                                 value_bytes=VALUE_BYTES[config.train.precision], lr=lr,
                                 **({"profile": profile.to_json()} if profile is not None else {}))
    log.write(record)
    print(runlog.format_epoch(record, job.metric), flush=True)
    for name, st in delta_stats.items():
        if st["delta_change_rel"] is not None:
            print(f"  delta {name}: coded change {st['delta_change_rel']:.4g} of the activation energy, "
                  f"reconstruction error {st['delta_error_rel']:.4g}", flush=True)
    if config.log.bandwidth:
        print(runlog.format_boundaries(boundaries), flush=True)


def write_summary(log: runlog.JsonlLog, job: Job, config: RunConfig, progress: Progress, metrics: dict[str, float],
                   top: tuple[int, int] | None, peaks: list, wall_seconds: float) -> None:
    """Rank 0's summary record and lines (the last evaluation's metrics, throughput, bytes, memory), then the log
    closed."""
    summary = runlog.summary_record(
        job.metric, metrics.get(job.metric, float("nan")),
        progress.samples / progress.train_seconds if progress.train_seconds else 0.0,
        progress.raw_bytes, progress.wire_bytes, wall_seconds, config.to_json(), metrics=metrics,
        steps=progress.step, train_seconds=progress.train_seconds, top_class=list(top) if top else None,
        memory=peaks,
    )
    log.write(summary)
    log.close()
    print(runlog.format_summary(summary), flush=True)
