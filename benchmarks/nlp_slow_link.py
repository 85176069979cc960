"""Client/server fine-tuning on a slow link: MiniLM on SST-2 through real throttled TCP links.

What a boundary codec buys in wall-clock time per epoch when client and server talk over a slow
link, against the ideal the measured bytes allow. For each setting (labels of
:data:`dgpipe.experiments.settings.DELTA_SETTINGS`; default ``none``, ``codebook4`` and
``delta_codebook2_g2``) the nlp main job (client/server partition: the client holds the first and
last ``--client-layers`` layers, the server the middle) trains ``--epochs`` epochs of
``--train-subset`` sentences:

* **free**: on this machine's loopback, unthrottled -- the setting's compute bound (its own
  encode/decode included);
* **at each ``--rates`` rate**: through ``bandwidth/slow_link.py`` (network namespace + veth +
  ``tc tbf`` at that rate each way; the client on the host, the server in the namespace, so every
  boundary byte crosses the shaped link; needs root).

The measurement is the **last** epoch (the first warms up; delta coding's first epoch fills its
caches): its training seconds (``--train-subset / samples_per_s``, evaluation excluded) and the
bytes of that epoch's training messages per direction of the link (payloads with headers plus
framing, from the boundary meters): **uplink** (client to server) carries the activations after
the client's front layers and the gradients of the server's output; **downlink** the server's
output and the gradients of the client's front output. The link is full duplex, so the ideal
epoch on a link of ``rate`` bits/s is

    link_s  = 8 * max(uplink bytes, downlink bytes) / rate
    ideal_s = max(free_s, link_s)     (compute and transfers overlapped perfectly)
    serial_s = free_s + link_s        (no overlap at all)

and the table prints the measured epoch seconds next to both (``of ideal`` = ideal_s / measured).
Settings take turns within each of ``--rounds`` rounds (load from other processes then hits them
alike); every column is the median over rounds.

Usage (root; run from the repository root)::

    python benchmarks/nlp_slow_link.py [--rates 100mbit,10mbit] [--settings none,codebook4,delta_codebook2_g2]
        [--train-subset 256] [--epochs 2] [--rounds 1] [--out DIR] -- --task sst2 --data-dir DIR --model DIR ...

Everything after ``--`` goes to every run of the nlp job (task, data, model, batch size, ...).
Logs (``<label>_<free|RATE>_r<round>.jsonl`` and ``.out``) and ``table.md`` go to ``--out``; a
finished log is reused (the benchmark resumes). The exit status is 0 when every run produced its
last-epoch record.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

from slow_link_runs import add_common_args, check_args, run_rounds, shaped, split_extra

from dgpipe.comm.slow_link import parse_rate
from dgpipe.experiments.settings import DELTA_SETTINGS
from dgpipe.train.runlog import read_records

DEFAULT_LABELS = ("none", "codebook4", "delta_codebook2_g2")
UPLINK = {("stage0->stage1", "forward"), ("stage1->stage2", "backward")}  # what the client sends
DOWNLINK = {("stage1->stage2", "forward"), ("stage0->stage1", "backward")}  # what the server sends


def job_command(label: str, args: argparse.Namespace, extra: list[str], log: Path) -> list[str]:
    """The nlp main job's command line for one setting."""
    return [sys.executable, "-m", "dgpipe.cli", "nlp", "--train-subset", str(args.train_subset),
            "--epochs", str(args.epochs), "--seed", "0", *extra, *DELTA_SETTINGS[label], "--log", str(log),
            "--no-progress"]


def last_epoch(log: Path, epochs: int, train_subset: int) -> dict:
    """The last epoch of ``log``: training ``seconds`` and the bytes ``up`` and ``down`` the link carried.

    Raises:
        ValueError: the log has no record of epoch ``epochs`` (the run failed; see its ``.out``).
    """
    records = read_records(log) if log.exists() else []
    found = [r for r in records if r.get("event") == "epoch" and r.get("epoch") == epochs]
    if not found:
        raise ValueError(f"{log}: no epoch-{epochs} record; see {log.with_suffix('.out')}")
    rec = found[0]

    def sent(direction: set) -> int:
        return sum(b["wire_bytes"] + b["frame_bytes"] for b in rec["boundaries"]
                   if (b["name"], b["direction"]) in direction)

    return {"seconds": train_subset / rec["samples_per_s"], "up": sent(UPLINK), "down": sent(DOWNLINK)}


def table(results: dict, labels: list[str], rates: list[str]) -> str:
    """Markdown table of the medians over rounds (module docstring)."""
    rows = ["| setting | MB up / down per epoch | free link: s/epoch | rate | measured s/epoch | link s | "
            "ideal s | serial s | of ideal | speedup vs " + labels[0] + " |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        bits_per_s = parse_rate(rate)
        base = statistics.median(r[rate]["seconds"] for r in results[labels[0]])
        for label in labels:
            rounds = results[label]
            free = statistics.median(r["free"]["seconds"] for r in rounds)
            slow = statistics.median(r[rate]["seconds"] for r in rounds)
            up = statistics.median(r[rate]["up"] for r in rounds)
            down = statistics.median(r[rate]["down"] for r in rounds)
            link = 8 * max(up, down) / bits_per_s
            ideal = max(free, link)
            rows.append(f"| {label} | {up / 1e6:.2f} / {down / 1e6:.2f} | {free:.1f} | {rate} | {slow:.1f} | "
                        f"{link:.1f} | {ideal:.1f} | {free + link:.1f} | {ideal / slow:.2f} | {base / slow:.2f}x |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    argv, extra = split_extra(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit,10mbit", help="comma-separated tc rates each way")
    parser.add_argument("--train-subset", type=int, default=256, help="training sentences per epoch (default 256)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs; the last is measured (default 2)")
    add_common_args(parser, DELTA_SETTINGS, DEFAULT_LABELS, rounds=1, timeout_s=1800,
                    out="benchmarks/results/nlp_slow_link")
    args = parser.parse_args(argv)
    rates = args.rates.split(",")
    labels = check_args(parser, args, DELTA_SETTINGS, ("train_subset", "epochs"), rates)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def command(label: str, place: str, log: Path) -> list[str]:
        cmd = job_command(label, args, extra, log)
        return cmd if place == "free" else shaped(cmd, place, args.timeout)

    results, failed = run_rounds(
        out, labels, args.rounds, ["free", *rates], command,
        lambda log: last_epoch(log, args.epochs, args.train_subset),
        lambda m: f"{m['seconds']:.1f} s/epoch, {m['up'] / 1e6:.2f} MB up, {m['down'] / 1e6:.2f} MB down",
        args.timeout)
    if failed:
        print("\n".join(["failed runs:", *failed]), file=sys.stderr)
        return 1
    text = (f"{datetime.date.today()}, command: python benchmarks/nlp_slow_link.py {' '.join(sys.argv[1:])}\n\n"
            f"nlp client/server, {args.train_subset} training sentences per epoch, epoch {args.epochs} of "
            f"{args.epochs} measured, {args.rounds} round(s); load average {os.getloadavg()[0]:.1f} at the end\n\n"
            + table(results, labels, rates))
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
