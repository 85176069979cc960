"""The language-model benchmark's report: the numbers the field reports, from the runs' logs.

Run it as ``python benchmarks/lm_pretrain.py`` (which also runs the missing runs through
:mod:`dgpipe.experiments.ablation`). Every setting ran once per seed with the same flags as the
uncompressed run of that seed (same initialisation, batches and held-out tokens); per setting:

- **final validation loss difference** to the uncompressed run of the same seed, in nats and in percent
  of the uncompressed loss, mean and 95% Student-t interval over the seeds (:func:`~.ablation.paired`);
- **steps to the target**: the target is the uncompressed run's final validation loss (per seed), or its
  validation loss at a given step (``target_step``: a target the uncompressed run reaches before its end); a run's
  steps to it are the first step where its validation curve (evaluated every ``--eval-every`` steps)
  reaches it, linearly interpolated between evaluations (:func:`steps_to_target`); the ratio to the
  uncompressed run's own steps to it (ProtocolNanoGPT's measure: 3.1x at ~2.5 bits). A run that never
  reaches it within its steps has an unbounded ratio, reported as ``> steps / steps_none``;
- **bits per value** measured per direction, all-in, and their mean;
- **T = steps to the target x step time** on each link of :data:`~.compare.LM_LINKS` (the step time
  projected from the compute per step, the bytes and the latency, :func:`~.compare.project`), beside
  the references' T (:data:`REFERENCES`). The quality runs share the machine with each other and with
  whatever else runs, so their own step times are not comparable; the compute per step comes from
  short timing runs of each setting made side by side on a quiet machine where given
  (``compute_seconds``; ``benchmarks/lm_link_latency.py``), else from the run itself.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from scipy import stats

from .ablation import ANCHORS, has_summary, paired
from dgpipe.train.compare import LM_LINKS, Link, project, run_profile, stage_boundaries
from dgpipe.train.runlog import direction_bits, read_records, read_summary

__all__ = ["REFERENCES", "curve", "steps_to_target", "mean_interval", "results", "table", "memory_table", "plot"]

#: ProtocolNanoGPT (Pluralis; arXiv 2506.01260): 203M GPT, 8 stages, 200 Mbit/s + 50 ms per boundary,
#: FineWeb to a validation loss of 3.276: (label, bits per value each way, steps to target, T in seconds).
REFERENCES = (("ProtocolNanoGPT dense bf16", 16.0, 2925, 293_889), ("ProtocolNanoGPT subspace", 2.5, 9125, 181_487))


def curve(records: Sequence[dict]) -> list[tuple[int, float]]:
    """``[(step, val_loss)]`` of a run's evaluations (``eval`` and ``epoch`` records), by step."""
    points = {r["step"]: r["val_loss"] for r in records if r.get("event") in ("eval", "epoch") and "step" in r}
    return sorted(points.items())


