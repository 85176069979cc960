"""Probe a link between two ranks (the same program as the ``dgpipe-probe`` console script;
usage: ``dgpipe/cli/probe.py``'s docstring, flags: ``--help``)."""

import sys

from dgpipe.cli.probe import main, message_sizes, parse_size  # noqa: F401  (names the tests use)

if __name__ == "__main__":
    sys.exit(main())
