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

from .plots import ablation_points, plot
from dgpipe.train.runlog import direction_bits, read_records, read_summary

#: How each job's CLI is run (after ``python``): the main jobs' modules.
CLIS = {"vision": ["-m", "dgpipe.cli", "vision"], "nlp": ["-m", "dgpipe.cli", "nlp"], "lm": ["-m", "dgpipe.cli", "lm"]}

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

#: Data-parallel gradient compression (docs/data-parallel.md).
_DP = ["--mode", "dataparallel", "--grad-compression"]
DDP_SETTINGS: dict[str, list[str]] = {
    "ddp_none": ["--mode", "dataparallel"],
    "ddp_fp16": _DP + ["fp16"],
    "ddp_powersgd1": _DP + ["powersgd", "--grad-compression-opt", "matrix_approximation_rank=1"],
    "ddp_powersgd4": _DP + ["powersgd", "--grad-compression-opt", "matrix_approximation_rank=4"],
    "ddp_topk_ef": _DP + ["topk", "--grad-compression-opt", "ratio=0.01",
                          "--grad-compression-opt", "error_feedback=true"],
    "ddp_randomk": _DP + ["randomk", "--grad-compression-opt", "ratio=0.01"],
    "ddp_onebit_ef": _DP + ["onebit", "--grad-compression-opt", "error_feedback=true"],
    "ddp_qsgd4": _DP + ["qsgd", "--grad-compression-opt", "levels=4"],
    "ddp_qsgd4_b512": _DP + ["qsgd", "--grad-compression-opt", "levels=4", "--grad-compression-opt", "bucket_size=512"],
    "ddp_terngrad": _DP + ["terngrad"],
    "ddp_dgc": _DP + ["dgc", "--grad-compression-opt", "warmup_epochs=2"],
    "ddp_atomo4": _DP + ["atomo", "--grad-compression-opt", "budget=4"],
}


def _codebook(bits: int | None, flag: str = "--codec", count: int | None = None) -> list[str]:
    """Flags of the codebook codec at ``bits`` bits (or ``count`` levels, radix-packed): per-token RMS scale
    (bfloat16) after a Hadamard rotation."""
    size = f"bits={bits}" if count is None else f"count={count}"
    opts = [size, "levels=normal", "group=token", "rotate=hadamard", "scale_dtype=bfloat16"]
    return [flag, "codebook"] + [x for o in opts for x in (f"{flag}-opt", o)]


def _subspace(rank: int, bits: int | None, flag: str = "--codec", count: int | None = None) -> list[str]:
    """Flags of the subspace codec: ``rank`` directions per message in bfloat16 factors, the residual
    through the ``bits``-bit (or ``count``-level) codebook (token groups, Hadamard, bfloat16 scales: the
    codec's defaults; ``bits=0``: no residual)."""
    size = f"bits={bits}" if count is None else f"count={count}"
    return [flag, "subspace", f"{flag}-opt", f"rank={rank}", f"{flag}-opt", size]


#: Low-bit boundary codecs against the 8-bit ones (the quality benchmark, docs/quality.md); gradients at 4 bits
#: with the same codebook where the forward direction goes below 4.
LOWBIT_SETTINGS: dict[str, list[str]] = {
    "none": [],
    "sortquant8": PIPELINE_SETTINGS["sortquant8"],
    "sortquant4": PIPELINE_SETTINGS["sortquant4"],
    "quant4": PIPELINE_SETTINGS["quant4"],
    "codebook4": _codebook(4),
    "codebook3_g4": _codebook(3) + _codebook(4, "--grad-codec"),
    "codebook2_g4": _codebook(2) + _codebook(4, "--grad-codec"),
    "codebook2_g2": _codebook(2) + _codebook(2, "--grad-codec"),
    # 5 levels both ways (2.33 bits a value radix-packed, between the 2- and 3-bit codebooks)
    "codebook5lv_g5lv": _codebook(None, count=5) + _codebook(None, "--grad-codec", count=5),
    # 2 dominant directions per message exactly, the rest by the 2-bit codebook (2.26 bits a value)
    "subspace2": _subspace(2, 2) + _subspace(2, 2, "--grad-codec"),
    # the most accurate code within 2.5 bits a value, both ways (2.49 on 256 x 384 messages; 0.036-0.059 of
    # the energy left on MiniLM's boundaries, about the 3-bit codebook's error going forward)
    "subspace1lv5": _subspace(1, None, count=5) + _subspace(1, None, "--grad-codec", count=5),
    # the same gradients, 5 levels forward: on the real tokens rank 1 gains nothing going forward (its one direction
    # codes the padding rows), so its 0.1 bit is left out there (2.40 / 2.49 bits a value)
    "codebook5lv_gsub1lv5": _codebook(None, count=5) + _subspace(1, None, "--grad-codec", count=5),
    # under 1 bit a value averaged over both directions: the 1-bit codebook forward (1.05), the gradients'
    # 8 dominant directions alone (0.84 on a 256 x 384 message)
    "codebook1_gsub8": _codebook(1) + _subspace(8, 0, "--grad-codec"),
}

