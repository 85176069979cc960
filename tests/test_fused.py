"""The compiled CPU kernels (dgpipe.compression.kernels: compiled, rows) against the reference.

Both paths must give byte-identical payloads and bit-identical decoded tensors; the
fused path must really be taken where it applies; a kernel that fails must fall back
to the reference for that kernel alone, with one warning. The tests that run the kernels
skip, with the package's notice, where the C extensions were not built.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dgpipe.compression import get_codec
from dgpipe.compression.kernels import backend, compiled, compiled_grid
from dgpipe.compression.kernels.bitpack import CHUNK
from helpers import HAVE_C, needs_c


@pytest.fixture
def eager_and_fused():
    """Run a codec both ways; restores the switch afterwards. Skips where the C extensions were not built."""
    if not HAVE_C:
        pytest.skip(backend.MISSING)
    previous = backend.set_enabled(True)

    def run(codec, x):
        out = {}
        for on in (False, True):
            backend.set_enabled(on)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a fallback warning would make the comparison vacuous
                p = codec.encode(x)
                out[on] = (p, codec.decode(p))
        (pe, ye), (pf, yf) = out[False], out[True]
        assert pe.header.tolist() == pf.header.tolist()
        for a, b in zip(pe.tensors, pf.tensors):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert ye.dtype == yf.dtype and ye.shape == yf.shape
        assert torch.equal(ye.reshape(-1).view(torch.int16 if ye.element_size() == 2 else torch.int32),
                           yf.reshape(-1).view(torch.int16 if yf.element_size() == 2 else torch.int32))  # bits, -0.0 too
        return pf, yf

    yield run
    backend.set_enabled(previous)


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random and adversarial inputs, all large enough for the fused path (>= 2 chunks)."""
    g = torch.Generator().manual_seed(seed)
    n = 5 * CHUNK + 123  # a tail that is not a whole chunk
    randn = torch.randn(n, generator=g)
    signed_zeros = torch.where(torch.rand(n, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
    signed_zeros[:: 7] = torch.randn(signed_zeros[:: 7].shape, generator=g)
    return {
        "randn": randn,
        "relu_ties": torch.relu(randn - 0.3),  # ~60% exact zeros: boundaries tie
        "negative_zeros": -torch.relu(randn),  # the max is -0.0
        "integers": torch.randint(-3, 4, (n,), generator=g).float() * 0.5,  # many ties
        "constant": torch.full((n,), 2.5),
        "signed_zeros": signed_zeros,
        "subnormal": torch.randn(n, generator=g) * 1e-40,
        "wide": torch.randn(n, generator=g) * 1e30,
        "outliers": randn * torch.where(torch.rand(n, generator=g) < 0.01, 100.0, 1.0),
        "exact_chunks": torch.randn(4 * CHUNK, generator=g),
        "non_contiguous": torch.randn(96, 3 * CHUNK // 32 + 5, generator=g).t(),
        "strided": torch.randn(8 * CHUNK, generator=g)[::2],  # 1-D, whole chunks: flattening keeps the view
        "fp16": torch.randn(3 * CHUNK + 5, generator=g).half(),
        "bf16": torch.randn(3 * CHUNK + 5, generator=g).bfloat16(),
        "hidden": torch.randn(6, 33, 384, generator=g),  # token groups of 384 across chunk borders
    }


QUANT = [dict(bits=b) for b in (1, 2, 3, 4, 5, 7, 8, 11, 12, 16)] + [
    dict(bits=4, group="token"),
    dict(bits=3, group="tile", group_size=100),
    dict(bits=8, scale_dtype="bfloat16"),
    dict(bits=2, group="token", scale_dtype="float16"),
    dict(bits=8, group="channel", axis=1),
    dict(bits=4, group="token", rotate="hadamard", scale_dtype="bfloat16"),
]
SORTQUANT = [(1, 1), (3, 1), (6, 2), (2, 2), (9, 3), (5, 3), (12, 4), (4, 4), (8, 0)]


@pytest.mark.parametrize("opts", QUANT, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_quant_fused_equals_eager(eager_and_fused, kernels_run, opts):
    """Messages of whole chunks with one float32 grid decode in one call, the others step by step;
    both give the eager bytes and values."""
    codec = get_codec("quant", **opts)
    for name, x in tensors().items():
        if name == "wide" and opts.get("scale_dtype") == "float16":
            continue  # refused by both paths: the ranges overflow float16 scales
        if opts.get("group") == "token" and x.dim() < 2:
            x = x[: x.numel() // 64 * 64].view(-1, 64)
        eager_and_fused(codec, x)
    bits = opts["bits"]
    want = {("encode_uniform", bits), ("decode_uniform", bits)}
    if len(opts) == 1:  # per tensor, float32 metadata
        want |= {("message_values", bits, 0), ("value_range",)}
    assert want <= kernels_run, f"fused path not taken: {want - kernels_run}"


CODEBOOK = [
    pytest.param(dict(bits=4, levels="normal", group="token", rotate="hadamard", scale_dtype="bfloat16"),
                 marks=needs_c),  # token groups, fixed levels: the row kernels (below)
    pytest.param(dict(bits=2, levels="normal", group="token", rotate="hadamard", scale_dtype="bfloat16"),
                 marks=needs_c),
    dict(bits=3, levels="fit", group="channel", axis=1),
    dict(bits=1, levels="normal"),
    dict(bits=4, levels="fit", group="tile", group_size=100),
]


def codebook_inputs(x: dict[str, torch.Tensor], opts: dict):
    """The :func:`tensors` the codebook tests code, shaped for ``opts`` (channels need a channel axis)."""
    for name in ("randn", "relu_ties", "signed_zeros", "outliers", "hidden", "non_contiguous", "bf16"):
        t = x[name]
        yield t[: t.numel() // 96 * 96].reshape(4, 24, -1) if opts.get("group") == "channel" else t


@pytest.mark.parametrize("opts", CODEBOOK, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_codebook_fused_equals_eager(eager_and_fused, opts):
    codec = get_codec("codebook", **opts)
    for t in codebook_inputs(tensors(seed=2), opts):
        eager_and_fused(codec, t)
    if opts.get("group") == "token" and opts["levels"] == "normal":  # one pass per row (below)
        want = [("encode_rows", "c"), ("decode_rows", "c")]
    else:
        want = [("encode_levels", opts["bits"]), ("decode_levels", opts["bits"])]
    assert all(key in backend._kernels for key in want)


ROWS = [dict(bits=b, rotate=r, scale_dtype=sd) for b in (1, 2, 3, 4) for r in ("hadamard", "none")
        for sd in ("float32", "bfloat16", "float16")]


def row_inputs(seed: int) -> dict[str, torch.Tensor]:
    """Token-grouped inputs: widths with one Hadamard block, several (384 = 3 x 128) and padded ones
    (14 -> 16, 28 -> 32, 50 -> 64, 56 -> 64, 5 -> 8); rows across chunk and thread borders, a tail, zero rows."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(6, 33, 384, generator=g)
    hidden[..., ::97] *= 30  # outlier features
    hidden[2, 5] = 0.0  # an all-zero row: scale 0
    return {
        "hidden": hidden,
        "padded": torch.randn(5, 7, 50, generator=g) * 1e-3,
        "conv": torch.relu(torch.randn(2, 3, 40, 56, generator=g)),
        "tiny": torch.randn(3, 5, generator=g),  # the tail alone
        "narrow": torch.randn(7, 9, 14, generator=g),
        "map": torch.relu(torch.randn(3, 11, 28, generator=g)),
        "sixteen": torch.randn(50, 16, generator=g),
        "chunks": torch.randn(4 * CHUNK // 64, 64, generator=g),  # whole chunks, no tail
        "subnormal": torch.randn(40, 128, generator=g) * 1e-41,
        "wide": torch.randn(40, 128, generator=g) * 1e30,
        "bf16": torch.randn(9, 31, 256, generator=g).bfloat16(),
    }


@needs_c
@pytest.mark.parametrize("opts", ROWS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_codebook_rows_in_one_pass_equal_the_steps(eager_and_fused, monkeypatch, opts):
    """Token groups with fixed levels: rotation, RMS scale, its rounding, levels and packing in one compiled
    pass per row (kernels.rows, compiled C) give the step-by-step path's payloads and values, on one thread and
    split over three."""
    codec = get_codec("codebook", group="token", **opts)
    for threads in (1, 3):
        monkeypatch.setattr(backend, "MIN_CHUNKS_PER_THREAD", 1)
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        for name, x in row_inputs(seed=threads).items():
            if name == "wide" and opts["scale_dtype"] == "float16":
                continue  # refused by both paths (below)
            eager_and_fused(codec, x)
    assert ("encode_rows", "c") in backend._kernels, "one-pass encode not taken"
    assert ("decode_rows", "c") in backend._kernels, "one-pass decode not taken"


@pytest.mark.parametrize("bad, error", [(float("nan"), "inf/NaN"), (float("inf"), "inf/NaN"),
                                        (1e7, "overflows scale_dtype float16")])
def test_codebook_rows_refuse_what_the_steps_refuse(bad, error):
    """A row with inf/NaN, or a scale past float16's range, is refused with the steps' error either way."""
    x = torch.randn(50, 384)
    x[31, 7] = bad
    codec = get_codec("codebook", bits=2, group="token", rotate="hadamard", scale_dtype="float16")
    for on in (False, True):
        previous = backend.set_enabled(on)
        try:
            with pytest.raises(ValueError, match=error):
                codec.encode(x)
        finally:
            backend.set_enabled(previous)


def test_row_rms_against_float64():
    """The RMS scale is the float32 rounding of sqrt(mean(x^2)) computed in float64 (numpy's, an
    independent summation order; the float64 sums differ in the last bits at most, which the rounding
    to float32 absorbs): for wide, subnormal and odd-length rows."""
    from dgpipe.compression.kernels import row_rms

    g = np.random.default_rng(3)
    for shape, scale in (((64, 384), 1.0), ((7, 1001), 1e30), ((5, 3), 1e-40), ((1, 1), 2.0)):
        rows = (g.standard_normal(shape) * scale).astype(np.float32)
        want = np.sqrt(np.mean(rows.astype(np.float64) ** 2, axis=1, keepdims=True))
        got = row_rms(torch.from_numpy(rows)).numpy()
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got, want.astype(np.float32)), shape


@needs_c
def test_fwht_fused_equals_eager():
    from dgpipe.compression.kernels import fwht

    g = torch.Generator().manual_seed(5)
    previous = backend.set_enabled(True)
    try:
        for shape in ((64, 53, 3, 128), (5, 4096), (300, 32), (2, 8192)):
            x = torch.randn(shape, generator=g)
            backend.set_enabled(False)
            want = fwht(x)
            backend.set_enabled(True)
            got = fwht(x)
            assert got.shape == want.shape and torch.equal(got, want)
            assert torch.equal(fwht(got), fwht(want))
        assert ("fwht",) in backend._kernels
    finally:
        backend.set_enabled(previous)


@pytest.fixture
def kernels_run(monkeypatch):
    """The keys of the fused kernels run from here on (a set, filled as they run)."""
    keys, call = set(), backend.run

    def record(key, build, args):
        keys.add(key)
        return call(key, build, args)

    monkeypatch.setattr(backend, "run", record)
    return keys


@pytest.mark.parametrize("qs", SORTQUANT, ids=lambda qs: f"{qs[0]}+{qs[1]}")
def test_sortquant_fused_equals_eager(eager_and_fused, kernels_run, qs):
    """Sampled splits take the one-call path (grid and whole chunks' codes in ``sampled_grid``),
    exact splits the separate encode kernel; whole chunks decode in one call (``message_values``),
    a tail step by step; all give the eager bytes and values."""
    from dgpipe.compression.kernels.buckets import sample_size

    q, s = qs
    codec = get_codec("sortquant", quant_bits=q, split_bits=s)
    exact = False
    for name, x in tensors(seed=1).items():
        eager_and_fused(codec, x)
        exact |= sample_size(x.numel(), 1 << s) == x.numel()
    if s:
        want = {("sampled_grid", s, q), ("decode_buckets", q, s), ("message_values", q, s)}
        want |= {("encode_buckets", q, s)} if exact else set()
        assert want <= kernels_run, f"fused path not taken: {want - kernels_run}"


def test_large_sample_split_and_bucket_extrema(eager_and_fused):
    """Above the sample size the min and maxima come from the compiled pass; the decode within half a step."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300_000, generator=g) ** 3
    for q, s in ((6, 2), (3, 1), (4, 4)):
        _, y = eager_and_fused(get_codec("sortquant", quant_bits=q, split_bits=s), x)
        assert ("bucket_extrema", s) in backend._kernels
        # independent check: decoded values stay within half a step of x
        p = get_codec("sortquant", quant_bits=q, split_bits=s).encode(x)
        step = p.tensors[1][1 << s:]
        assert (y - x).abs().max() <= step.max() / 2 * (1 + 1e-5)


@needs_c
@pytest.mark.parametrize("threads", [1, 3])
def test_bucket_extrema_against_sort(monkeypatch, threads):
    """The compiled pass's min and maxima equal those computed with searchsorted over all values, also
    where many values tie with a boundary (a ReLU's zeros, a saturated top, integers), where the extremes
    are single outliers that no sample holds, and where a bucket is empty; on one thread and on three."""
    from dgpipe.compression.kernels.buckets import bucket_ranges

    monkeypatch.setattr(backend, "MIN_CHUNKS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(4)
    n = 200_003
    outliers = torch.randn(n, generator=g)
    outliers[12_345], outliers[-1] = -50.0, 60.0  # the min in a chunk, the max in the tail
    cases = {
        "randn": torch.randn(n, generator=g),
        "relu": torch.relu(torch.randn(n, generator=g)),
        "saturated": torch.randn(n, generator=g).clamp(-1.0, 0.5),
        "integers": torch.randint(-2, 3, (n,), generator=g).float(),
        "outliers": outliers,
    }
    previous = backend.set_enabled(True)
    try:
        for name, x in cases.items():
            for buckets in (2, 4, 16):
                bounds, mins, maxs = bucket_ranges(x, buckets, "sortquant")
                assert mins[0].item() == x.min().item(), name
                want = mins.clone().scatter_reduce_(0, torch.searchsorted(bounds, x, right=True), x, "amax") + 0.0
                assert torch.equal(maxs, want), (name, buckets)
                assert ("bucket_extrema", buckets.bit_length() - 1) in backend._kernels
    finally:
        backend.set_enabled(previous)


@needs_c
@pytest.mark.parametrize("threads", [1, 3])
def test_value_range_against_torch(monkeypatch, threads):
    """The range pass's min and max equal torch's (up to the sign of a zero) with the extremes in the first
    value, a middle chunk or the tail; a NaN anywhere, an inf next to it or not, gives NaN for both; on
    one thread and on three."""
    monkeypatch.setattr(backend, "MIN_CHUNKS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(5)
    previous = backend.set_enabled(True)
    try:
        for n in (3 * CHUNK, 200_003):
            for where in (0, CHUNK + 17, n - 1):
                for lo, hi in ((-50.0, 60.0), (-float("inf"), float("inf")), (-0.0, 0.0)):
                    x = torch.randn(n, generator=g) if lo else -torch.relu(torch.randn(n, generator=g))
                    x[where], x[(where + 5 * CHUNK // 2) % n] = lo, hi
                    got = compiled_grid.value_range(x.numpy())
                    want = torch.aminmax(x)
                    assert (got[0], got[1]) == (want.min.item(), want.max.item()), (n, where, lo)
                    x[(where + 1) % n] = float("nan")
                    assert np.isnan(compiled_grid.value_range(x.numpy())).all(), (n, where, lo)
        assert ("value_range",) in backend._kernels
        assert compiled_grid.value_range(np.zeros(100, np.float32)) is None  # small: torch's turn
    finally:
        backend.set_enabled(previous)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_give_the_same_bytes(eager_and_fused, monkeypatch, threads):
    """Kernels split over threads (parts of whole chunks, group runs across part borders, the low-byte
    plane of wide codes) give the eager path's payloads and values."""
    monkeypatch.setattr(backend, "MIN_CHUNKS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    codecs = [get_codec("quant", bits=12), get_codec("quant", bits=3, group="tile", group_size=1000),
              get_codec("sortquant", quant_bits=6, split_bits=2), get_codec("sortquant", quant_bits=9, split_bits=3),
              get_codec("codebook", bits=4, levels="fit", group="tile", group_size=100)]
    g = torch.Generator().manual_seed(6)
    for x in (tensors(seed=3)["relu_ties"], torch.randn(40_000, generator=g)):  # exact and sampled splits
        for codec in codecs:
            eager_and_fused(codec, x)


@needs_c
def test_sort_sample_equals_numpy_sort():
    """The radix sort of the boundary sample gives numpy's sorted values (zeros: -0.0 first), with or
    without sample positions, on every adversarial tensor; NaN and inf are kept."""
    g = np.random.default_rng(0)
    cases = {name: x.float().reshape(-1).contiguous().numpy() for name, x in tensors(seed=8).items()}
    cases["specials"] = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 1e-45, -1e-45, 3.4e38, -3.4e38] * 500, np.float32)
    for name, flat in cases.items():
        for positions in (None, g.integers(0, flat.size, 4096)):
            want = np.sort(flat if positions is None else flat[positions])
            got = compiled_grid.sort_sample(flat, positions)
            assert got is not None and got.dtype == np.float32 and got.shape == want.shape
            finite = ~np.isnan(want)
            assert np.array_equal(np.sort(got[~np.isnan(got)]), want[finite]) and np.isnan(got).sum() == (~finite).sum()
            vals = got[~np.isnan(got)]
            assert np.all(vals[:-1] <= vals[1:]), name
            zeros = np.signbit(vals[vals == 0])
            assert not np.any(~zeros[:-1] & zeros[1:]), name  # no -0.0 after a +0.0
    assert ("sort_sample",) in backend._kernels
    assert compiled_grid.sort_sample(cases["randn"], np.arange(compiled_grid.MIN_SORT_VALUES - 1)) is None  # numpy's turn


@pytest.mark.parametrize("bad, error", [((float("nan"),), "inf/NaN"), ((float("-inf"),), "inf/NaN"),
                                        ((-3e38, 3e38), "wider than float32")])
def test_non_finite_refused_both_ways(bad, error):
    """Refused alike by the eager path, the one-call kernels (whole chunks) and the step-by-step ones (a tail)."""
    for n in (3 * CHUNK, 3 * CHUNK + 5):
        x = torch.randn(n)
        x[CHUNK + 7 : CHUNK + 7 + len(bad)] = torch.tensor(bad)
        for on in (False, True):
            previous = backend.set_enabled(on)
            try:
                for codec in (get_codec("quant", bits=8), get_codec("sortquant", quant_bits=6, split_bits=2)):
                    with pytest.raises(ValueError, match=error):
                        codec.encode(x)
            finally:
                backend.set_enabled(previous)


def test_not_applicable_returns_false():
    out = torch.empty(10, dtype=torch.uint8)
    small = torch.randn(100)
    assert not compiled.encode_uniform(small, small[:1], small[:1], 8, 100, out)
    assert compiled_grid.bucket_extrema(np.zeros(3 * CHUNK, np.float32), np.zeros(31, np.float32)) is None  # S = 5 > 4


@needs_c
def test_message_values_refuses_buffers_of_another_size():
    """The one-call decode's compiled loop checks no bounds: a stream or metadata of the wrong size is refused."""
    n, meta = 2 * CHUNK, torch.zeros(8)
    good = torch.zeros(n, dtype=torch.uint8)
    assert compiled.message_values(good, 6, 2, meta, n) is not None
    with pytest.raises(ValueError, match="code bytes"):
        compiled.message_values(good[:-1], 6, 2, meta, n)
    with pytest.raises(ValueError, match="metadata values"):
        compiled.message_values(good, 6, 2, meta[:6], n)


@needs_c
def test_stochastic_rounding_stays_eager(monkeypatch):
    """Stochastic rounding draws from torch's generator: no fused kernel is asked for it."""
    calls, sampled_grid = [], compiled_grid.sampled_grid
    for module, name in ((compiled, "encode_uniform"), (compiled, "encode_buckets"),
                         (compiled, "uniform_message")):  # recorded, not applied
        monkeypatch.setattr(module, name, lambda *a, name=name: calls.append(name))

    def grid_only_unless_asked(x, positions, ranks, quant_bits, pack=False):
        if pack:
            calls.append("sampled_grid(pack=True)")
        return sampled_grid(x, positions, ranks, quant_bits, pack)

    monkeypatch.setattr(compiled_grid, "sampled_grid", grid_only_unless_asked)
    x = torch.randn(4 * CHUNK)
    get_codec("quant", bits=4, stochastic=True).encode(x)
    get_codec("sortquant", quant_bits=3, split_bits=1, stochastic=True).encode(x)
    assert calls == []
    get_codec("quant", bits=4).encode(x)
    get_codec("sortquant", quant_bits=3, split_bits=1).encode(x)
    assert calls == ["uniform_message", "encode_uniform", "sampled_grid(pack=True)"]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_team_cuts_the_units(monkeypatch, threads):
    """team(): one part on one thread, else up to PARTS_PER_THREAD parts per thread, none under
    MIN_CHUNKS_PER_THREAD units, and never more threads than torch's."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    least = backend.MIN_CHUNKS_PER_THREAD
    for units in (0, 1, least - 1, least, 2 * least, 5 * least + 3, 1000 * least):
        parts, t = backend.team(units)
        assert 1 <= t <= threads
        if threads == 1 or units < 2 * least:
            assert (parts, t) == (1, 1)
        else:
            assert 1 < parts <= t * backend.PARTS_PER_THREAD and units // parts >= least


THREAD_COUNT = """
import os, sys, torch
from dgpipe.compression import get_codec
from dgpipe.compression.kernels import backend
torch.set_num_threads(2)
x = torch.rand(256 * 4096)
(x * 2).sum()  # torch's OpenMP team exists from here on
before = len(os.listdir("/proc/self/task"))
codec = get_codec("quant", bits=8)
payload = codec.encode(x)
codec.decode(payload)
assert ("encode_uniform", 8) in backend._kernels, "the compiled kernel did not run"
print(int(backend.openmp_runtime() is not None), *backend.team(256), before, len(os.listdir("/proc/self/task")))
"""


@needs_c
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
@pytest.mark.skipif("parallel backend: OpenMP" not in torch.__config__.parallel_info(),
                    reason="torch runs no OpenMP runtime here")
def test_kernels_run_on_torchs_threads():
    """A fresh process with two torch threads finds torch's OpenMP runtime, cuts the 1M-value encode for two
    threads, and runs it without starting a thread of its own: the parts go to torch's OpenMP workers."""
    out = subprocess.run([sys.executable, "-c", THREAD_COUNT], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    found, parts, threads, before, after = map(int, out.stdout.split())
    assert found == 1 and (parts, threads) == (8, 2) and after == before, out.stdout


@needs_c
def test_kernel_failure_switches_off_that_kernel_only(monkeypatch):
    """A kernel that fails warns once, its step runs the reference (same bytes), and every other kernel
    keeps running."""
    kernel = compiled._kernel

    def broken(name):
        if name == "encode_uniform":
            raise RuntimeError("no kernel here")
        return kernel(name)

    monkeypatch.setattr(compiled, "_kernel", broken)
    monkeypatch.setattr(backend, "_kernels", {})
    monkeypatch.setattr(backend, "_failed", set())
    previous = backend.set_enabled(True)
    try:
        x = torch.randn(5 * CHUNK + 1)  # a tail: not the one-call path
        codec = get_codec("quant", bits=8)
        with pytest.warns(RuntimeWarning, match=r"encode_uniform\[8\] unavailable.*no kernel here"):
            p = codec.encode(x)
        assert backend.failed_kernels() == {("encode_uniform", 8)} and backend.enabled()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # only one warning
            y = codec.decode(p)
            codec.encode(x)
            p2 = get_codec("sortquant", quant_bits=6, split_bits=2).encode(x)
        assert ("decode_uniform", 8) in backend._kernels and ("sampled_grid", 2, 6) in backend._kernels
        backend.set_enabled(False)
        ref = codec.encode(x)
        assert all(torch.equal(a, b) for a, b in zip(p.tensors, ref.tensors))
        assert torch.equal(y, codec.decode(ref)) and p2.nbytes > 0
    finally:
        backend.set_enabled(previous)


def test_env_switch_off():
    code = "from dgpipe.compression import kernels; print(kernels.enabled())"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, DGPIPE_FUSED="0"),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
