"""The traffic sweep (console script ``dgpipe-sweep``): one main job's pipeline under each boundary
codec, one table.

    dgpipe-sweep vision --bandwidth --data-dir ../shared/data/cifar10-images \\
        [--max-steps 10] [--batch-size 128] [--chunk 4] [--client-layers 1] [--settings none,sortquant8,...]
    dgpipe-sweep nlp --bandwidth --task rte --data-dir ../shared/data/glue \\
        [--model NAME_OR_DIR | --model-config tiny-roberta] [--max-steps 10] [--settings ...]

(``bandwidth/test_cv_bandwidth.py`` and ``bandwidth/test_nlp_bandwidth.py`` are the same
program for one job each.) Runs ``--max-steps`` training steps (default 10) per setting --
uncompressed, sort quantization at 16/12/8/4 bits (Q+S = 12+4, 9+3, 6+2, 3+1), uniform
quantization at 8 and 4 bits -- and prints per boundary and direction (``--bandwidth``;
else per setting) raw bytes, wire bytes, wire/raw, receive seconds,
recv_bytes/recv_seconds and the run's samples/s. Every flag of the job's main CLI (model,
data, chunk, partition, processes) works here as there, except the compression and log
flags, which the sweep sets; ``--train-subset`` defaults to the examples the steps use,
``--eval-subset`` to one batch. Under torchrun-style variables (e.g. through
``bandwidth/slow_link.py``) it runs in those ranks. See :mod:`dgpipe.train.sweep`.
"""

from __future__ import annotations

import sys

from dgpipe.train import sweep
from dgpipe.train.nlp import GlueJob
from dgpipe.train.vision import VisionJob

from . import entry_point, nlp, vision

__all__ = ["JOBS", "main", "console"]

#: The jobs a sweep runs: name -> (job class, its main CLI's parser builder).
JOBS = {"vision": (VisionJob, vision.build_parser), "nlp": (GlueJob, nlp.build_parser)}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``main([JOB, *flags])``: the sweep of job ``vision`` or ``nlp`` with that job's flags; the exit status
    (2, with a one-line error, for a missing or unknown job)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in JOBS:
        got = f"got {argv[0]!r}" if argv else "got none"
        print(f"usage: {prog or 'dgpipe-sweep'} {{{','.join(JOBS)}}} [flags of that job]\n"
              f"error: the first argument names the job ({' or '.join(JOBS)}); {got}", file=sys.stderr)
        return 2
    job_cls, build_parser = JOBS[argv[0]]
    return sweep.main(job_cls, build_parser(f"{prog or 'dgpipe-sweep'} {argv[0]}"), argv[1:])


#: The ``dgpipe-sweep`` console script.
console = entry_point(main)
