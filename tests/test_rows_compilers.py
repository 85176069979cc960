"""The row kernels (``kernels/rows.c``) built by the oldest compilers the project supports, GCC 11 and
clang 14, with ``setup.py``'s own flags (``benchmarks/rows_compilers.py``'s ``build_rows``), give the
reference steps' payloads and decoded values bit for bit (the checks of ``test_fused.py`` on that
library). Skipped, with the reason, where a compiler is not installed (Debian: ``apt-get install gcc-11
clang-14``); the default compiler's build is the installed extension, which ``test_fused.py`` checks.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

from dgpipe.compression import get_codec
from dgpipe.compression.kernels import backend, rows
from helpers import ROOT
from test_fused import eager_and_fused, row_inputs  # noqa: F401  (eager_and_fused: a fixture)

COMPILERS = ("gcc-11", "clang-14")


def build_rows(cc: str, out: Path) -> Path:
    """``benchmarks/rows_compilers.py``'s :func:`build_rows` (a script, loaded from its file)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("rows_compilers", ROOT / "benchmarks" / "rows_compilers.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module.build_rows(cc, out)


@pytest.fixture(scope="module", params=COMPILERS)
def built(request, tmp_path_factory) -> Path:
    """The extension built by one compiler into a temporary folder; its path."""
    cc = request.param
    if shutil.which(cc) is None:
        pytest.skip(f"{cc} is not installed")
    return build_rows(cc, tmp_path_factory.mktemp(cc))


@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_rows_built_by_each_compiler_equal_the_steps(built, eager_and_fused, monkeypatch, bits):  # noqa: F811
    monkeypatch.setitem(rows._lib, "lib", rows.open_library(str(built)))
    monkeypatch.setattr(backend, "MIN_CHUNKS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(backend, "_kernels", {})  # the keys of the kernels taken in this test alone
    for rotate in ("hadamard", "none"):
        codec = get_codec("codebook", bits=bits, group="token", rotate=rotate, scale_dtype="bfloat16")
        for x in row_inputs(seed=bits).values():
            eager_and_fused(codec, x)
    assert ("encode_rows", "c") in backend._kernels and ("decode_rows", "c") in backend._kernels