#: Per-example dropout masks (``--example-dropout``, the same masks at every visit): the uncompressed
#: pair (run with ``--baseline exdrop``) and the delta-coded settings that revisits should favour.
EXAMPLE_DROPOUT_SETTINGS: dict[str, list[str]] = {
    "exdrop": ["--example-dropout"],
    **{f"delta_{label}_exdrop_eval32": LOWBIT_SETTINGS[label] + ["--delta", "--example-dropout", "--no-compress-eval"]
       for label in ("codebook2_g2", "codebook1_gsub8")},
}

_LOWBIT_CODEBOOKS = ("codebook4", "codebook3_g4", "codebook2_g4", "codebook2_g2", "codebook5lv_g5lv", "subspace2",
                     "subspace1lv5", "codebook5lv_gsub1lv5", "codebook1_gsub8")

#: Delta coding against per-example caches (AQ-SGD, docs/delta.md) with the codebook codec at 4, 3 and 2
#: bits as the inner codec, beside the same codecs without delta; run them for >= 3 epochs so that
#: every training example is revisited.
DELTA_SETTINGS: dict[str, list[str]] = {
    "none": [],
    **{label: LOWBIT_SETTINGS[label] for label in _LOWBIT_CODEBOOKS},
    **{f"delta_{label}": LOWBIT_SETTINGS[label] + ["--delta"] for label in _LOWBIT_CODEBOOKS},
    "sortquant4": PIPELINE_SETTINGS["sortquant4"],
    "delta_sortquant4": PIPELINE_SETTINGS["sortquant4"] + ["--delta"],
    # The same pairs evaluated uncompressed: delta trains on reconstructions far closer to the
    # activations than direct low-bit coding, which is what compressed evaluation (no cache) still sees.
    **{f"{prefix}{label}_eval32": LOWBIT_SETTINGS[label] + flags + ["--no-compress-eval"]
       for label in _LOWBIT_CODEBOOKS
       for prefix, flags in (("", []), ("delta_", ["--delta"]))},
    # Direct coding against the per-token reference (--token-reference): evaluated through the link, where
    # no delta cache exists; the token ids count against the forward direction
    **{f"ref_{label}": LOWBIT_SETTINGS[label] + ["--token-reference"]
       for label in ("codebook2_g2", "codebook5lv_gsub1lv5")},
}

