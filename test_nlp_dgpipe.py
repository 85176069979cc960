"""NLP main job: a BERT/RoBERTa-family encoder fine-tuned on GLUE through a compressed
GPipe pipeline (the same program as the ``dgpipe-nlp`` console script; flags: ``--help``)."""

from dgpipe.cli.nlp import build_parser, main  # noqa: F401  (build_parser: for the bandwidth sweep)
from dgpipe.pipeline import exit_without_teardown

if __name__ == "__main__":
    exit_without_teardown(main())  # a rank under torchrun: see dgpipe.pipeline.exit_without_teardown
