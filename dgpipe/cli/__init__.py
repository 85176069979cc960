"""The command-line programs: ``dgpipe-nlp`` (:mod:`.nlp`), ``dgpipe-vision`` (:mod:`.vision`)
and ``dgpipe-probe`` (:mod:`.probe`). Each module is thin: a parser and a ``main(argv)``
that hands over to :mod:`dgpipe.train` (or :mod:`dgpipe.comm.probe`). The repository-root
scripts ``test_nlp_dgpipe.py`` and ``test_vision_dgpipe.py`` run the same ``main``."""
