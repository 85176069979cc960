"""NLP main job: a RoBERTa/BERT encoder fine-tuned on GLUE through a compressed GPipe pipeline.

By default a client (rank 0: embeddings, the first and last --client-layers encoder
layers, the head) and a server (rank 1: the layers in between) fine-tune one model,
with the hidden states and their gradients compressed on the link (the attention mask
travels losslessly); --mode dataparallel runs the DDP baseline instead. Example:

    python test_nlp_dgpipe.py --task rte --data-dir ../shared/data/glue \\
        --sortquant --quant 6 --split 2 --chunk 4 --log runs/rte_sq8.jsonl

Offline, without pretrained weights: --model-config tiny-roberta (random init, offline
tokenizer). Under torchrun (one process per rank) the same flags apply.
"""

from __future__ import annotations

import argparse

from dgpipe.data import GLUE_TASKS
from dgpipe.pipeline import exit_without_teardown
from dgpipe.train import loop
from dgpipe.train.args import common_parser
from dgpipe.train.nlp import TINY_CONFIGS, GlueJob


def build_parser() -> argparse.ArgumentParser:
    """The common flags plus the GLUE job's own."""
    p = common_parser(__doc__.split("\n\n")[0], batch_size=32, lr=2e-5, epochs=3, client_layers=2, data_dir=None,
                      data_dir_help="GLUE folder in the original TSV layout (e.g. ../shared/data/glue with "
                                    "RTE/train.tsv); default: datasets.load_dataset('nyu-mll/glue', task) online")
    n = p.add_argument_group("encoder on GLUE")
    n.add_argument("--task", choices=sorted(GLUE_TASKS), default="rte")
    n.add_argument("--model", default="roberta-base", metavar="NAME_OR_DIR",
                   help="AutoModelForSequenceClassification checkpoint (BERT/RoBERTa family): hub name or local dir")
    n.add_argument("--model-config", metavar="|".join(TINY_CONFIGS) + "|PATH",
                   help="random initialisation from a config instead of --model's weights: a preset or a "
                        "config.json / model directory (no download)")
    n.add_argument("--tokenizer", metavar="offline|NAME_OR_DIR",
                   help="default: --model's tokenizer; with --model-config: 'offline' (a WordPiece vocabulary "
                        "trained on the task's training texts)")
    n.add_argument("--max-length", type=int, default=128, help="tokens per example (padded/truncated)")
    n.add_argument("--heldout", type=int, default=0, metavar="N",
                   help="hold out N training examples (a fixed, class-stratified choice, the same for every seed) "
                        "that training never sees, and evaluate on them too: metrics heldout_*")
    n.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (not on biases and norms)")
    n.add_argument("--warmup-ratio", type=float, default=0.06, help="fraction of steps of linear warm-up")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse, validate (errors exit with status 2 before any process starts), train."""
    return loop.main(GlueJob, build_parser(), argv)


if __name__ == "__main__":
    exit_without_teardown(main())  # a rank under torchrun: see dgpipe.pipeline.exit_without_teardown
