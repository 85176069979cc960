"""The quality benchmark (usage and flags: :mod:`dgpipe.experiments.ablation`, or ``--help``)."""

import sys

from dgpipe.experiments.ablation import main

if __name__ == "__main__":
    sys.exit(main())
