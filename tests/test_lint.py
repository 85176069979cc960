"""The package passes ``ruff check`` (pyflakes and pycodestyle, ``ruff.toml``): no unused names or imports,
no undefined names, lines of at most 120 characters. ruff comes with the ``test`` extra."""

import subprocess
import sys

import pytest

from helpers import ROOT

pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[test]')")


def test_the_package_passes_ruff():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "dgpipe"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