def steps_to_target(points: Sequence[tuple[int, float]], target: float) -> float | None:
    """The first step at which the validation curve ``points`` reaches ``target`` (``<=``), linearly
    interpolated between the two evaluations around the crossing; ``None`` when it never does."""
    previous = None
    for step, loss in points:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(step)
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``values`` and its two-sided 95% Student-t interval (nan bounds for
    fewer than 2 values)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def results(out: Path, labels: Sequence[str], seeds: Sequence[int], baseline: str = "none",
            links: Sequence[Link] = LM_LINKS, compute_seconds: dict[str, float] | None = None,
            target_step: int | None = None) -> list[dict[str, Any]]:
    """One dict per setting with paired runs in ``out`` (logs ``<label>_seed<k>.jsonl``): ``label``,
    ``seeds`` (pairs), ``forward``/``backward`` (bits per value), ``final`` (mean final val_loss),
    ``delta`` and ``delta_pct`` ((mean, low, high) paired differences, nats and percent), ``ratios``
    (per seed steps-to-target ratio, ``inf`` when not reached), ``ratio`` ((mean, low, high) when every
    seed reached the target, else None), ``steps`` (steps per run), ``step_seconds`` (measured compute
    per step: ``compute_seconds[label]`` where given, else the run's own) and ``T`` (link label -> mean
    seconds to the target, ``inf`` if not reached). The target is the baseline run's final validation loss, or
    with ``target_step`` its validation loss evaluated at that step.

    Raises:
        ValueError: ``target_step`` is given and a baseline run has no evaluation at that step.
    """
    def logs(label):
        return {k: read_records(out / f"{label}_seed{k}.jsonl") for k in seeds
                if has_summary(out / f"{label}_seed{k}.jsonl")}

    base = logs(baseline)
    targets = {k: runs[-1]["value"] for k, runs in base.items()}
    if target_step is not None:
        for k, runs in base.items():
            points = dict(curve(runs))
            if target_step not in points:
                raise ValueError(f"the {baseline} run of seed {k} has no evaluation at step {target_step} "
                                 f"(evaluations at {sorted(points)})")
            targets[k] = points[target_step]
    rows = []
    for label in labels:
        runs = logs(label)
        pairs = sorted(k for k in runs if k in base)
        if not pairs:
            continue
        finals, deltas, pcts, ratios, seconds, t_link = [], [], [], [], [], {k.label: [] for k in links}
        bits = [direction_bits(runs[k]) for k in pairs]
        for k in pairs:
            own, final = runs[k][-1], base[k][-1]["value"]
            target = targets[k]
            finals.append(own["value"])
            deltas.append(own["value"] - final)
            pcts.append(100 * (own["value"] - final) / final)
            reached, ref_steps = steps_to_target(curve(runs[k]), target), steps_to_target(curve(base[k]), target)
            ratios.append(math.inf if reached is None else reached / ref_steps)
            compute = (compute_seconds or {}).get(label, own["train_seconds"] / own["steps"])
            seconds.append(compute)
            boundaries = stage_boundaries(own["args"].get("mode", "pipeline"), own["args"]["partition"],
                                          own["args"]["stages"])
            for link in links:
                total = project(compute * own["steps"], own["wire_bytes"], own["steps"], boundaries, link,
                                run_profile(runs[k]))
                step_time = total / own["steps"]
                t_link[link.label].append(math.inf if reached is None else reached * step_time)
        rows.append({
            "label": label, "seeds": len(pairs), "steps": runs[pairs[0]][-1]["steps"],
            "forward": statistics.fmean(b["forward"] for b in bits),
            "backward": statistics.fmean(b["backward"] for b in bits),
            "final": statistics.fmean(finals),
            "delta": None if label == baseline else paired(deltas, [0.0] * len(deltas)),
            "delta_pct": None if label == baseline else paired(pcts, [0.0] * len(pcts)),
            "ratios": ratios, "ratio": mean_interval(ratios) if all(math.isfinite(r) for r in ratios) else None,
            "step_seconds": statistics.fmean(seconds),
            "T": {k: statistics.fmean(v) for k, v in t_link.items()},
        })
    return rows


def _ci(d: tuple[float, float, float] | None, fmt: str) -> str:
    if d is None:
        return "--"
    mean, low, high = d
    return f"{mean:{fmt}} [{low:{fmt}}, {high:{fmt}}]" if math.isfinite(low) else f"{mean:{fmt}}"


def table(rows: list[dict[str, Any]], baseline: str = "none") -> str:
    """Markdown: per setting bits, final loss, its paired difference (nats, %), the steps-to-target ratio
    and T on each link, with T's ratio to the uncompressed run's (higher is better, as ProtocolNanoGPT's
    1.62x), then the references."""
    links = list(rows[0]["T"]) if rows else []
    head = ("| setting | seeds | fwd bits | bwd bits | avg bits | final val_loss | Δ nats [95% CI] | Δ % [95% CI] | "
            f"steps to target (x {baseline}) | compute s/step | "
            + " | ".join(f"T at {k} (s) | speedup" for k in links) + " |")
    lines = [head, "|" + "---|" * (10 + 2 * len(links))]
    base = next((r for r in rows if r["label"] == baseline), None)
    for r in rows:
        if r["ratio"] is not None:
            ratio = _ci(r["ratio"], ".2f")
        else:
            reached = sum(math.isfinite(x) for x in r["ratios"])
            ratio = f"not reached in {r['steps']} steps by {r['seeds'] - reached} of {r['seeds']} seeds"
        cells = [r["label"], str(r["seeds"]), f"{r['forward']:.2f}", f"{r['backward']:.2f}",
                 f"{(r['forward'] + r['backward']) / 2:.2f}", f"{r['final']:.4f}", _ci(r["delta"], "+.4f"),
                 _ci(r["delta_pct"], "+.2f"), ratio, f"{r['step_seconds']:.3f}"]
        for k in links:
            t = r["T"][k]
            speed = base["T"][k] / t if base and math.isfinite(t) else math.nan
            cells += [f"{t:.0f}" if math.isfinite(t) else "--", f"{speed:.2f}x" if math.isfinite(speed) else "--"]
        lines.append("| " + " | ".join(cells) + " |")
    dense = REFERENCES[0]
    for name, bits, steps, seconds in REFERENCES:
        lines.append(f"| {name} (reference, 200 Mbit/s + 50 ms) | | {bits:g} | {bits:g} | {bits:g} | 3.276 (target) "
                     f"| | | {steps / dense[2]:.2f} | | {seconds:,.0f} | {dense[3] / seconds:.2f}x |"
                     + " |" * (2 * len(links) - 2))
    return "\n".join(lines)


