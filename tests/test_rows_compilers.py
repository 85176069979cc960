"""The row kernels (``kernels/rows.c``) built by the oldest compilers the project supports, GCC 11 and clang 14,
with ``setup.py``'s own flags (``benchmarks/rows_compilers.py``'s ``build_rows``), and by the default compiler
for AVX2 alone (the variant a CPU without AVX-512 runs, whose comparisons and permutes go in halves), give the
reference steps' payloads and decoded values bit for bit (the checks of ``test_fused.py`` on that library);
and built for aarch64 with Debian's cross compiler and run under ``qemu-user`` (a small C caller,
``tests/rows_driver.c``), they give the installed build's bytes and values. Skipped, with the reason, where a
tool is not installed (Debian: ``apt-get install gcc-11 clang-14 gcc-aarch64-linux-gnu qemu-user``); the
default compiler's build is the installed extension, which ``test_fused.py`` checks."""

from __future__ import annotations

import math
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from dgpipe.compression import get_codec
from dgpipe.compression.kernels import backend, rows
from dgpipe.compression.kernels.bitpack import CHUNK
from dgpipe.compression.steps.levels import normal_levels
from helpers import ROOT, load_benchmark, needs_rows
from test_fused import eager_and_fused, row_inputs  # noqa: F401  (eager_and_fused: a fixture)

#: label -> (compiler, extra CFLAGS)
BUILDS = {"gcc-11": ("gcc-11", ""), "clang-14": ("clang-14", ""),
          "avx2-alone": ("cc", "-march=x86-64-v3 -DDGPIPE_ROWS_ONE_TARGET")}


def _has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return platform.machine() == "x86_64" and " avx2 " in flags and " fma " in flags


@pytest.fixture(scope="module", params=list(BUILDS))
def built(request, tmp_path_factory) -> Path:
    """The extension of one :data:`BUILDS` entry built into a temporary folder; its path."""
    cc, cflags = BUILDS[request.param]
    if shutil.which(cc) is None:
        pytest.skip(f"{cc} is not installed")
    if cflags and not _has_avx2():
        pytest.skip("an x86-64 CPU with AVX2 and FMA runs the AVX2 build (Linux: /proc/cpuinfo)")
    return load_benchmark("rows_compilers").build_rows(cc, tmp_path_factory.mktemp(request.param), cflags)


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


CROSS = ("aarch64-linux-gnu-gcc", "qemu-aarch64")
#: (rows, d, width, block, rotated): one Hadamard block per row, several (384 = 3 x 128), a padded width,
#: no rotation; enough rows for whole chunks and a tail.
SHAPES = ((33, 384, 384, 128, True), (70, 50, 64, 64, True), (300, 16, 16, 16, False))


@pytest.fixture(scope="module")
def aarch64_driver(tmp_path_factory) -> Path:
    """``tests/rows_driver.c`` with ``rows.c``, cross-compiled for aarch64 (static, ``setup.py``'s flags)."""
    missing = [tool for tool in CROSS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)")
    out = tmp_path_factory.mktemp("aarch64") / "rows_driver"
    proc = subprocess.run([CROSS[0], "-O3", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi", "-static",
                           str(ROOT / "dgpipe/compression/kernels/rows.c"), str(ROOT / "tests/rows_driver.c"), "-lm",
                           "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, f"the aarch64 build failed:\n{proc.stderr[-4000:]}"
    return out


@needs_rows
@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_rows_on_aarch64_equal_the_installed_build(aarch64_driver, monkeypatch, bits):
    """The kernels built for aarch64 (NEON) and run under qemu give the installed (x86-64) build's packed
    codes, scales, tail codes and decoded values bit for bit -- which test_fused.py ties to the reference."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    mant, emin, top = rows._meta_format(torch.bfloat16)
    levels = normal_levels(bits).float()
    mids = (levels[1:] + levels[:-1]) / 2
    g = torch.Generator().manual_seed(bits)
    for n_rows, d, width, block, rotated in SHAPES:
        x = torch.randn(n_rows, d, generator=g)
        x[:, ::17] *= 30  # outlier features
        x[3] = 0.0  # a zero row: scale 0
        signs = torch.randint(0, 2, (d,), generator=g).float() * 2 - 1 if rotated else None
        packed, scales, tail = rows.encode_rows(x, signs, width, block, mids, bits, torch.bfloat16)
        y = rows.decode_rows(packed, bits, levels, scales, tail, n_rows, d, signs, width, block)
        n = n_rows * width
        full_bytes = (n - n % CHUNK) * bits // 8
        header = np.array([n_rows, d, width, block, bits, mant, emin, packed.numel(), rotated], np.int64).tobytes()
        stdin = header + np.float64(top).tobytes() + np.float32(1 / math.sqrt(block)).tobytes() + b"".join(
            t.numpy().tobytes() for t in (x, signs, mids, levels) if t is not None)
        proc = subprocess.run(["qemu-aarch64", str(aarch64_driver)], input=stdin, capture_output=True, timeout=120)
        assert proc.returncode == 0, f"rows_driver exited {proc.returncode}"
        got = np.frombuffer(proc.stdout, np.uint8)
        sizes = np.cumsum([packed.numel(), 4 * n_rows, n % CHUNK, 4 * n_rows * d])
        assert sizes[-1] == got.size
        parts = np.split(got, sizes[:-1])
        assert np.array_equal(parts[0][:full_bytes], packed.numpy()[:full_bytes])
        assert np.array_equal(parts[1].view(np.float32).view(np.int32), scales.numpy().view(np.int32))
        assert np.array_equal(parts[2], tail)
        assert np.array_equal(parts[3].view(np.int32), y.numpy().reshape(-1).view(np.int32))
