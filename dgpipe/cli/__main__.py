"""``python -m dgpipe.cli JOB [flags]``: the main job ``vision``, ``nlp`` or ``lm`` without its console script
(how the quality benchmark, :mod:`dgpipe.experiments.ablation`, runs one); flags as ``dgpipe-JOB --help``."""

import sys

from dgpipe.pipeline import exit_without_teardown

from . import lm, nlp, vision

JOBS = {"vision": vision.main, "nlp": nlp.main, "lm": lm.main}

if len(sys.argv) < 2 or sys.argv[1] not in JOBS:
    print(f"usage: python -m dgpipe.cli {{{','.join(JOBS)}}} [flags of that job]", file=sys.stderr)
    sys.exit(2)
exit_without_teardown(JOBS[sys.argv[1]](sys.argv[2:], prog=f"dgpipe-{sys.argv[1]}"))
