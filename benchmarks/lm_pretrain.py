"""The language-model pretraining benchmark (docs/lm.md): a small Llama (the ``small-llama`` preset,
6 blocks of width 128, a 4,096-token byte-level BPE) pretrained from scratch on wiki-excerpt for 600
steps of 16 x 128 tokens, 4 linear stages on 4 processes, under every setting of
``dgpipe.experiments.settings.LM_SETTINGS`` and 3 seeds; then the report of :mod:`dgpipe.experiments.lm_benchmark`
(``OUT/lm.md``, ``OUT/frontier.png``).

    python benchmarks/lm_pretrain.py [--out DIR] [--seeds 0,1,2] [--only none,codebook4] [--no-run]
        [--settings lm|lm_bottleneck] [--target-step N] [--baseline LABEL]

``--target-step N`` takes as each seed's target the uncompressed run's validation loss at step ``N`` (an evaluated
step: a multiple of 50) instead of its final one, so settings that do not reach the final loss still get a
steps-to-target ratio and a time to the target on each link; the report goes to ``OUT/lm_target_N.md``.
``--baseline LABEL`` pairs every setting with ``LABEL``'s run of the same seed instead of the uncompressed one
(its loss the target; the report in ``OUT/lm_vs_LABEL.md``, with ``--target-step``
``OUT/lm_vs_LABEL_target_N.md``): e.g. the model with stage tables at its full width.

``--settings lm_bottleneck`` runs ``dgpipe.experiments.settings.LM_BOTTLENECK_SETTINGS`` (boundary bottlenecks) instead,
into ``benchmarks/results/lm_bottleneck`` by default, whose uncompressed logs link to this benchmark's.

Resumable: a run whose log holds a summary is not run again (the runs go through
``dgpipe.experiments.ablation``, which also writes its generic ``table.md``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dgpipe.experiments import ablation, lm_benchmark
from dgpipe.train.runlog import read_summary

ROOT = Path(__file__).resolve().parents[1]
#: The flags every run shares (the benchmark's command, besides the setting and the seed).
COMMON = ["--data-dir", str(ROOT.parent / "shared" / "data" / "text" / "wiki-excerpt"), "--model-config", "small-llama",
          "--partition", "linear", "--stages", "4", "--world-size", "4", "--batch-size", "16", "--chunk", "4",
          "--block-length", "128", "--lr", "2e-3", "--epochs", "2", "--max-steps", "600", "--eval-every", "50",
          "--eval-subset", "400", "--num-workers", "0"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="default: benchmarks/results/lm_pretrain (lm_bottleneck: .../lm_bottleneck)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--only", help="comma-separated subset of the settings")
    p.add_argument("--no-run", action="store_true", help="tabulate the logs already there, run nothing")
    p.add_argument("--settings", choices=["lm", "lm_bottleneck"], default="lm",
                   help="lm_bottleneck: the boundary-bottleneck settings instead")
    p.add_argument("--timing", default=str(ROOT / "benchmarks" / "results" / "lm_link_latency"),
                   help="folder of benchmarks/lm_link_latency.py, whose 4-stage loopback runs give each setting's "
                        "compute per step (measured side by side on a quiet machine)")
    p.add_argument("--target-step", type=int, help="the uncompressed run's step whose validation loss is the target")
    p.add_argument("--baseline", default="none", help="the setting every other is paired with (default: none)")
    args = p.parse_args(argv)
    if args.target_step is not None and not (0 < args.target_step <= 600 and args.target_step % 50 == 0):
        p.error(f"--target-step must be an evaluated step: a multiple of 50 in 50-600; got {args.target_step}")
    folder = {"lm": "lm_pretrain", "lm_bottleneck": "lm_bottleneck"}[args.settings]
    args.out = args.out or str(ROOT / "benchmarks" / "results" / folder)
    labels = args.only.split(",") if args.only else list(ablation.SETTINGS[args.settings])
    run = ["--job", "lm", "--settings", args.settings, "--seeds", args.seeds, "--out", args.out,
           "--only", ",".join(labels), "--title", "small Llama pretraining, wiki-excerpt, 4 stages"]
    status = ablation.main(run + ["--baseline", args.baseline] + (["--no-run"] if args.no_run else [])
                           + ["--", *COMMON])
    out, seeds = Path(args.out), [int(k) for k in args.seeds.split(",")]
    timing = Path(args.timing)
    compute = {}
    for label in labels:
        log = timing / f"4stages_{label}_loopback.jsonl"
        if ablation.has_summary(log):
            s = read_summary(log)
            compute[label] = s["train_seconds"] / s["steps"]
    rows = lm_benchmark.results(out, labels, seeds, args.baseline, compute_seconds=compute,
                                target_step=args.target_step)
    name = ("lm" if args.baseline == "none" else f"lm_vs_{args.baseline}") + (
        "" if args.target_step is None else f"_target_{args.target_step}") + ".md"
    if rows:
        text = lm_benchmark.table(rows, args.baseline)
        (out / name).write_text(text + "\n")
        print(text)
    if rows and name == "lm.md":
        lm_benchmark.plot(rows, out / "frontier.png", "small Llama pretraining, wiki-excerpt, 4 stages: "
                          f"{len(seeds)} paired seeds")
    return status


if __name__ == "__main__":
    sys.exit(main())
