"""Sort quantization: against the original formulation, per-bucket error bounds, sampling, ties, wire size."""

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgpipe.compression import Payload, get_codec
from dgpipe.compression.kernels import buckets as sq
from dgpipe.compression.kernels.bitpack import unpack_bits


def original(x: torch.Tensor, q: int, s: int) -> torch.Tensor:
    """Sort quantization as first described: full sort, equal chunks by rank, a loop over chunks."""
    flat = x.reshape(-1).float()
    values, order = torch.sort(flat)
    n, levels = flat.numel(), 1 << q
    out = torch.empty_like(flat)
    for i in range(1 << s):
        a, b = i * n >> s, (i + 1) * n >> s
        if a == b:
            continue
        v = values[a:b]
        lo, step = v[0], (v[-1] - v[0]) / (levels - 1)
        level = torch.round((v - lo) / step) if step > 0 else torch.zeros_like(v)
        out[order[a:b]] = lo + level * step
    return out.view(x.shape)


def buckets_and_grid(payload, q, s, n):
    """Per value: bucket, level; per bucket: min, step -- read from the payload."""
    codes = unpack_bits(payload.tensors[0], q + s, n)
    params = payload.tensors[1]
    return codes >> q, codes & ((1 << q) - 1), params[: 1 << s], params[1 << s :]


def check_half_step(x, payload, y, q, s, stochastic=False):
    flat, yf = x.reshape(-1).float(), y.reshape(-1).float()
    bucket, level, mins, steps = buckets_and_grid(payload, q, s, flat.numel())
    step = steps[bucket]
    # decoded value is the grid point; the value lies within the bucket's grid, within half a step of it
    torch.testing.assert_close(yf, mins[bucket] + level.float() * step, rtol=0, atol=0)
    tol = 1e-6 * flat.abs().max() + 1e-30
    assert bool((flat >= mins[bucket] - tol).all())
    assert bool((flat <= mins[bucket] + ((1 << q) - 1) * step + tol).all())
    bound = step if stochastic else step / 2
    assert bool(((yf - flat).abs() <= bound * (1 + 1e-5) + tol).all())


@settings(max_examples=40, deadline=None)
@given(q=st.integers(1, 12), s=st.integers(0, 4), n=st.integers(1, 300), seed=st.integers(0, 2**31))
def test_equals_the_original_formulation_on_distinct_values(q, s, n, seed):
    x = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).float() * 0.37 - 20
    codec = get_codec("sortquant", quant_bits=q, split_bits=s)
    p = codec.encode(x)
    y = codec.decode(p)
    torch.testing.assert_close(y, original(x, q, s), rtol=1e-6, atol=1e-5)
    check_half_step(x, p, y, q, s)
    # equal-count buckets by rank
    bucket = buckets_and_grid(p, q, s, n)[0]
    expect = [((i + 1) * n >> s) - (i * n >> s) for i in range(1 << s)]
    assert torch.bincount(bucket, minlength=1 << s).tolist() == expect


