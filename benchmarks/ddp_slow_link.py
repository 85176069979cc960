"""Data-parallel gradient compression on a slow link: 2-process DDP training of MobileNetV2
on real CIFAR-10 images across a real throttled TCP link, per DDP communication hook.

What gradient compression buys in wall-clock time when the link between data-parallel
workers is the bottleneck (the data-parallel slow-link comparison). For each setting (labels of
:data:`dgpipe.experiments.settings.DDP_SETTINGS`, default ``ddp_none,ddp_fp16,ddp_powersgd1,ddp_topk_ef``)
the vision main job runs in data-parallel mode twice per round:

* **slow**: through ``bandwidth/slow_link.py --rate RATE`` (network namespace + veth +
  ``tc tbf`` at ``RATE`` each way; rank 0 on the host, rank 1 in the namespace, so every
  gradient byte crosses the shaped link; needs root);
* **free**: the same command on this machine's loopback, unthrottled -- the compute
  bound of that setting (its own encode/decode and all).

Each run trains ``--epochs 2`` epochs of ``--steps`` optimizer steps (global batch
``--batch-size``, split over the 2 ranks). Epoch 1 is warm-up: DDP rebuilds its buckets
after the first step and PowerSGD sends plain all-reduces for its first
``start_powerSGD_iter`` steps. The measurement is epoch 2's training samples/s (its
``samples_per_s`` record: examples per second of training wall time, evaluation
excluded) and epoch 2's wire bytes per step per rank (the meter's ``wire_bytes`` summed
over ranks, divided by steps and ranks). Settings take turns in ``--rounds``
interleaved rounds, so load from other processes hits them alike; the table gives the
median over rounds, and ``speedup`` is the median of the per-round ratios to
``ddp_none`` of the same round (the first label is the reference). ``of free`` is slow /
free samples/s: 1.0 means the link no longer costs anything.

Usage (root; a few minutes per round on this machine)::

    python benchmarks/ddp_slow_link.py [--rate 100mbit] [--steps 12] [--rounds 2]
        [--settings ddp_none,ddp_fp16,ddp_powersgd1,ddp_topk_ef] [--out DIR] [-- extra main-job flags]

Logs (``<label>_<slow|free>_r<round>.jsonl`` and ``.out``) and ``table.md`` go to ``--out``; a
finished log is reused (the benchmark resumes). The exit status is 0 when every run produced its epoch-2 record.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from slow_link_runs import add_common_args, check_args, run_rounds, shaped, split_extra

from dgpipe.experiments.settings import DDP_SETTINGS
from dgpipe.train.runlog import read_records

ROOT = Path(__file__).resolve().parent.parent
VISION_CLI = ROOT / "test_vision_dgpipe.py"
DEFAULT_LABELS = ("ddp_none", "ddp_fp16", "ddp_powersgd1", "ddp_topk_ef")
WORLD_SIZE = 2


def job_command(label: str, args: argparse.Namespace, extra: list[str], log: Path) -> list[str]:
    """The vision main job's command line for one setting (2 epochs of ``args.steps`` steps)."""
    return [sys.executable, str(VISION_CLI), "--data-dir", args.data_dir, "--batch-size", str(args.batch_size),
            "--train-subset", str(args.batch_size * args.steps), "--eval-subset", str(args.batch_size),
            "--epochs", "2", "--lr", "0.02", "--seed", "0", *DDP_SETTINGS[label], *extra,
            "--log", str(log), "--no-progress"]


def measured_epoch(log: Path) -> dict:
    """Epoch 2's record of ``log``: ``samples_per_s`` and ``wire_mb`` (per step per rank, MB).

    Raises:
        ValueError: the log has no epoch-2 record (the run failed; see its ``.out``).
    """
    records = read_records(log) if log.exists() else []
    epochs = [r for r in records if r.get("event") == "epoch" and r.get("epoch") == 2]
    if not epochs:
        raise ValueError(f"{log}: no epoch-2 record; see {log.with_suffix('.out')}")
    rec = epochs[0]
    wire = sum(b["wire_bytes"] for b in rec["boundaries"])
    return {"samples_per_s": rec["samples_per_s"], "wire_mb": wire / rec["steps"] / WORLD_SIZE / 1e6}


def table(results: dict[str, list[dict]], labels: list[str], rate: str) -> str:
    """Markdown table of the medians over rounds (see the module docstring)."""
    ref = labels[0]
    rows = [f"| setting | wire MB/step/rank | samples/s at {rate} | speedup vs {ref} | samples/s free link | of free |",
            "|---|---|---|---|---|---|"]
    for label in labels:
        rounds = results[label]
        slow = statistics.median(r["slow"]["samples_per_s"] for r in rounds)
        free = statistics.median(r["free"]["samples_per_s"] for r in rounds)
        speedup = statistics.median(r["slow"]["samples_per_s"] / b["slow"]["samples_per_s"]
                                    for r, b in zip(rounds, results[ref]))
        wire = statistics.median(r["slow"]["wire_mb"] for r in rounds)
        rows.append(f"| {label} | {wire:.3f} | {slow:.1f} | {speedup:.2f}x | {free:.1f} | {slow / free:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    argv, extra = split_extra(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tc rate each way (default 100mbit)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per epoch (default 12)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "cifar10-images"))
    add_common_args(parser, DDP_SETTINGS, DEFAULT_LABELS, rounds=2, timeout_s=900,
                    out="benchmarks/results/ddp_slow_link")
    args = parser.parse_args(argv)
    if not Path(args.data_dir).is_dir():
        parser.error(f"--data-dir {args.data_dir} is not a folder (the CIFAR-10 images; see ../shared/data/README)")
    labels = check_args(parser, args, DDP_SETTINGS, ("steps", "batch_size"), [args.rate])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def command(label: str, place: str, log: Path) -> list[str]:
        cmd = job_command(label, args, extra, log)
        return shaped(cmd, args.rate, args.timeout) if place == "slow" else cmd

    results, failed = run_rounds(
        out, labels, args.rounds, ["slow", "free"], command, measured_epoch,
        lambda m: f"{m['samples_per_s']:.1f} samples/s, {m['wire_mb']:.3f} MB/step/rank", args.timeout)
    if failed:
        print("\n".join(["failed runs:", *failed]), file=sys.stderr)
        return 1
    text = (f"2-process DDP, MobileNetV2 on CIFAR-10 (32 px), global batch {args.batch_size}, "
            f"{args.steps} steps measured after {args.steps} warm-up, {args.rounds} rounds, tc rate {args.rate}; "
            f"load average {os.getloadavg()[0]:.1f} at the end\n\n" + table(results, labels, args.rate))
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