#: The language-model benchmark (docs/lm.md): the 8-bit codecs, the 4-bit codebook, the best settings within
#: 2.5 bits a value averaged over both directions -- 5 levels forward, the gradients' dominant direction plus
#: 4 levels backward (2.48 / 2.30 on 4 x 128 x 128 messages; the 5-level residual of the encoder benchmark
#: needs 2.64 at this width), directly and against the per-token reference -- and the best under 1 bit: the
#: 1-bit codebook forward, the gradients' 4 dominant directions alone backward (1.14 / 0.64).
LM_SETTINGS: dict[str, list[str]] = {
    "none": [],
    "sortquant8": PIPELINE_SETTINGS["sortquant8"],
    "quant8": PIPELINE_SETTINGS["quant8"],
    "codebook4": _codebook(4),
    "codebook5lv_gsub1lv4": _codebook(None, count=5) + _subspace(1, None, "--grad-codec", count=4),
    "ref_codebook5lv_gsub1lv4": _codebook(None, count=5) + _subspace(1, None, "--grad-codec", count=4)
    + ["--token-reference"],
    "codebook1_gsub4": _codebook(1) + _subspace(4, 0, "--grad-codec"),
    # 5 levels both ways (2.48 bits), the gradients rounded to the nearest level or stochastically (unbiased
    # inside the outer levels)
    "codebook5lv_gcb5lv": _codebook(None, count=5) + _codebook(None, "--grad-codec", count=5),
    "codebook5lv_gcb5lv_sr": _codebook(None, count=5) + _codebook(None, "--grad-codec", count=5)
    + ["--grad-codec-opt", "stochastic=true"],
    # one direction at a time (the other uncompressed): which of the two costs the 2.4-bit setting its loss
    "codebook5lv_only": _codebook(None, count=5) + ["--grad-codec", "none"],
    "gsub1lv4_only": _subspace(1, None, "--grad-codec", count=4),
    # 5 levels both ways against the per-token reference with the channels weighed and the first positions and
    # unseen tokens backing off to shared rows (--token-reference-scale, --token-reference-backoff)
    "refscaledbackoff_codebook5lv_gcb5lv": _codebook(None, count=5) + _codebook(None, "--grad-codec", count=5)
    + ["--token-reference", "--token-reference-scale", "--token-reference-backoff"],
}

#: The pretraining benchmark with boundary bottlenecks (docs/lm.md): ``--bottleneck D`` channels of the small Llama's
#: 128 cross each way (from a random orthonormal basis, trained with the model), alone and with codes on top; bits a
#: value counted against the width 128: ``D / 128`` of the codec's bits.
LM_BOTTLENECK_SETTINGS: dict[str, list[str]] = {
    # anchored (--bottleneck-anchor): the pairs code the residual stream less the token embedding, rebuilt from the
    # ids on the far side (the ids cross losslessly: ~0.1 bit a value forward at this width)
    "abneck16ch_quant6": ["--bottleneck", "16", "--bottleneck-anchor", "--quant", "6"],  # 0.75 bit + ids
    "abneck16ch": ["--bottleneck", "16", "--bottleneck-anchor"],  # 4 bits + ids
    "abneck8ch_quant8": ["--bottleneck", "8", "--bottleneck-anchor", "--quant", "8"],  # 0.5 bit + ids
    "abneck4ch_quant8": ["--bottleneck", "4", "--bottleneck-anchor", "--quant", "8"],  # 0.25 bit + ids
    "abneck32ch_quant3": ["--bottleneck", "32", "--bottleneck-anchor", "--quant", "3"],  # 0.75 bit + ids
    # plain pairs
    "bneck16ch_quant6": ["--bottleneck", "16", "--quant", "6"],  # 0.75 bit
    "bneck32ch_quant3": ["--bottleneck", "32", "--quant", "3"],  # 0.75 bit
    "bneck4ch_quant8": ["--bottleneck", "4", "--quant", "8"],  # 0.25 bit
    "bneck16ch": ["--bottleneck", "16"],  # 4 bits
    "bneck8ch_quant8": ["--bottleneck", "8", "--quant", "8"],  # 0.5 bit
    "bneck4ch": ["--bottleneck", "4"],  # 1 bit
    "bneck8ch": ["--bottleneck", "8"],  # 2 bits
    "bneck32ch": ["--bottleneck", "32"],  # 8 bits
    "bneck64ch": ["--bottleneck", "64"],  # 16 bits
    "bneck32ch_codebook4": ["--bottleneck", "32"] + _codebook(4),  # 1.1 bits
    "bneck64ch_codebook2": ["--bottleneck", "64"] + _codebook(2),  # 1.1 bits
}