@settings(max_examples=30, deadline=None)
@given(
    q=st.integers(1, 12),
    s=st.integers(0, 4),
    n=st.integers(1, 3000),
    kind=st.sampled_from(["normal", "relu", "ints", "lognormal"]),
    seed=st.integers(0, 2**31),
)
def test_half_step_and_idempotence_sampled_or_not(q, s, n, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    x = {"normal": x, "relu": x.clamp(min=0), "ints": x.mul(3).round(), "lognormal": x.exp() * 100}[kind]
    with mock.patch.object(sq, "SAMPLE_MIN", 64), mock.patch.object(sq, "SAMPLE_PER_BUCKET", 16):
        codec = get_codec("sortquant", quant_bits=q, split_bits=s)
        p = codec.encode(x)
        y = codec.decode(p)
        check_half_step(x, p, y, q, s)
        y2 = codec.decode(codec.encode(y))
    scale = float(x.abs().max()) + 1e-30
    assert float((y2 - y).abs().max()) <= 1e-5 * scale


def test_sampled_boundaries_keep_the_error_of_the_exact_split():
    n = 200_000  # > 2 * 16384: boundaries from a sample
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(n, generator=gen)
    for x in (normal, torch.nn.functional.relu6(normal * 2 - 0.5)):
        for q, s in ((6, 2), (3, 1), (9, 3)):
            assert sq.sample_size(n, 1 << s) < n
            codec = get_codec("sortquant", quant_bits=q, split_bits=s)
            p = codec.encode(x)
            y = codec.decode(p)
            check_half_step(x, p, y, q, s)
            assert float(((y - x) ** 2).mean()) <= 1.1 * float(((original(x, q, s) - x) ** 2).mean())


def test_gap_below_a_boundary_gets_exact_maxima():
    # 60% normal values, then 40% at exactly 10.0: the last boundary is 10.0, far above bucket 2's values
    gen = torch.Generator().manual_seed(1)
    x = torch.cat((torch.randn(60_000, generator=gen), torch.full((40_000,), 10.0)))
    x = x[torch.randperm(x.numel(), generator=gen)]
    q, s = 6, 2
    codec = get_codec("sortquant", quant_bits=q, split_bits=s)
    p = codec.encode(x)
    y = codec.decode(p)
    check_half_step(x, p, y, q, s)
    _, _, mins, steps = buckets_and_grid(p, q, s, x.numel())
    below = x[x < 10.0]
    assert math.isclose(float(mins[2] + 63 * steps[2]), float(below.max()), rel_tol=1e-5)
    assert float(mins[3]) == 10.0 and float(steps[3]) == 0.0
    assert bool((y[x == 10.0] == 10.0).all())


@pytest.mark.parametrize("q,s", [(12, 4), (9, 3), (6, 2), (3, 1), (1, 0), (1, 15), (16, 0)])
@pytest.mark.parametrize("shape", [(3, 5, 7), (1000,), ()])
def test_exact_nbytes(q, s, shape):
    x = torch.randn(shape)
    n = x.numel()
    p = get_codec("sortquant", quant_bits=q, split_bits=s).encode(x)
    header = 8 * (4 + len(shape) + 1 + 3 + 1 + 2 * 2)  # params: Q, S, grouping
    assert p.nbytes == math.ceil(n * (s + q) / 8) + 2**s * 2 * 4 + header


def test_ties_zeros_stay_exact_and_counts_follow_values():
    x = torch.randn(4000, generator=torch.Generator().manual_seed(2)).clamp(min=0)  # ~50% zeros
    q, s = 3, 3
    codec = get_codec("sortquant", quant_bits=q, split_bits=s)
    p = codec.encode(x)
    y = codec.decode(p)
    assert bool((y[x == 0] == 0).all())
    bucket, _, mins, steps = buckets_and_grid(p, q, s, x.numel())
    zero_bucket = int(bucket[x == 0][0])
    assert bool((bucket[x == 0] == zero_bucket).all())  # all ties in one (the upper) bucket
    counts = torch.bincount(bucket, minlength=8)
    assert bool((counts[:zero_bucket] == 0).all())  # buckets below it stay empty
    assert bool((steps[:zero_bucket] == 0).all())
    check_half_step(x, p, y, q, s)


def test_fewer_values_than_buckets_and_constants_are_exact():
    codec = get_codec("sortquant", quant_bits=3, split_bits=4)
    cases = (torch.tensor([3.0, -1.0, 2.0]), torch.full((5, 4), -7.25), torch.tensor(4.5), torch.tensor([1e-30, 2e-30]))
    for x in cases:
        y = codec.decode(codec.encode(x))
        assert y.shape == x.shape and torch.equal(y, x)


def test_split_bits_zero_is_uniform_quantization():
    x = torch.randn(500)
    sq0 = get_codec("sortquant", quant_bits=7, split_bits=0)
    uq = get_codec("quant", bits=7)
    assert torch.equal(sq0.decode(sq0.encode(x)), uq.decode(uq.encode(x)))



def test_stochastic_rounding():
    x = torch.randn(64, generator=torch.Generator().manual_seed(4))
    q, s = 2, 2
    codec = get_codec("sortquant", quant_bits=q, split_bits=s, stochastic=True)
    torch.manual_seed(0)
    outs = []
    for _ in range(2000):
        p = codec.encode(x)
        y = codec.decode(p)
        outs.append(y)
    check_half_step(x, p, y, q, s, stochastic=True)
    mean = torch.stack(outs).mean(0)
    steps = buckets_and_grid(p, q, s, 64)[3]
    assert float((mean - x).abs().max()) < 0.1 * float(steps.max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_in_and_out(dtype):
    x = torch.randn(10, 20).to(dtype)
    codec = get_codec("sortquant", quant_bits=6, split_bits=2)
    p = codec.encode(x)
    y = codec.decode(p)
    assert y.dtype == dtype and y.shape == x.shape
    steps = p.tensors[1][4:]
    tol = float(steps.max()) / 2 + 2 * float(x.abs().max()) * torch.finfo(dtype).eps
    assert float((y.double() - x.double()).abs().max()) <= tol


def test_non_contiguous_and_empty():
    codec = get_codec("sortquant", quant_bits=5, split_bits=2)
    x = torch.randn(10, 8).t()[1::2]
    torch.testing.assert_close(codec.decode(codec.encode(x)), codec.decode(codec.encode(x.contiguous())))
    for e in (torch.zeros(0), torch.zeros(3, 0, 2)):
        y = codec.decode(codec.encode(e))
        assert y.shape == e.shape


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("qs", [(6, 2), (8, 0)])
def test_decode_refuses_a_grid_that_is_not_finite(bad, qs):
    """A GPU encoder sends its per-tensor grid unchecked (no read back): the decoder is where inf/NaN stop."""
    codec = get_codec("sortquant", quant_bits=qs[0], split_bits=qs[1])
    p = codec.encode(torch.randn(4, 256))
    packed, meta = p.tensors
    meta = meta.clone()
    meta[1] = bad
    with pytest.raises(ValueError, match="grid that is not finite"):
        codec.decode(Payload(p.header, (packed, meta)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_inf_nan_raise(bad):
    x = torch.randn(100)
    x[7] = bad
    with pytest.raises(ValueError, match="inf/NaN"):
        get_codec("sortquant").encode(x)


@pytest.mark.parametrize(
    "opts",
    [dict(quant_bits=0), dict(split_bits=-1), dict(quant_bits=13, split_bits=4), dict(quant_bits=2.0), dict(x=1)],
)
def test_bad_options(opts):
    with pytest.raises(ValueError):
        get_codec("sortquant", **opts)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), s=st.integers(1, 4), ties=st.booleans(), seed=st.integers(0, 2**31))
def test_exact_split_grid_equals_the_sorted_values(n, s, ties, seed):
    """Below the sample size the grid comes from all values: boundaries at the sorted ranks, each
    bucket's min and max those of the values counted into it (an empty bucket: its min)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (n,), generator=g).float() if ties else torch.randn(n, generator=g)
    buckets = 1 << s
    bounds, mins, maxs = sq.bucket_ranges(x, buckets, "sortquant")
    assert torch.equal(bounds, torch.sort(x).values[[(i * n) // buckets for i in range(1, buckets)]])
    b = torch.searchsorted(bounds, x, right=True)
    assert mins[0] == x.min()
    assert torch.equal(maxs, mins.clone().scatter_reduce_(0, b, x, "amax") + 0.0)


def test_bucket_index_matches_bucketize():
    x = torch.randn(5000)
    for s in (1, 2, 4, 5, 7):
        bounds = torch.sort(torch.randn((1 << s) - 1)).values
        bounds[len(bounds) // 2 :] = bounds[len(bounds) // 2]  # ties among boundaries
        x[:10] = bounds[:10] if len(bounds) >= 10 else x[:10]  # values equal to boundaries
        expect = torch.bucketize(x, bounds, right=True)
        assert torch.equal(sq.BucketIndex(bounds)(x), expect)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = torch.randn(100_000)
    codec = get_codec("sortquant", quant_bits=6, split_bits=2)
    y = codec.decode(codec.encode(x.cuda()))
    assert y.is_cuda
    p = codec.encode(x.cuda())
    check_half_step(x, p.to("cpu"), y.cpu(), 6, 2)
