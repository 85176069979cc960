"""The quality benchmark (usage and flags: :mod:`dgpipe.train.ablation`, or ``--help``)."""

import sys

from dgpipe.train.ablation import main

if __name__ == "__main__":
    sys.exit(main())
