"""What the slow-link benchmarks share: their common flags and checks, and running one job.

``ddp_slow_link.py`` (data-parallel workers) and ``nlp_slow_link.py`` (client and server) run
the main jobs through ``bandwidth/slow_link.py`` (a network namespace + veth + ``tc tbf``;
needs root) and on the unthrottled loopback, setting by setting, in interleaved rounds.
Both take the same ``--settings``, ``--rounds``, ``--timeout`` and ``--out`` flags, pass
everything after ``--`` to the job, refuse bad input with a one-line error before any
process starts, and resume: a run whose log already holds its measurement is not run again.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from dgpipe.comm.slow_link import parse_rate
from dgpipe.pipeline import stop_process_group

__all__ = ["SLOW_LINK", "split_extra", "add_common_args", "check_args", "shaped", "run", "run_rounds"]

SLOW_LINK = Path(__file__).resolve().parent.parent / "bandwidth" / "slow_link.py"


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(benchmark flags, job flags)``: ``argv`` split at its first ``--`` (no job flags without one)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def add_common_args(parser: argparse.ArgumentParser, settings: dict, default_labels: tuple[str, ...],
                    rounds: int, timeout_s: float, out: str) -> None:
    """Add ``--settings`` (labels of ``settings``; the first is the reference), ``--rounds``,
    ``--timeout`` (seconds per run) and ``--out`` (the logs' folder) with these defaults."""
    parser.add_argument("--settings", default=",".join(default_labels),
                        help=f"comma-separated labels, the first is the reference; from {', '.join(settings)}")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    parser.add_argument("--timeout", type=float, default=timeout_s, help="seconds per run before it is killed")
    parser.add_argument("--out", default=out, help="folder for logs and table.md")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: dict,
               counts: tuple[str, ...], rates: list[str]) -> list[str]:
    """The setting labels of ``args.settings``, after the checks every slow-link run needs.

    Exits through ``parser.error`` (status 2, one line) on an unknown label, a count flag
    (attribute names in ``counts``) below 1, a non-positive ``--timeout``, a rate that
    :func:`dgpipe.comm.slow_link.parse_rate` refuses, or a user other than root.
    """
    labels = args.settings.split(",")
    unknown = [lab for lab in labels if lab not in settings]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {list(settings)}")
    for name in ("rounds", *counts):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0 seconds")
    for rate in rates:
        try:
            parse_rate(rate)
        except ValueError as err:
            parser.error(str(err))
    if os.geteuid() != 0:
        parser.error("needs root: the slow link is a network namespace with tc shaping")
    return labels


def shaped(cmd: list[str], rate: str, timeout_s: float) -> list[str]:
    """``cmd`` run through ``bandwidth/slow_link.py`` at ``rate`` each way; the runner stops both
    ranks and tears the link down after ``timeout_s`` seconds."""
    return [sys.executable, str(SLOW_LINK), "--rate", rate, "--timeout", str(timeout_s), "--", *cmd]


def run(cmd: list[str], out: Path, timeout_s: float) -> int:
    """Run ``cmd`` in its own session with stdout/stderr to ``out``; its exit status.

    After ``timeout_s`` seconds the whole process group (the job and the ranks it
    started) gets SIGTERM, then SIGKILL after 10 s, and the status is 124.
    """
    with open(out, "w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, grace_s=10.0)
            return 124


def run_rounds(out: Path, labels: list[str], rounds: int, places: list[str],
               command: Callable[[str, str, Path], list[str]], measure: Callable[[Path], dict],
               describe: Callable[[dict], str], timeout_s: float) -> tuple[dict[str, list[dict]], list[str]]:
    """Every setting at every place (``"free"``, a rate, ...), in ``rounds`` interleaved rounds.

    The log of a run is ``out/<label>_<place>_r<round>.jsonl`` (its output beside it, ``.out``); a log
    that ``measure`` reads without a ``ValueError`` is reused, any other is deleted and the run made
    with ``command(label, place, log)`` under :func:`run` (``timeout_s`` + 30 s), then measured and
    printed with ``describe``.

    Returns:
        ``(results, failed)``: per label, one ``{place: measure(log)}`` for each round in which every
        place was measured; one line per run that left no measurement (the error and exit status).
    """
    results: dict[str, list[dict]] = {label: [] for label in labels}
    failed = []
    for rnd in range(rounds):
        for label in labels:
            entry = {}
            for place in places:
                log = out / f"{label}_{place}_r{rnd}.jsonl"
                try:
                    entry[place] = measure(log)
                    continue  # finished earlier
                except ValueError:
                    log.unlink(missing_ok=True)
                rc = run(command(label, place, log), log.with_suffix(".out"), timeout_s + 30)
                try:
                    entry[place] = measure(log)
                except ValueError as err:
                    failed.append(f"{err} (exit {rc})")
                    continue
                print(f"round {rnd} {label} {place}: {describe(entry[place])}", flush=True)
            if len(entry) == len(places):
                results[label].append(entry)
    return results, failed
