"""Side by side: one main-job command under several boundary settings (``--compare-to``).

The command's own setting trains first, then each named setting of ``--compare-to``
(:data:`~dgpipe.train.codecs.SETTINGS`) with every other flag unchanged -- same seed, so
the same initialisation, training subset and batch order -- one after another in the same
ranks (:func:`dgpipe.train.loop.run`). The launching process then reads the run logs and
prints one table (:func:`rows`, :func:`format_table`): per setting the task metric and its
difference to the uncompressed run, the measured bits per value of each direction
(:func:`~dgpipe.train.runlog.direction_bits`, all-in), the training wire bytes, the
measured training time and what each run's traffic would add on slower links.

The link columns are a projection, not a measurement: ``training seconds + training wire
bytes x 8 / rate``, i.e. the time measured here plus the time the same bytes need at that
rate with no overlap of transfer and compute. On one machine the link is loopback, where
compression cannot change samples/s; ``bandwidth/slow_link.py --rate 100mbit -- COMMAND``
runs the same command across a real shaped link (root).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .codecs import SETTINGS, setting_label
from .config import RunConfig
from .runlog import direction_bits, read_records

__all__ = ["LINK_RATES", "plan", "rows", "format_table"]

#: Link rates of the projection columns, bits per second, by label.
LINK_RATES = {"100 Mbit/s": 100e6, "10 Mbit/s": 10e6}


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


def rows(runs: list[tuple[str, RunConfig]]) -> list[dict[str, Any]]:
    """One dict per run, from its log, the ``none`` run first: ``setting``, ``metric`` (name), ``value``, ``delta``
    (value minus the ``none`` run's; None without one), ``forward_bits``/``backward_bits``
    (measured bits per value), ``wire_bytes`` (training, both directions), ``train_seconds``,
    ``projected`` (link label -> seconds, see the module docstring), ``top_class``
    (``[count, n]`` or None) and ``eval_examples``.

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
        seconds = summary["train_seconds"]
        out.append({
            "setting": label, "metric": summary["metric"], "value": summary["value"],
            "forward_bits": bits["forward"], "backward_bits": bits["backward"],
            "wire_bytes": summary["wire_bytes"], "train_seconds": seconds,
            "projected": {k: seconds + 8 * summary["wire_bytes"] / rate for k, rate in LINK_RATES.items()},
            "top_class": summary.get("top_class"),
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


def format_table(rows_: list[dict[str, Any]]) -> str:
    """The comparison as a fixed-width table with its notes (noise, what the projection is);
    the last column averages the measured bits per value of the two directions."""
    metric = rows_[0]["metric"]
    head = ("setting", metric, "Δ vs none (pt)", "fwd bits/value", "bwd bits/value", "wire MB", "train s",
            *(f"at {k} (proj.)" for k in LINK_RATES), "bits/value (avg)")
    table = [head]
    for r in rows_:
        warn = " (one class!)" if r["top_class"] and r["top_class"][0] == r["top_class"][1] else ""
        table.append((
            r["setting"], f"{r['value']:.4f}{warn}", "--" if r["delta"] is None else f"{100 * r['delta']:+.2f}",
            f"{r['forward_bits']:.2f}", f"{r['backward_bits']:.2f}", f"{r['wire_bytes'] / 1e6:.1f}",
            f"{r['train_seconds']:.1f}", *(f"{s:.1f} s" for s in r["projected"].values()),
            f"{(r['forward_bits'] + r['backward_bits']) / 2:.2f}",
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["== comparison (same seed, data and flags; training traffic) =="]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
              for row in table]
    noise = _accuracy_noise(rows_)
    lines += [noise] if noise else []
    lines.append("Link columns are projections: training seconds measured here (loopback, where compression cannot "
                 "change speed) + training wire bytes at that rate, no overlap. To measure on a real shaped link "
                 "(root): python bandwidth/slow_link.py --rate 100mbit -- <this command>")
    return "\n".join(lines)
