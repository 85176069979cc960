"""A fine-tuned run out through ``dgpipe-lm export`` and scored in transformers alone: the exported folder's held-out
loss (mean token NLL over the run's evaluation blocks, assistant tokens for chat data) beside the run's own last
``val_loss`` (uncompressed evaluation: codec none).

    python benchmarks/lm_export_check.py CHECKPOINT_DIR RUN_LOG OUT_DIR [--autocast bf16]

``--autocast bf16`` scores under ``torch.autocast`` as a ``--precision bf16`` run evaluates. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F

from dgpipe.train.export import export
from dgpipe.train.lm import token_blocks
from dgpipe.train.runlog import read_summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("log")
    ap.add_argument("out")
    ap.add_argument("--autocast", choices=["bf16"])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    run = export(args.checkpoint, args.out, overwrite=True)
    model = AutoModelForCausalLM.from_pretrained(args.out).eval()
    a = run.args
    blocks = token_blocks(a["data_dir"], a["eval_split"], run.tokenizer, a["block_length"], a["eval_subset"])
    nll = tokens = 0.0
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
    with torch.no_grad(), cast:
        for k in range(0, len(blocks), 8):
            x = torch.stack([blocks[i][0] for i in range(k, min(k + 8, len(blocks)))])
            y = torch.stack([blocks[i][1] for i in range(k, min(k + 8, len(blocks)))])
            logits = model(x).logits.float()
            nll += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            tokens += int((y != -100).sum())
    summary = read_summary(args.log)
    print(json.dumps({"checkpoint": args.checkpoint, "step": run.step, "run_val_loss": summary["value"],
                      "transformers_val_loss": nll / tokens, "autocast": args.autocast,
                      "relative_difference": nll / tokens / summary["value"] - 1}))


if __name__ == "__main__":
    main()
