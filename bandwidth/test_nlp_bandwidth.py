"""The traffic sweep of the nlp job (``dgpipe-sweep nlp``; usage: :mod:`dgpipe.cli.sweep`)."""

import sys

from dgpipe.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main(["nlp", *sys.argv[1:]]))
