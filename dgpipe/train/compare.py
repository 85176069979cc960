"""Side by side: one main-job command under several boundary settings (``--compare-to``).

The command's own setting trains first, then each named setting of ``--compare-to``
(:data:`~dgpipe.train.codecs.SETTINGS`) with every other flag unchanged -- same seed, so
the same initialisation, training subset and batch order -- one after another in the same
ranks (:func:`dgpipe.train.loop.run`). The launching process then reads the run logs and
prints one table (:func:`rows`, :func:`format_table`): per setting the task metric and its
difference to the uncompressed run, the measured bits per value of each direction
(:func:`~dgpipe.train.runlog.direction_bits`, all-in), the training wire bytes, the
measured training time and what each run's traffic would add on slower links.

The link columns are a projection, not a measurement. For a run of dgpipe's own pipeline, whose
log holds the tasks and messages of a step (an epoch record's ``profile``,
:class:`~dgpipe.pipeline.timeline.StepProfile`), it is ``training seconds + steps x
(simulate_step(link) - simulate_step(loopback))``: the time measured here plus what the link adds to
the timeline of a step -- each message held back by the latency, then its bytes at the rate, queued
on its link, while the ranks compute what they can (:func:`dgpipe.pipeline.timeline.simulate_step`).
For other runs (torch's schedules, DDP) it is ``training seconds + wire bytes x 8 / rate + steps x 2 x
boundaries x latency``: no overlap of transfer and compute, and the latency of the messages the
critical path of a GPipe or 1F1B step crosses on a linear partition. Either way a link's rate is its
line rate, of which TCP payload gets ``1 / TCP_FRAMING`` (:data:`TCP_FRAMING`: the headers of every
segment, about 4.6%). On one machine the link is
loopback, where compression cannot change samples/s; ``bandwidth/slow_link.py --rate 100mbit --
COMMAND`` runs the same command across a real shaped link (root), ``--link-delay MS`` adds latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgpipe.pipeline.timeline import StepProfile, simulate_step

from .codecs import SETTINGS, setting_label
from .config import RunConfig
from .runlog import direction_bits, read_records

__all__ = ["Link", "LINKS", "LM_LINKS", "TCP_FRAMING", "critical_messages", "project", "run_profile", "plan", "rows",
           "format_table"]

TCP_FRAMING = (1448 + 52 + 14) / 1448
"""Bytes an Ethernet link carries per byte of TCP payload: a 1,500-byte IP packet holds 1,448 bytes of payload
after 20 bytes of IP header and 32 of TCP header with timestamps (Linux's default), and the link adds the
14-byte Ethernet header, which ``tc`` counts against its rate (RFC 793, RFC 7323; IEEE 802.3)."""


@dataclass(frozen=True)
class Link:
    """A link of the projection columns.

    Attributes:
        label: the column's name, e.g. ``"200 Mbit/s + 50 ms"``.
        rate: bits per second.
        latency: one-way latency per message, seconds.
    """

    label: str
    rate: float
    latency: float = 0.0


#: The classification jobs' projection links (rate only).
LINKS = (Link("100 Mbit/s", 100e6), Link("10 Mbit/s", 10e6))
#: The language-model job's: ProtocolNanoGPT's operating point (200 Mbit/s, 50 ms per boundary) and a slow
#: wide-area link.
LM_LINKS = (Link("200 Mbit/s + 50 ms", 200e6, 0.05), Link("10 Mbit/s + 50 ms", 10e6, 0.05))


def critical_messages(boundaries: int) -> int:
    """Messages per training step on the critical path of a GPipe or 1F1B schedule over a linear partition:
    ``2 x boundaries`` (the first micro-batch's activations forward, the last one's gradients back)."""
    return 2 * boundaries


def project(train_seconds: float, wire_bytes: int, steps: int, boundaries: int, link: Link,
            profile: StepProfile | None = None) -> float:
    """Projected training seconds on ``link`` (module docstring).

    Args:
        train_seconds, wire_bytes, steps: the run's measured training seconds, training wire bytes (both
            directions, all boundaries) and optimizer steps.
        boundaries: stage boundaries (for the formula without a profile).
        link: the link's line rate (bits/s; TCP payload moves at ``rate / TCP_FRAMING``) and one-way latency (s).
        profile: the run's step profile (:func:`run_profile`); with it the link's cost is played out on the
            step's timeline, without it ``wire bytes x 8 / rate + steps x critical_messages(boundaries) x
            latency`` is added.
    """
    payload_rate = link.rate / TCP_FRAMING
    if profile is not None:
        added = simulate_step(profile, payload_rate, link.latency) - simulate_step(profile)
        return train_seconds + steps * added
    return train_seconds + 8 * wire_bytes / payload_rate + steps * critical_messages(boundaries) * link.latency


def run_profile(records: list[dict[str, Any]]) -> StepProfile | None:
    """The step profile of a run's last epoch record that has one (dgpipe's pipeline logs it), else None."""
    for r in reversed(records):
        if r.get("event") == "epoch" and "profile" in r:
            return StepProfile.from_json(r["profile"])
    return None


def stage_boundaries(mode: str, partition: str, stages: int | None) -> int:
    """Stage boundaries of a partition: 2 client/server, ``stages - 1`` linear, 0 for data parallelism."""
    if mode != "pipeline":
        return 0
    return 2 if partition == "client-server" else stages - 1


def _boundaries(config: RunConfig) -> int:
    p = config.pipeline
    return stage_boundaries(p.mode, p.partition, p.stages)


def plan(config: RunConfig, log_dir: str | Path) -> list[tuple[str, RunConfig]]:
    """The runs of one command: ``[(label, config)]`` -- the command's own setting, then each
    ``--compare-to`` setting (``config.codec.compare_to``, a tuple of labels).

    Logs: without ``--compare-to`` the command's ``--log`` (or none). With it every run
    needs one: the command's own run writes ``--log PATH`` and setting ``s`` writes PATH
    with ``.s`` before the suffix (``runs/x.jsonl`` -> ``runs/x.none.jsonl``); without
    ``--log``, ``<log_dir>/<label>.jsonl``.
    """
    codec, log = config.codec, config.log.log
    own = setting_label(codec.compression) if codec.compression is not None else config.pipeline.mode
    if not codec.compare_to:
        return [(own, config)]
    path = Path(log) if log else Path(log_dir) / f"{own}.jsonl"
    runs = [(own, config.replace(log={"log": str(path)}))]
    for label in codec.compare_to:
        other = path.with_name(f"{path.stem}.{label}{path.suffix}") if log else Path(log_dir) / f"{label}.jsonl"
        runs.append((label, config.replace(codec={"compression": SETTINGS[label]}, log={"log": str(other)})))
    return runs


def rows(runs: list[tuple[str, RunConfig]], links: tuple[Link, ...] = LINKS) -> list[dict[str, Any]]:
    """One dict per run, from its log, the ``none`` run first: ``setting``, ``metric`` (name), ``value``, ``delta``
    (value minus the ``none`` run's; None without one), ``metrics`` (every final metric),
    ``forward_bits``/``backward_bits`` (measured bits per value), ``wire_bytes`` (training, both
    directions), ``train_seconds``, ``steps``, ``boundaries``, ``projected`` (link label -> seconds of
    the whole run, :func:`project`), ``timeline`` (whether the projection played out the run's step profile)
    and ``top_class`` (``[count, n]`` or None).

    Raises:
        ValueError: a log without a summary record (the run did not finish).
    """
    out = []
    for label, config in runs:
        records = read_records(config.log.log)
        summary = next((r for r in reversed(records) if r.get("event") == "summary"), None)
        if summary is None:
            raise ValueError(f"{config.log.log}: no summary record (did the run finish?)")
        bits = direction_bits(records)
        seconds, steps, boundaries = summary["train_seconds"], summary.get("steps", 0), _boundaries(config)
        profile = run_profile(records)
        out.append({
            "setting": label, "metric": summary["metric"], "value": summary["value"],
            "metrics": summary.get("metrics", {}),
            "forward_bits": bits["forward"], "backward_bits": bits["backward"],
            "wire_bytes": summary["wire_bytes"], "train_seconds": seconds, "steps": steps, "boundaries": boundaries,
            "projected": {k.label: project(seconds, summary["wire_bytes"], steps, boundaries, k, profile)
                          for k in links},
            "timeline": profile is not None,
            "top_class": summary.get("top_class"),
            "peak_bytes": [m["peak_bytes"] for m in summary.get("memory", [])],
        })
    base = next((r["value"] for r in out if r["setting"] == "none"), None)
    for r in out:
        r["delta"] = None if base is None or r["setting"] == "none" else r["value"] - base
    return sorted(out, key=lambda r: r["setting"] != "none")


def _accuracy_noise(rows_: list[dict[str, Any]]) -> str | None:
    """A line on the noise of one accuracy: its binomial standard error on the evaluated examples."""
    r = next((r for r in rows_ if r["setting"] == "none"), rows_[0])
    if "acc" not in r["metric"] or not r["top_class"]:
        return None
    n = r["top_class"][1]
    se = 100 * math.sqrt(max(r["value"] * (1 - r["value"]), 0.0) / n)
    return (f"One run, one seed, {n} evaluation examples: an accuracy has a standard error of about {se:.1f} pt "
            f"here, so differences within ~{2 * se:.0f} pt are noise; the quality benchmark (docs/quality.md) "
            "pairs 3+ seeds on a larger held-out set.")


def _loss_cells(r: dict[str, Any], base: float | None) -> tuple[str, ...]:
    """A loss metric's cells: value, Δ in nats and percent of the ``none`` run's, perplexity."""
    delta = "--" if r["delta"] is None else f"{r['delta']:+.4f} ({100 * r['delta'] / base:+.2f}%)"
    ppl = r["metrics"].get(r["metric"].replace("_loss", "_ppl"), math.exp(r["value"]))
    return f"{r['value']:.4f}", delta, f"{ppl:.2f}"


def format_table(rows_: list[dict[str, Any]]) -> str:
    """The comparison as a fixed-width table with its notes (noise, what the projection is);
    the last column averages the measured bits per value of the two directions. A loss metric
    (a language model's ``val_loss``) shows its difference in nats and percent, the perplexity,
    and the projected seconds per step; an accuracy-like metric its difference in points and the
    projected seconds of the whole run."""
    metric = rows_[0]["metric"]
    loss = metric.endswith("loss")
    links = list(rows_[0]["projected"])
    base = next((r["value"] for r in rows_ if r["setting"] == "none"), None)
    head = ("setting", metric, *(("Δ vs none (nats, %)", metric.replace("_loss", "_ppl")) if loss
                                 else ("Δ vs none (pt)",)),
            "fwd bits/value", "bwd bits/value", "wire MB", "train s", "peak MiB by rank",
            *((f"s/step at {k} (proj.)" if loss else f"at {k} (proj.)") for k in links), "bits/value (avg)")
    table = [head]
    for r in rows_:
        if loss:
            cells = _loss_cells(r, base)
        else:
            warn = " (one class!)" if r["top_class"] and r["top_class"][0] == r["top_class"][1] else ""
            cells = (f"{r['value']:.4f}{warn}", "--" if r["delta"] is None else f"{100 * r['delta']:+.2f}")
        projected = [s / max(r["steps"], 1) if loss else s for s in r["projected"].values()]
        table.append((
            r["setting"], *cells, f"{r['forward_bits']:.2f}", f"{r['backward_bits']:.2f}",
            f"{r['wire_bytes'] / 1e6:.1f}", f"{r['train_seconds']:.1f}",
            "/".join(f"{b / 2**20:.0f}" for b in r["peak_bytes"]) or "--",
            *(f"{s:.3f} s" if loss else f"{s:.1f} s" for s in projected),
            f"{(r['forward_bits'] + r['backward_bits']) / 2:.2f}",
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["== comparison (same seed, data and flags; training traffic) =="]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
              for row in table]
    noise = _accuracy_noise(rows_)
    lines += [noise] if noise else []
    if loss:
        lines.append("One seed: the benchmark (docs/lm.md) pairs 3+ seeds on the same held-out tokens to resolve "
                     "differences of this size.")
    timed = all(r["timeline"] for r in rows_)
    lines.append("Link columns are projections: training seconds measured here (loopback, where compression cannot "
                 "change speed) + "
                 + ("what the link adds to a step's timeline of measured tasks (each message held back by the latency, "
                    "then its bytes at the rate with TCP/IP headers; dgpipe.pipeline.timeline)" if timed else
                    "training wire bytes at that rate with TCP/IP headers, no overlap"
                    + (", + the one-way latency once per message on the schedule's critical path (2 per boundary "
                       "and step)" if any(k.endswith("ms") for k in links) else ""))
                 + ". To measure on a real shaped link (root): python bandwidth/slow_link.py --rate 100mbit -- "
                   "<this command>")
    return "\n".join(lines)
