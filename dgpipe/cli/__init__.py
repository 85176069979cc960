"""The command-line programs: ``dgpipe-nlp`` (:mod:`.nlp`), ``dgpipe-vision`` (:mod:`.vision`),
``dgpipe-lm`` (:mod:`.lm`) and ``dgpipe-probe`` (:mod:`.probe`). Each module is thin: a parser and a ``main(argv)``
that hands over to :mod:`dgpipe.train` (or :mod:`dgpipe.comm.probe`). The repository-root
scripts ``test_nlp_dgpipe.py``, ``test_vision_dgpipe.py`` and ``test_lm_dgpipe.py`` run the same ``main``."""

from __future__ import annotations

import os
import sys
from typing import Callable


def entry_point(main: Callable[..., int]) -> Callable[[], None]:
    """A console script's entry point: ``main(prog=<the script's name>)``, then exit with its
    status through :func:`dgpipe.pipeline.exit_without_teardown` (a rank under torchrun must
    not run the interpreter's teardown with torch threads alive)."""

    def console() -> None:
        from dgpipe.pipeline import exit_without_teardown

        exit_without_teardown(main(prog=os.path.basename(sys.argv[0])))

    return console
