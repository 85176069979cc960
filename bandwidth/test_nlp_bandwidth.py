"""Traffic of the NLP pipeline (an encoder on GLUE) under each boundary codec, one table.

    python bandwidth/test_nlp_bandwidth.py --bandwidth --task rte --data-dir ../shared/data/glue \\
        [--model NAME_OR_DIR | --model-config tiny-roberta] [--max-steps 10] [--batch-size 32] \\
        [--chunk 4] [--client-layers 2] [--settings none,sortquant8,...]

Runs ``--max-steps`` training steps (default 10) per setting -- uncompressed, sort
quantization at 16/12/8/4 bits (Q+S = 12+4, 9+3, 6+2, 3+1), uniform quantization at 8
and 4 bits -- and prints per boundary and direction (``--bandwidth``; else per setting)
raw bytes, wire bytes, wire/raw, receive seconds, recv_bytes/recv_seconds and the run's
samples/s. Every flag of ``test_nlp_dgpipe.py`` (model, data, chunk, partition,
processes) works here as there, except the compression and log flags, which the sweep
sets; ``--train-subset`` defaults to the examples the steps use, ``--eval-subset`` to
one batch. Under torchrun-style variables (e.g. through ``bandwidth/slow_link.py``) it
runs in those ranks. See ``dgpipe/train/sweep.py``.
"""

from __future__ import annotations

import sys

from dgpipe.cli.nlp import build_parser
from dgpipe.train.nlp import GlueJob
from dgpipe.train.sweep import main

if __name__ == "__main__":
    sys.exit(main(GlueJob, build_parser()))