#: The fine-tuning benchmark of a pretrained decoder (docs/lm.md): the language-model settings, 5 levels both ways
#: directly, against the per-token reference, against it with the channels weighed, and with the first positions
#: and unseen tokens backing off to shared rows too (2.37 bits a value on SmolLM2's 576-wide messages), and the same
#: runs evaluated uncompressed (``_eval32``: what fine-tuning through the codec cost the weights, apart from what
#: the link costs the evaluation).
LM_FINETUNE_SETTINGS: dict[str, list[str]] = {
    **LM_SETTINGS,
    "ref_codebook5lv_gcb5lv": LM_SETTINGS["codebook5lv_gcb5lv"] + ["--token-reference"],
    "refscaled_codebook5lv_gcb5lv": LM_SETTINGS["codebook5lv_gcb5lv"] + ["--token-reference",
                                                                           "--token-reference-scale"],
    "refbackoff_codebook5lv_gcb5lv": LM_SETTINGS["codebook5lv_gcb5lv"] + ["--token-reference",
                                                                            "--token-reference-backoff"],
    **{f"{label}_eval32": LM_SETTINGS[label] + ["--no-compress-eval"]
       for label in ("codebook4", "codebook5lv_gcb5lv", "refscaledbackoff_codebook5lv_gcb5lv")},
}

#: Fine-tuning SmolLM2 (576 wide) with boundary bottlenecks started from the boundary states' principal components
#: (``--model``: ``--bottleneck-init auto``), alone and with codes on top; bits a value against the width 576.
LM_FINETUNE_BOTTLENECK_SETTINGS: dict[str, list[str]] = {
    "bneck72ch": ["--bottleneck", "1/8"],  # 4 bits
    "bneck72ch_quant7": ["--bottleneck", "1/8", "--quant", "7"],  # 0.875 bit
    "bneck72ch_codebook4": ["--bottleneck", "1/8"] + _codebook(4),  # 0.53 bit
    "bneck36ch_quant8": ["--bottleneck", "1/16", "--quant", "8"],  # 0.5 bit
    # the pairs distilled to the model's own outputs (--distill: the model frozen), at a pair's learning rate
    "distill_bneck72ch": ["--bottleneck", "1/8", "--distill", "--lr", "1e-3"],  # 4 bits
    "distill_bneck72ch_codebook4": ["--bottleneck", "1/8", "--distill", "--lr", "1e-3"] + _codebook(4),  # 0.92 bit
}

#: Fine-tuning SmolLM2 on instruction data the way LMs are fine-tuned (``benchmarks/lm_finetune.py --chat``): against
#: the full float32 fine-tune (``none``, lr 3e-5), LoRA r=8 (alpha 16, lr 1e-3: +0.35% where 2e-4 left +4.9%, one
#: seed) in bf16, with activation checkpointing, and with the 2.38-bit link of the fine-tuning table (5-level
#: codebooks both ways, token reference).
LM_CHAT_SETTINGS: dict[str, list[str]] = {
    "lora8_bf16": ["--lora", "8", "--lora-alpha", "16", "--lr", "1e-3", "--precision", "bf16"],
    "lora8_bf16_ckpt": ["--lora", "8", "--lora-alpha", "16", "--lr", "1e-3", "--precision", "bf16",
                        "--activation-checkpointing"],
    "lora8_bf16_ckpt_link": ["--lora", "8", "--lora-alpha", "16", "--lr", "1e-3", "--precision", "bf16",
                             "--activation-checkpointing",
                             *LM_FINETUNE_SETTINGS["refscaledbackoff_codebook5lv_gcb5lv"]],
}

SETTINGS = {"pipeline": PIPELINE_SETTINGS, "ddp": DDP_SETTINGS, "lowbit": LOWBIT_SETTINGS, "delta": DELTA_SETTINGS,
            "exdrop": EXAMPLE_DROPOUT_SETTINGS, "lm": LM_SETTINGS, "lm_finetune": LM_FINETUNE_SETTINGS,
            "lm_bottleneck": {"none": [], **LM_BOTTLENECK_SETTINGS},
            "lm_finetune_bottleneck": {"none": [], **LM_FINETUNE_BOTTLENECK_SETTINGS},
            "lm_chat": {"none": [], **LM_CHAT_SETTINGS}}


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

