"""The ablation plot of run logs (usage and flags: :mod:`dgpipe.experiments.plots`, or ``--help``)."""

import sys

from dgpipe.experiments.plots import ablation_points, main, plot  # noqa: F401  (names the tests use)

if __name__ == "__main__":
    sys.exit(main())
