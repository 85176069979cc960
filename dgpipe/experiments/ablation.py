"""The quality benchmark: one main job under several compression settings (and seeds), tabulated and plotted.

Run it as ``python benchmarks/ablation.py`` (a thin wrapper of :func:`main`).

Each setting runs the job's CLI once, with the same common arguments, and writes
``OUT/<label>.jsonl``; a setting whose log already holds a summary record is not run
again (delete the log to redo it). Then a markdown table (metric, measured wire
ratio, samples/s, wall seconds) is printed and ``OUT/ablation.png`` is drawn with
:mod:`dgpipe.experiments.plots`.

With ``--seeds 0,1,2`` (the quality benchmark) every setting runs once per seed
(``--seed k`` appended, log ``OUT/<label>_seed<k>.jsonl``; seed-major order, so that an
interrupted run leaves complete pairs), and the table gives per setting the measured
bits per value of each direction (all-in: codes, metadata, headers, the lossless
attention mask) and, for every metric of the summary (dev ``val_*`` and held-out
``heldout_*``), the mean and standard deviation over seeds and the **paired**
difference to ``none`` of the same seed, with a 95% Student-t confidence interval
(:func:`paired`). Runs with ``--delta`` (``--settings delta``) also get ``OUT/delta.md``:
per setting, boundary and epoch, the coded change and the reconstruction error relative
to the activations' energy (:func:`delta_table`).

Usage::

    python benchmarks/ablation.py --job vision --out benchmarks/results/vision -- \\
        --data-dir ../shared/data/cifar10-images --train-subset 3000 --eval-subset 1000 \\
        --epochs 3 --batch-size 64 --chunk 4
    python benchmarks/ablation.py --job nlp --out benchmarks/results/rte -- --task rte ...
    python benchmarks/ablation.py --job vision --settings ddp --out ... -- ...   # DDP gradient codecs
    python benchmarks/ablation.py --job nlp --settings lowbit --seeds 0,1,2 --out benchmarks/results/quality_sst2 \
        -- --task sst2 --heldout 4000 ...                                         # the quality benchmark
    python benchmarks/ablation.py --job nlp --settings delta --seeds 0,1,2 --out ... -- --epochs 3 ...  # AQ-SGD delta
    python benchmarks/ablation.py --job nlp --settings delta --only none,codebook4 --seeds 0,1,2 --out ... --no-run
                                                                                # tabulate what is there, run nothing
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scipy import stats

from dgpipe.pipeline import raise_on_sigterm, stop_process_group

from dgpipe.train.runlog import direction_bits, read_records, read_summary

from .plots import ablation_points, plot
from .settings import SETTINGS

#: How each job's CLI is run (after ``python``): the main jobs' modules.
CLIS = {"vision": ["-m", "dgpipe.cli", "vision"], "nlp": ["-m", "dgpipe.cli", "nlp"], "lm": ["-m", "dgpipe.cli", "lm"]}

def has_summary(log: Path) -> bool:
    """True if ``log`` exists and holds a summary record."""
    try:
        read_summary(log)
        return True
    except (OSError, ValueError, KeyError):
        return False


_LIVE: set[subprocess.Popen] = set()  # the runs in progress
_LIVE_LOCK = threading.Lock()


def run_setting(job: str, label: str, flags: list[str], common: list[str], out: Path) -> bool:
    """Run the job's CLI for one setting (``label`` names its log); returns True if it wrote a summary."""
    log = out / f"{label}.jsonl"
    if has_summary(log):
        print(f"[{label}] already done: {log}", flush=True)
        return True
    log.unlink(missing_ok=True)
    cmd = [sys.executable, *CLIS[job], *common, *flags, "--log", str(log), "--no-progress"]
    print(f"[{label}] {' '.join(cmd)}", flush=True)
    with open(out / f"{label}.out", "w") as stdout:
        # its own process group, so that stopping the runner can end the run and its ranks (run_all)
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True)
        with _LIVE_LOCK:
            _LIVE.add(proc)
        try:
            rc = proc.wait()
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)
    ok = rc == 0 and has_summary(log)
    status = "ok" if ok else f"FAILED (exit {rc}), see {stdout.name}"
    print(f"[{label}] {status}", flush=True)
    return ok


