"""Run one main job under several compression settings, then tabulate and plot the logs.

Each setting runs the job's CLI once, with the same common arguments, and writes
``OUT/<label>.jsonl``; a setting whose log already holds a summary record is not run
again (delete the log to redo it). Then a markdown table (metric, measured wire
ratio, samples/s, wall seconds) is printed and ``OUT/ablation.png`` is drawn with
:mod:`plot_ablation`.

Usage::

    python benchmarks/ablation.py --job vision --out benchmarks/results/vision -- \\
        --data-dir ../shared/data/cifar10-images --train-subset 3000 --eval-subset 1000 \\
        --epochs 3 --batch-size 64 --chunk 4
    python benchmarks/ablation.py --job nlp --out benchmarks/results/rte -- --task rte ...
    python benchmarks/ablation.py --job vision --settings ddp --out ... -- ...   # DDP gradient codecs
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from plot_ablation import ablation_points, plot

from dgpipe.train.runlog import read_summary

ROOT = Path(__file__).resolve().parent.parent
CLIS = {"vision": ROOT / "test_vision_dgpipe.py", "nlp": ROOT / "test_nlp_dgpipe.py"}

#: Pipeline boundary compression: uncompressed, sortquant at 16/12/8/4 bits (Q:S = 3:1),
#: uniform quantization, and the data-parallel baseline.
PIPELINE_SETTINGS: dict[str, list[str]] = {
    "none": [],
    "sortquant16": ["--sortquant", "--quant", "12", "--split", "4"],
    "sortquant12": ["--sortquant", "--quant", "9", "--split", "3"],
    "sortquant8": ["--sortquant", "--quant", "6", "--split", "2"],
    "sortquant4": ["--sortquant", "--quant", "3", "--split", "1"],
    "quant16": ["--quant", "16"],
    "quant8": ["--quant", "8"],
    "quant4": ["--quant", "4"],
    "dataparallel": ["--mode", "dataparallel"],
}

#: Data-parallel gradient compression (issue 7's comparison).
_DP = ["--mode", "dataparallel", "--grad-compression"]
DDP_SETTINGS: dict[str, list[str]] = {
    "ddp_none": ["--mode", "dataparallel"],
    "ddp_fp16": _DP + ["fp16"],
    "ddp_powersgd1": _DP + ["powersgd", "--grad-compression-opt", "matrix_approximation_rank=1"],
    "ddp_powersgd4": _DP + ["powersgd", "--grad-compression-opt", "matrix_approximation_rank=4"],
    "ddp_topk_ef": _DP + ["topk", "--grad-compression-opt", "ratio=0.01", "--grad-compression-opt", "error_feedback=true"],
    "ddp_randomk": _DP + ["randomk", "--grad-compression-opt", "ratio=0.01"],
    "ddp_onebit_ef": _DP + ["onebit", "--grad-compression-opt", "error_feedback=true"],
    "ddp_qsgd4": _DP + ["qsgd", "--grad-compression-opt", "levels=4"],
    "ddp_qsgd4_b512": _DP + ["qsgd", "--grad-compression-opt", "levels=4", "--grad-compression-opt", "bucket_size=512"],
    "ddp_terngrad": _DP + ["terngrad"],
    "ddp_dgc": _DP + ["dgc", "--grad-compression-opt", "warmup_epochs=2"],
    "ddp_atomo4": _DP + ["atomo", "--grad-compression-opt", "budget=4"],
}

SETTINGS = {"pipeline": PIPELINE_SETTINGS, "ddp": DDP_SETTINGS}


def has_summary(log: Path) -> bool:
    """True if ``log`` exists and holds a summary record."""
    try:
        read_summary(log)
        return True
    except (OSError, ValueError, KeyError):
        return False


def run_setting(job: str, label: str, flags: list[str], common: list[str], out: Path) -> bool:
    """Run the job's CLI for one setting; returns True if it wrote a summary."""
    log = out / f"{label}.jsonl"
    if has_summary(log):
        print(f"[{label}] already done: {log}", flush=True)
        return True
    log.unlink(missing_ok=True)
    cmd = [sys.executable, str(CLIS[job]), *common, *flags, "--log", str(log), "--no-progress"]
    print(f"[{label}] {' '.join(cmd)}", flush=True)
    with open(out / f"{label}.out", "w") as stdout:
        rc = subprocess.call(cmd, stdout=stdout, stderr=subprocess.STDOUT)
    ok = rc == 0 and has_summary(log)
    status = "ok" if ok else f"FAILED (exit {rc}), see {stdout.name}"
    print(f"[{label}] {status}", flush=True)
    return ok


def table(out: Path, labels: list[str]) -> str:
    """Markdown table of the summaries of ``labels``' logs in ``out`` (missing ones skipped)."""
    rows = ["| setting | metric | value | wire ratio | samples/s | wall s |", "|---|---|---|---|---|---|"]
    for label in labels:
        log = out / f"{label}.jsonl"
        if not has_summary(log):
            continue
        s = read_summary(log)
        ratio = s["wire_bytes"] / s["raw_bytes"] if s["raw_bytes"] else float("nan")
        rows.append(
            f"| {label} | {s['metric']} | {s['value']:.4f} | {ratio:.4f} | {s['samples_per_s']:.1f} | {s['wall_seconds']:.0f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns 0 when every setting produced a summary."""
    argv = sys.argv[1:] if argv is None else argv
    common: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, common = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=sorted(CLIS), required=True)
    parser.add_argument("--settings", choices=sorted(SETTINGS), default="pipeline")
    parser.add_argument("--only", help="comma-separated subset of the setting labels")
    parser.add_argument("--out", required=True, help="folder for the logs, outputs and the plot")
    parser.add_argument("--title", help="plot title")
    args = parser.parse_args(argv)
    settings = SETTINGS[args.settings]
    labels = args.only.split(",") if args.only else list(settings)
    unknown = [lab for lab in labels if lab not in settings]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {list(settings)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok = all([run_setting(args.job, lab, settings[lab], common, out) for lab in labels])
    print(table(out, labels))
    done = [out / f"{lab}.jsonl" for lab in labels if has_summary(out / f"{lab}.jsonl")]
    if done:
        points = ablation_points(done, [p.stem for p in done])
        print(f"wrote {plot(points, out / 'ablation.png', args.title)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
