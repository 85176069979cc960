"""Language-model main job: a decoder LM (Llama, Qwen, Gemma 3, GPT-2 families) pretrained or
fine-tuned on a text corpus through a compressed GPipe pipeline (the same program as the
``dgpipe-lm`` console script; flags: ``--help``)."""

from dgpipe.cli.lm import build_parser, main  # noqa: F401
from dgpipe.pipeline import exit_without_teardown

if __name__ == "__main__":
    exit_without_teardown(main())  # a rank under torchrun: see dgpipe.pipeline.exit_without_teardown
