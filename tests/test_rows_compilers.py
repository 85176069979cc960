"""The C kernels (``kernels/codes.c``, ``kernels/rows.c``) built by the oldest compilers the project supports,
GCC 11 and clang 14, with ``setup.py``'s own flags (``benchmarks/rows_compilers.py``'s ``build_kernels``), and by
the default compiler for AVX2 alone (the variant a CPU without AVX-512 runs; for the rows, comparisons and
permutes in halves), give the reference steps' payloads and decoded values bit for bit (the checks of
``test_fused.py`` on those libraries);
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
from dgpipe.compression.kernels import backend, compiled, compiled_grid, rows
from dgpipe.compression.kernels.bitpack import CHUNK
from dgpipe.compression.steps.levels import normal_levels
from helpers import ROOT, load_benchmark, needs_c
from test_fused import QUANT, SORTQUANT, eager_and_fused, row_inputs, tensors  # noqa: F401  (a fixture)

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
def built(request, tmp_path_factory) -> dict[str, Path]:
    """The extensions of one :data:`BUILDS` entry built into a temporary folder; their paths by name."""
    cc, cflags = BUILDS[request.param]
    if shutil.which(cc) is None:
        pytest.skip(f"{cc} is not installed")
    if cflags and not _has_avx2():
        pytest.skip("an x86-64 CPU with AVX2 and FMA runs the AVX2 build (Linux: /proc/cpuinfo)")
    return load_benchmark("rows_compilers").build_kernels(cc, tmp_path_factory.mktemp(request.param), cflags)


def test_codes_built_by_each_compiler_equal_the_steps(built, eager_and_fused, monkeypatch):  # noqa: F811
    monkeypatch.setitem(backend._libraries, "_codes", compiled.open_library(str(built["_codes"])))
    monkeypatch.setattr(backend, "MIN_CHUNKS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(backend, "_kernels", {})  # the kernels of this library alone
    codecs = [get_codec("quant", **opts) for opts in QUANT if "rotate" not in opts]
    codecs += [get_codec("sortquant", quant_bits=q, split_bits=s) for q, s in SORTQUANT]
    codecs += [get_codec("codebook", bits=b, levels="fit", group="tile", group_size=100) for b in (1, 4)]
    codecs += [get_codec("quant", bits=4, group="token", rotate="hadamard")]
    x = tensors(seed=11)
    for codec in codecs:
        for name in ("randn", "relu_ties", "signed_zeros", "exact_chunks"):
            t = x[name]
            eager_and_fused(codec, t[: t.numel() // 64 * 64].view(-1, 64) if codec.name == "quant" else t)
    assert {("encode_uniform", 8), ("decode_buckets", 6, 2), ("encode_levels", 4), ("fwht",)} <= set(backend._kernels)


@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_rows_built_by_each_compiler_equal_the_steps(built, eager_and_fused, monkeypatch, bits):  # noqa: F811
    monkeypatch.setitem(backend._libraries, "_rows", rows.open_library(str(built["_rows"])))
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


def cross_build(tmp_path_factory, kernel: str, flags: list[str]) -> Path:
    """``tests/<kernel>_driver.c`` with ``dgpipe/compression/kernels/<kernel>.c``, cross-compiled for aarch64
    (static, with ``flags``: ``setup.py``'s for that file); the executable. Skips where a tool is missing."""
    missing = [tool for tool in CROSS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)")
    out = tmp_path_factory.mktemp("aarch64") / f"{kernel}_driver"
    proc = subprocess.run([CROSS[0], *flags, f"-DDGPIPE_CHUNK={CHUNK}", "-static",
                           str(ROOT / f"dgpipe/compression/kernels/{kernel}.c"),
                           str(ROOT / f"tests/{kernel}_driver.c"), "-lm", "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"the aarch64 build failed:\n{proc.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def aarch64_driver(tmp_path_factory) -> Path:
    """``tests/rows_driver.c`` with ``rows.c``, cross-compiled for aarch64."""
    return cross_build(tmp_path_factory, "rows", ["-O3", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi"])


@needs_c
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


@pytest.fixture(scope="module")
def aarch64_codes_driver(tmp_path_factory) -> Path:
    """``tests/codes_driver.c`` with ``codes.c``, cross-compiled for aarch64."""
    return cross_build(tmp_path_factory, "codes", ["-O3", "-ffp-contract=off", "-fno-math-errno"])


@needs_c
def test_codes_on_aarch64_equal_the_installed_build(aarch64_codes_driver, monkeypatch):
    """The per-value kernels built for aarch64 and run under qemu give the installed build's bytes and values bit
    for bit: 8-bit uniform and 6+2 sort quantization of a message in one call (grid, codes, values), 2-bit levels
    and their values, the Hadamard butterflies -- which test_fused.py ties to the reference."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    g = torch.Generator().manual_seed(12)
    n, m = 4 * CHUNK, 2048
    x = torch.relu(torch.randn(n, generator=g) - 0.3) * torch.where(torch.rand(n, generator=g) < 0.01, 40.0, 1.0)
    positions = torch.randint(0, n, (m,), generator=g).numpy()
    ranks = np.array([512, 1024, 1536], np.int64)
    lo, hi = np.float32(x.min()), np.float32(x.max())
    levels = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    mids, scale = (levels[1:] + levels[:-1]) / 2, torch.tensor([0.75])
    meta, codes8 = compiled.uniform_message(x, float(lo), float(hi), 8)
    y8 = compiled.message_values(codes8, 8, 0, meta, n)
    grid, codes62 = compiled_grid.sampled_grid(x.numpy(), positions, ranks, 6, pack=True)
    grid[3, 2:] = 0.0  # unused
    y62 = compiled.message_values(torch.from_numpy(codes62), 6, 2, torch.from_numpy(grid[:2].reshape(-1)), n)
    codes2, y2 = torch.empty(n // 4, dtype=torch.uint8), torch.empty(n)
    assert compiled.encode_levels(x, mids, 2, codes2) and compiled.decode_levels(codes2, 2, levels, scale, n, y2)
    rotated = compiled.fwht(x.view(-1, 64))
    want = [meta, codes8, y8, torch.from_numpy(grid), torch.from_numpy(codes62), y62, codes2, y2, rotated]
    stdin = np.array([n, m], np.int64).tobytes() + x.numpy().tobytes() + positions.astype(np.int64).tobytes() + \
        ranks.tobytes() + np.array([lo, hi], np.float32).tobytes() + b"".join(
            t.numpy().tobytes() for t in (mids, levels, scale))
    proc = subprocess.run(["qemu-aarch64", str(aarch64_codes_driver)], input=stdin, capture_output=True, timeout=120)
    assert proc.returncode == 0, f"codes_driver exited {proc.returncode}"
    got = np.frombuffer(proc.stdout, np.uint8)
    sizes = np.cumsum([t.numel() * t.element_size() for t in want])
    assert sizes[-1] == got.size
    for part, t in zip(np.split(got, sizes[:-1]), want):
        assert np.array_equal(part, t.contiguous().numpy().reshape(-1).view(np.uint8))