def memory_table(out: Path, labels: Sequence[str], seeds: Sequence[int], baseline: str = "none") -> str:
    """Markdown: per setting (the finished seeds of ``OUT/<label>_seed<k>.jsonl``) each rank's peak memory while
    training (the summary's ``memory``: MiB, mean and 95% interval over the seeds), its ratio to ``baseline``'s
    peak on the same rank and seed (mean and interval), the resident set before the model was built (the
    interpreter and libraries), and the training seconds a step."""
    rows = []
    for label in labels:
        logs = {k: out / f"{label}_seed{k}.jsonl" for k in seeds if has_summary(out / f"{label}_seed{k}.jsonl")}
        if not logs:
            continue
        summaries = {k: read_summary(path) for k, path in logs.items()}
        bases = {k: read_summary(out / f"{baseline}_seed{k}.jsonl")["memory"] for k in summaries
                 if has_summary(out / f"{baseline}_seed{k}.jsonl")}
        ranks = len(next(iter(summaries.values()))["memory"])
        cells = [label, str(len(summaries))]
        for rank in range(ranks):
            peaks = [s["memory"][rank]["peak_bytes"] / 2**20 for s in summaries.values()]
            ratios = [summaries[k]["memory"][rank]["peak_bytes"] / base[rank]["peak_bytes"]
                      for k, base in bases.items()]
            cells += [_ci(mean_interval(peaks), ".0f"), _ci(mean_interval(ratios), ".2f") if ratios else "--"]
        start = statistics.mean(m["start_bytes"] / 2**20 for s in summaries.values() for m in s["memory"])
        step = statistics.mean(s["train_seconds"] / max(s["steps"], 1) for s in summaries.values())
        cells += [f"{start:.0f}", f"{step:.2f}"]
        rows.append((ranks, cells))
    if not rows:
        return ""
    ranks = max(r for r, _ in rows)
    head = ["setting", "seeds"] + [c for r in range(ranks) for c in (f"rank {r} peak MiB", f"rank {r} x {baseline}")]
    lines = ["| " + " | ".join(head + ["start MiB", "s/step"]) + " |", "|" + "---|" * (len(head) + 2)]
    lines += ["| " + " | ".join(cells) + " |" for _, cells in rows]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str, baseline: str = "none") -> Path | None:
    """The frontier: final validation loss difference (percent, paired 95% CI) against bits per value
    averaged over both directions (log axis, 0.5-32), the references' operating points marked
    (:data:`~.ablation.ANCHORS`; MAPL's ~2% at 4-8x and ~3% at 16x compression). None without pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r for r in rows if r["delta_pct"] is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in points:
        mean, low, high = r["delta_pct"]
        bits = (r["forward"] + r["backward"]) / 2
        err = [[0.0], [0.0]] if math.isnan(low) else [[mean - low], [high - mean]]
        ax.errorbar([bits], [mean], yerr=err, fmt="o", capsize=3)
        ax.annotate(r["label"], (bits, mean), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(0, color="grey", lw=0.8)
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    for i, (name, lo, hi) in enumerate(ANCHORS):
        ax.axvspan(lo * 0.98, hi * 1.02, color=f"C{7 + i % 3}", alpha=0.15, lw=0)
        ax.text(lo, 0.02 + 0.07 * i, name, transform=ax.get_xaxis_transform(), fontsize=6)
    ax.plot([4, 8], [2, 2], "k--", lw=1)
    ax.plot([2], [3], "kx")
    ax.text(4, 2.1, "MAPL ~2% (4-8x)", fontsize=6)
    ax.text(2, 3.1, "MAPL ~3% (16x)", fontsize=6)
    ax.set_xscale("log", base=2)
    ax.set_xlim(0.5, 40)
    ax.set_xticks([0.5, 1, 2, 4, 8, 16, 32], ["0.5", "1", "2", "4", "8", "16", "32"])
    ax.set_xlabel("bits per value, mean of both directions (measured, all-in)")
    ax.set_ylabel(f"Δ final val_loss vs {baseline} (%, paired 95% CI)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
