"""The traffic sweep of the vision job (``dgpipe-sweep vision``; usage: :mod:`dgpipe.cli.sweep`)."""

import sys

from dgpipe.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main(["vision", *sys.argv[1:]]))
