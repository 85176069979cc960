"""``dgpipe-lm export``: a language-model run's newest complete checkpoint as a Hugging Face model folder
(:mod:`dgpipe.train.export`). Parser and entry point."""

from __future__ import annotations

import argparse

from dgpipe.train.flags import JobParser

DESCRIPTION = """\
Gather every stage's weights from the newest checkpoint that all ranks of a dgpipe-lm run completed (its --save
folder; a multi-machine run's rank files copied into one folder) into a Hugging Face model folder: config.json,
model.safetensors, generation_config.json and the tokenizer, LoRA adapters merged (--adapter-only: a peft adapter
folder instead). It loads with transformers' AutoModelForCausalLM.from_pretrained(OUT_DIR)."""

EPILOG = """\
example:
  %(prog)s runs/smollm2-lora runs/smollm2-lora-hf
  python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('runs/smollm2-lora-hf')\""""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Flags of ``dgpipe-lm export``."""
    p = JobParser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="the run's --save folder")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the model folder to write (new or empty)")
    p.add_argument("--adapter-only", action="store_true",
                   help="write the LoRA adapters as a peft adapter folder (adapter_config.json, "
                        "adapter_model.safetensors) instead of the merged model")
    p.add_argument("--overwrite", action="store_true", help="write into OUT_DIR even if it is not empty")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse, export; a bad folder or a run that cannot be exported exits 2 with a one-line reason."""
    from dgpipe.train.export import export

    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        run = export(args.checkpoint_dir, args.out_dir, args.adapter_only, args.overwrite)
    except ValueError as e:
        parser.error(str(e))
    what = "peft adapters" if args.adapter_only else "model"
    print(f"wrote the {what} of step {run.step} of {args.checkpoint_dir} to {args.out_dir}")
    return 0
