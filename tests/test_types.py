"""The package passes the type checker (mypy, ``mypy.ini``) but for the findings recorded in
``tests/mypy_baseline.txt``: a new finding fails the test. The baseline holds each finding as
``path: [code] message`` (line numbers left out, so that edits elsewhere in a file do not move it), one per
line, repeated as often as it occurs; fixing one is taking its line out. mypy comes with the ``test`` extra.
The findings depend on torch's type stubs: the baseline's first line names the torch release it was
recorded with (CI's), and under another one the test skips.

    python -m mypy dgpipe        # the findings, with line numbers
"""

import collections
import re
import subprocess
import sys

import pytest
import torch

from helpers import ROOT

pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")

BASELINE = ROOT / "tests" / "mypy_baseline.txt"
FINDING = re.compile(r"^(?P<path>[^:]+):\d+: error: (?P<message>.*?)\s+\[(?P<code>[a-z-]+)\]$")


def findings(output: str) -> collections.Counter:
    """The errors of mypy's ``output`` as ``path: [code] message`` (line numbers in messages left out too)."""
    found: collections.Counter = collections.Counter()
    for line in output.splitlines():
        m = FINDING.match(line.strip())
        if m:
            message = re.sub(r"line \d+", "line N", m["message"])
            found[f"{m['path']}: [{m['code']}] {message}"] += 1
    return found


def test_the_package_has_no_new_type_errors():
    header, *lines = BASELINE.read_text().splitlines()
    recorded = header.removeprefix("# recorded with torch ").strip()
    if ".".join(torch.__version__.split("+")[0].split(".")[:2]) != recorded:
        pytest.skip(f"the baseline holds torch {recorded}'s findings; this is torch {torch.__version__}")
    done = subprocess.run([sys.executable, "-m", "mypy", "dgpipe"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 2: mypy itself failed
    baseline = collections.Counter(line for line in lines if line.strip())
    new = findings(done.stdout) - baseline
    assert not new, "new type errors (python -m mypy dgpipe):\n" + "\n".join(sorted(new.elements()))