def run_all(job: str, runs: list[tuple[str, list[str], list[str]]], out: Path, parallel: int) -> bool:
    """:func:`run_setting` for each ``(label, flags, common)``, ``parallel`` at a time, in order of
    submission; True if every run wrote a summary. Ctrl-C or SIGTERM to the runner ends the runs
    in progress, ranks included (a finished run's log stays; the interrupted one is redone next
    time), and starts no other."""
    with ThreadPoolExecutor(parallel) as pool:
        try:
            done = list(pool.map(lambda r: run_setting(job, r[0], r[1], r[2], out), runs))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            with _LIVE_LOCK:
                live = list(_LIVE)
            for proc in live:
                stop_process_group(proc)
            raise
    return all(done)


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
            f"| {label} | {s['metric']} | {s['value']:.4f} | {ratio:.4f} | {s['samples_per_s']:.1f} | "
            f"{s['wall_seconds']:.0f} |"
        )
    return "\n".join(rows)


def paired(values: list[float], baseline: list[float]) -> tuple[float, float, float]:
    """Mean paired difference ``values[i] - baseline[i]`` and its 95% confidence interval.

    Student-t interval over the ``n >= 2`` per-seed differences: ``mean +- t(0.975, n-1) * sd / sqrt(n)``.

    Returns:
        ``(mean, low, high)``; with one pair, ``(d, nan, nan)``.

    Raises:
        ValueError: no pairs, or lists of different lengths.
    """
    if not values or len(values) != len(baseline):
        raise ValueError(f"paired needs equally many values and baselines, got {len(values)} and {len(baseline)}")
    diffs = [v - b for v, b in zip(values, baseline)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, mean - half, mean + half


def seeds_results(out: Path, labels: list[str], seeds: list[int], baseline: str = "none"
                  ) -> tuple[list[str], list[dict]]:
    """Per setting of a multi-seed run: measured bits per value and, per metric, the values over
    seeds and the paired difference to ``baseline`` (:func:`paired`). Seeds missing for a setting or
    its baseline are left out of its pairs.

    Returns ``(metrics, rows)``; each row is ``{"label", "seeds" (pairs), "forward", "backward"
    (bits/value), "values": {metric: [per seed]}, "delta": {metric: (mean, low, high) or None}}``.
    """
    def summaries(label):
        logs = {k: out / f"{label}_seed{k}.jsonl" for k in seeds}
        return {k: read_summary(log) for k, log in logs.items() if has_summary(log)}

    base = summaries(baseline)
    metrics = sorted({m for s in base.values() for m in s.get("metrics", {})})
    rows = []
    for label in labels:
        runs = summaries(label)
        if not runs:
            continue
        pairs = sorted(k for k in runs if k in base)
        bits = [direction_bits(read_records(out / f"{label}_seed{k}.jsonl")) for k in runs]
        row = {"label": label, "seeds": len(pairs), "values": {}, "delta": {},
               "forward": statistics.fmean(b["forward"] for b in bits),
               "backward": statistics.fmean(b["backward"] for b in bits)}
        for m in metrics:
            row["values"][m] = [runs[k]["metrics"][m] for k in runs]
            row["delta"][m] = None if label == baseline or not pairs else paired(
                [runs[k]["metrics"][m] for k in pairs], [base[k]["metrics"][m] for k in pairs])
        rows.append(row)
    return metrics, rows


def _scale(metric: str) -> tuple[float, str]:
    """How a metric's differences are shown: fractions (accuracy, MCC, ...) in points (x100); a loss
    (nats) or a perplexity as they are."""
    if metric.endswith("loss"):
        return 1.0, "nats"
    if metric.endswith("ppl"):
        return 1.0, "ppl"
    return 100.0, "pt"


def seeds_table(out: Path, labels: list[str], seeds: list[int], baseline: str = "none") -> str:
    """Markdown table of a multi-seed run (:func:`seeds_results`): bits per value, and per metric
    mean +- sd and the paired difference to ``baseline`` (points -- x100 -- for fractions, nats for a
    loss) with its 95% CI (the ``seeds`` column says how many pairs there are)."""
    metrics, results = seeds_results(out, labels, seeds, baseline)
    head = "| setting | seeds | fwd bits/value | bwd bits/value | " + " | ".join(
        f"{m} mean ± sd | Δ{m} ({_scale(m)[1]}) [95% CI]" for m in metrics) + " |"
    rows = [head, "|" + "---|" * (4 + 2 * len(metrics))]
    for r in results:
        cells = [r["label"], str(r["seeds"]), f"{r['forward']:.2f}", f"{r['backward']:.2f}"]
        for m in metrics:
            vals = r["values"][m]
            sd = statistics.stdev(vals) if len(vals) > 1 else math.nan
            cells.append(f"{statistics.fmean(vals):.4f} ± {sd:.4f}")
            d, k = r["delta"][m], _scale(m)[0]
            fmt = "+.2f" if k == 100 else "+.4f"
            cells.append("--" if d is None else f"{k * d[0]:{fmt}} [{k * d[1]:{fmt}}, {k * d[2]:{fmt}}]")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def delta_table(logs: dict[str, list[Path]]) -> str | None:
    """Markdown table of the delta-coded boundaries' statistics (``--delta`` runs): per setting,
    boundary and epoch, the mean over its logs of the coded change and of the reconstruction
    error, both relative to the activations' energy (``delta_change_rel`` / ``delta_error_rel``
    of the epoch records: 1 / the direct coding error on first visits). ``None`` without
    delta runs."""
    rows = []
    for label, paths in logs.items():
        stats: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for path in paths:
            for record in read_records(path):
                for b in record.get("boundaries", []) if record["event"] == "epoch" else []:
                    if b.get("delta") and b.get("delta_change_rel") is not None:
                        key = (b["name"], record["epoch"])
                        stats.setdefault(key, []).append((b["delta_change_rel"], b["delta_error_rel"]))
        for name in sorted({n for n, _ in stats}):
            cells = [f"{statistics.mean(c for c, _ in v):.3f} / {statistics.mean(e for _, e in v):.4f}"
                     for (n, _), v in sorted(stats.items(), key=lambda kv: kv[0][1]) if n == name]
            rows.append((label, name, len(paths), cells))
    if not rows:
        return None
    epochs = max(len(r[3]) for r in rows)
    head = "| setting | boundary | runs | " + " | ".join(f"epoch {e + 1}: change / error" for e in range(epochs)) + " |"
    lines = [head, "|" + "---|" * (3 + epochs)]
    lines += [f"| {label} | {name} | {n} | " + " | ".join(cells) + " |" for label, name, n, cells in rows]
    return "\n".join(lines)


#: Published operating points of pipeline-boundary compression, in bits per value averaged over both directions
#: (forward + backward) / 2, as ``(label, low, high)``: what each method sends, not its accuracy on our tasks.
ANCHORS: tuple[tuple[str, float, float], ...] = (
    ("AQ-SGD: 2-4 fwd (delta), 6-8 bwd", 4.0, 6.0),  # Wang et al., NeurIPS 2022
    ("TAH-Quant: 3.8-4.4 fwd, 6 bwd", 4.9, 5.2),  # tile-wise INT3/INT4 + Hadamard, INT6 gradients
    ("Protocol Models (NanoGPT): 2.5 each way", 2.5, 2.5),  # arXiv 2506.01260, 322 of 2,048 bytes a token
)


def seeds_plot(out: Path, labels: list[str], seeds: list[int], title: str | None = None,
               baseline: str = "none") -> Path | None:
    """``OUT/quality.png``: per metric, the paired difference to ``baseline`` (points, 95% CI bars)
    against measured bits per value averaged over both directions (the frontier, 0.5 to 8 bits on a
    log axis), with the published operating points of :data:`ANCHORS` as shaded bands. Returns the
    path, or None when nothing is paired yet."""
    import matplotlib.pyplot as plt

    metrics, results = seeds_results(out, labels, seeds, baseline)
    results = [r for r in results if any(d is not None for d in r["delta"].values())]
    if not results or not metrics:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for r in results:
            d = r["delta"][m]
            if d is None:
                continue
            k = _scale(m)[0]
            err = [[0.0], [0.0]] if math.isnan(d[1]) else [[k * (d[0] - d[1])], [k * (d[2] - d[0])]]
            bits = (r["forward"] + r["backward"]) / 2
            ax.errorbar([bits], [k * d[0]], yerr=err, fmt="o", capsize=3)
            ax.annotate(r["label"], (bits, k * d[0]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(0, color="grey", lw=0.8)
        for i, (name, lo, hi) in enumerate(ANCHORS):
            ax.axvspan(lo * 0.98, hi * 1.02, color=f"C{7 + i % 3}", alpha=0.15, lw=0)
            ax.text(lo, 0.02 + 0.07 * i, name, transform=ax.get_xaxis_transform(), fontsize=6, rotation=0)
        ax.set_xscale("log", base=2)
        ax.set_xlim(0.5, 9)
        ax.set_xticks([0.5, 1, 2, 3, 4, 6, 8], ["0.5", "1", "2", "3", "4", "6", "8"])
        ax.set_xlabel("bits per value, mean of both directions (measured, all-in)")
        ax.set_ylabel(f"Δ {m} vs {baseline} ({_scale(m)[1]}, paired 95% CI)")
    fig.suptitle(title or f"{out.name}: {len(seeds)} seeds")
    fig.tight_layout()
    path = out / "quality.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns 0 when every setting produced a summary."""
    restore = raise_on_sigterm()  # SIGTERM as SystemExit, so that run_all stops the runs in progress
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    finally:
        restore()


def _main(argv: list[str]) -> int:
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
    parser.add_argument("--seeds", help="comma-separated seeds: run every setting once per seed, paired table")
    parser.add_argument("--baseline", default="none",
                        help="with --seeds: the label every setting is paired with (default none)")
    parser.add_argument("--no-run", action="store_true",
                        help="run nothing: tabulate and plot the logs already in --out (e.g. while runs go on "
                             "elsewhere)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs at a time (default 1; more on a machine with cores or a GPU to spare)")
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    settings = SETTINGS[args.settings]
    labels = args.only.split(",") if args.only else list(settings)
    unknown = [lab for lab in labels if lab not in settings]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {list(settings)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.seeds:
        try:
            seeds = [int(k) for k in args.seeds.split(",")]
        except ValueError:
            parser.error(f"--seeds {args.seeds!r}: write integers separated by commas, e.g. 0,1,2")
        if "--seed" in common:
            parser.error("--seeds gives the seeds; do not pass --seed after --")
        if args.baseline not in labels:
            parser.error(f"--baseline {args.baseline} is not among the settings: add it to --only")
        runs = [(f"{lab}_seed{k}", settings[lab], common + ["--seed", str(k)]) for k in seeds for lab in labels]
        done = all(has_summary(out / f"{r[0]}.jsonl") for r in runs)
        ok = done if args.no_run else run_all(args.job, runs, out, args.parallel)
        table_md = seeds_table(out, labels, seeds, args.baseline)
        (out / "table.md").write_text(table_md + "\n")
        print(table_md)
        deltas = delta_table({lab: [out / f"{lab}_seed{k}.jsonl" for k in seeds
                                    if has_summary(out / f"{lab}_seed{k}.jsonl")] for lab in labels})
        if deltas:
            (out / "delta.md").write_text(deltas + "\n")
            print(deltas)
        png = seeds_plot(out, labels, seeds, args.title, args.baseline)
        if png:
            print(f"wrote {png}")
        return 0 if ok else 1
    runs = [(lab, settings[lab], common) for lab in labels]
    done = all(has_summary(out / f"{lab}.jsonl") for lab in labels)
    ok = done if args.no_run else run_all(args.job, runs, out, args.parallel)
    print(table(out, labels))
    done = [out / f"{lab}.jsonl" for lab in labels if has_summary(out / f"{lab}.jsonl")]
    deltas = delta_table({p.stem: [p] for p in done})
    if deltas:
        (out / "delta.md").write_text(deltas + "\n")
        print(deltas)
    if done:
        points = ablation_points(done, [p.stem for p in done])
        print(f"wrote {plot(points, out / 'ablation.png', args.title)}")
    return 0 if ok else 1

