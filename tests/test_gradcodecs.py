"""Data-parallel gradient codecs: onebit, qsgd, terngrad, dgc, atomo."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dgpipe.compression import get_codec
from dgpipe.compression.gradients.atomo import atomo_probabilities
from dgpipe.compression.base import Payload, parse_header

pytestmark = pytest.mark.usefixtures("one_thread")

CODECS = ["onebit", "qsgd", "terngrad", "dgc", "atomo"]


def header_bytes(ndim: int, n_params: int, n_tensors: int) -> int:
    """Header size from the layout in dgpipe.compression.base, written out independently."""
    return 8 * (4 + ndim + 1 + n_params + 1 + 2 * n_tensors)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (7,), (5, 6), (3, 4, 5)])
def test_shape_dtype_device_preserved(name, shape):
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        codec = get_codec(name)
        y = codec.decode(codec.encode(x))
        assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device


@pytest.mark.parametrize("name", CODECS)
def test_non_contiguous_input(name):
    x = torch.randn(6, 10).t()
    a, b = get_codec(name), get_codec(name)
    torch.testing.assert_close(a.decode(a.encode(x)), b.decode(b.encode(x.contiguous())))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_raises(name, bad):
    x = torch.randn(4, 5)
    x[1, 2] = bad
    with pytest.raises(ValueError, match="inf/NaN"):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", CODECS)
def test_integer_input_raises(name):
    with pytest.raises(ValueError, match="floating"):
        get_codec(name).encode(torch.arange(6))


@pytest.mark.parametrize(
    "name, options",
    [
        ("qsgd", {"levels": 0}),
        ("qsgd", {"norm": "l1"}),
        ("qsgd", {"bucket_size": 0}),
        ("terngrad", {"clip": -1.0}),
        ("dgc", {"density": 0.0}),
        ("dgc", {"warmup_density": 0.0001}),
        ("dgc", {"momentum": 1.0}),
        ("atomo", {"budget": 0}),
        ("atomo", {"seed": "x"}),
        ("onebit", {"bits": 2}),
    ],
)
def test_bad_options_raise(name, options):
    with pytest.raises(ValueError):
        get_codec(name, **options)


@pytest.mark.parametrize("name", CODECS)
def test_corrupt_payloads_raise(name):
    codec = get_codec(name)
    p = codec.encode(torch.randn(8, 6))
    other = get_codec("onebit" if name != "onebit" else "qsgd").encode(torch.randn(8, 6))
    with pytest.raises(ValueError, match="codec_id"):
        codec.decode(other)
    first = p.tensors[0]
    with pytest.raises(ValueError):
        codec.decode(Payload(p.header, (first[:-1],) + p.tensors[1:]))
    with pytest.raises(ValueError):
        codec.decode(Payload(p.header[:-1], p.tensors))


def test_seeded_codecs_are_deterministic():
    x = torch.randn(40, 7)
    for name in ("qsgd", "terngrad", "atomo", "dgc"):
        a, b, c = get_codec(name, seed=3), get_codec(name, seed=3), get_codec(name, seed=4)
        pa, pb, pc = a.encode(x), b.encode(x), c.encode(x)
        assert all(torch.equal(s, t) for s, t in zip(pa.tensors, pb.tensors)), name
        if name != "dgc":  # dgc's randomness only moves the sampled threshold
            assert not all(torch.equal(s, t) for s, t in zip(pa.tensors, pc.tensors)), name
        # restoring the step counter reproduces the next encode
        d = get_codec(name, seed=3)
        d.load_state_dict(a.state_dict())
        assert all(torch.equal(s, t) for s, t in zip(a.encode(x).tensors, d.encode(x).tensors)), name


# --- exact wire bytes -------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (13,), (8, 9), (3, 5, 7), (1000,)])
def test_onebit_nbytes_and_values(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x.view(-1)[-1] = 0.0 if x.numel() > 1 else 0.5
    p = get_codec("onebit").encode(x)
    n = x.numel()
    assert p.nbytes == math.ceil(n / 8) + 4 + header_bytes(len(shape), 0, 2)
    y = get_codec("onebit").decode(p)
    scale = x.abs().mean()
    torch.testing.assert_close(y.abs(), torch.full_like(y, float(scale)))
    assert torch.equal(y > 0, x >= 0)  # sign(0) = +1


@pytest.mark.parametrize("levels, bucket", [(1, None), (4, None), (4, 16), (7, 5), (100, None)])
@pytest.mark.parametrize("n", [1, 10, 33, 257])
def test_qsgd_nbytes(levels, bucket, n):
    p = get_codec("qsgd", levels=levels, bucket_size=bucket).encode(torch.randn(n))
    bits = math.ceil(math.log2(2 * levels + 1))
    buckets = math.ceil(n / bucket) if bucket else 1
    assert p.nbytes == math.ceil(n * bits / 8) + 4 * buckets + header_bytes(1, 2, 2)


def test_terngrad_nbytes_and_values():
    for n in (1, 3, 4, 5, 101):
        x = torch.randn(n)
        p = get_codec("terngrad").encode(x)
        assert p.nbytes == math.ceil(n / 4) + 4 + header_bytes(1, 0, 2)
        y = get_codec("terngrad").decode(p)
        s = float(x.abs().max())
        assert set(y.unique().tolist()) <= {-s, 0.0, s}
        assert torch.all((y == 0) | (torch.sign(y) == torch.sign(x)))


def test_terngrad_clipping_bounds_the_scaler():
    x = torch.randn(1000)
    x[0] = 100.0
    y = get_codec("terngrad", clip=2.5).decode(get_codec("terngrad", clip=2.5).encode(x))
    bound = 2.5 * float(x.std(correction=0))
    assert float(y.abs().max()) <= bound * (1 + 1e-6)
    assert set(y.abs().unique().tolist()) <= {0.0, float(y.abs().max())}


def test_dgc_nbytes():
    for n in (10, 1000, 70000):
        codec = get_codec("dgc", density=0.01, warmup_epochs=0)
        p = codec.encode(torch.randn(n))
        k = p.tensors[0].numel()
        bits = max(1, math.ceil(math.log2(n)))
        assert 1 <= k <= math.ceil(0.01 * n)
        assert p.nbytes == 4 * k + math.ceil(k * bits / 8) + header_bytes(1, 2, 2)


def test_atomo_nbytes():
    x = torch.randn(9, 4, 2)
    p = get_codec("atomo", budget=3).encode(x)
    k = parse_header(p.header).params[0]
    assert p.tensors[0].numel() == 9 * k and p.tensors[1].numel() == k * 8
    assert p.nbytes == 4 * k * (9 + 8) + header_bytes(3, 1, 2)


# --- unbiasedness ---------------------------------------------------------------------


def mean_of_decodes(codec, x: torch.Tensor, trials: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and per-element variance of ``trials`` decodes (the codec's step advances)."""
    ys = torch.stack([codec.decode(codec.encode(x)).double() for _ in range(trials)])
    return ys.mean(0), ys.var(0)


@pytest.mark.parametrize(
    "name, options",
    [
        ("qsgd", {"levels": 2}),
        ("qsgd", {"levels": 4, "norm": "max", "bucket_size": 8}),
        ("terngrad", {}),
        ("atomo", {"budget": 2}),
    ],
)
def test_unbiased(name, options):
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(7))
    trials = 1000
    mean, var = mean_of_decodes(get_codec(name, seed=11, **options), x, trials)
    err2 = float(((mean - x.double()) ** 2).sum())
    expected = float(var.sum()) / trials  # E||mean - x||^2 for an unbiased codec
    assert expected > 0
    assert err2 < 3 * expected, (err2, expected)


def test_onebit_is_biased_so_the_test_above_can_fail():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(7))
    codec = get_codec("onebit")
    y = codec.decode(codec.encode(x))
    assert float(((y - x) ** 2).sum()) > 0.1  # deterministic: the mean of decodes is y itself


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=60),
    st.integers(1, 9),
    st.sampled_from(["l2", "max"]),
)
@example([0.0, 1.401298464324817e-45], 1, "max")  # subnormal norm: s / N would overflow to inf
def test_qsgd_error_bound(values, levels, norm):
    x = torch.tensor(values)
    y = get_codec("qsgd", levels=levels, norm=norm).decode(get_codec("qsgd", levels=levels, norm=norm).encode(x))
    scale = float(x.norm()) if norm == "l2" else float(x.abs().max())
    assert torch.all((y - x).abs() <= scale / levels * (1 + 1e-5) + 1e-30)
    assert torch.all((y == 0) | (torch.sign(y) == torch.sign(x)))


# --- dgc --------------------------------------------------------------------------------


def test_dgc_threshold_keeps_about_the_density():
    n, density = 200_000, 0.01
    k = math.ceil(density * n)
    for seed in range(3):
        codec = get_codec("dgc", density=density, warmup_epochs=0, momentum=0.0, seed=seed)
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        y = codec.decode(codec.encode(x))
        kept = int((y != 0).sum())
        assert 0.75 * k <= kept <= k, kept
        # what is kept is the top of the distribution: all above the 1.5k-th largest magnitude
        assert float(y[y != 0].abs().min()) >= float(x.abs().topk(int(1.5 * k)).values[-1])
        torch.testing.assert_close(y[y != 0], x[y != 0])


def test_dgc_warmup_schedule():
    codec = get_codec("dgc")  # defaults: 25% -> 0.1% over 4 epochs
    densities = []
    for epoch in range(6):
        codec.set_epoch(epoch)
        densities.append(codec.current_density)
    expected = [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001]
    for got, want in zip(densities, expected):
        assert abs(got - want) / want < 0.03, (densities, expected)
    codec.set_epoch(0)
    p = codec.encode(torch.randn(4000))
    assert p.tensors[0].numel() <= 1000


def test_dgc_accumulates_what_is_not_sent():
    torch.manual_seed(0)
    codec = get_codec("dgc", density=0.05, warmup_epochs=0, momentum=0.0)
    total_in, total_out = torch.zeros(300), torch.zeros(300)
    for _ in range(20):
        g = torch.randn(300)
        total_in += g
        total_out += codec.decode(codec.encode(g))
    torch.testing.assert_close(total_out + codec.state_dict()["v"], total_in, rtol=1e-5, atol=1e-4)


def test_dgc_momentum_correction_and_masking():
    m = 0.9
    codec = get_codec("dgc", density=0.1, warmup_epochs=0, momentum=m)
    g1, g2 = torch.randn(50), torch.randn(50)
    y1 = codec.decode(codec.encode(g1))
    sent = y1 != 0
    torch.testing.assert_close(y1[sent], g1[sent])  # u = g, v = u on the first step
    state = codec.state_dict()
    assert torch.all(state["u"][sent] == 0) and torch.all(state["v"][sent] == 0)  # masking
    u2 = m * torch.where(sent, 0.0, g1) + g2
    v2 = torch.where(sent, 0.0, g1) + u2
    y2 = codec.decode(codec.encode(g2))
    torch.testing.assert_close(y2[y2 != 0], v2[y2 != 0])


def test_dgc_local_clipping():
    codec = get_codec("dgc", density=1.0, warmup_epochs=0, momentum=0.0, clip_norm=2.0, world_size=4)
    y = codec.decode(codec.encode(torch.full((16,), 10.0)))
    torch.testing.assert_close(float(y.norm()), 2.0 / math.sqrt(4), rtol=1e-5, atol=0)


def test_dgc_state_roundtrip_and_stream_check():
    a = get_codec("dgc", density=0.1, warmup_epochs=0)
    for _ in range(3):
        a.encode(torch.randn(64))
    b = get_codec("dgc", density=0.1, warmup_epochs=0)
    b.load_state_dict(a.state_dict())
    x = torch.randn(64)
    assert all(torch.equal(s, t) for s, t in zip(a.encode(x).tensors, b.encode(x).tensors))
    with pytest.raises(ValueError, match="stream"):
        a.encode(torch.randn(65))
    with pytest.raises(ValueError):
        get_codec("dgc", momentum=0.0).load_state_dict(a.state_dict())  # u present without momentum


# --- atomo ------------------------------------------------------------------------------


def test_atomo_probabilities_known_case_and_kkt():
    p = atomo_probabilities(torch.tensor([1.0, 4.0, 1.0]), 2)
    torch.testing.assert_close(p, torch.tensor([0.5, 1.0, 0.5]))
    w = torch.rand(40, generator=torch.Generator().manual_seed(0)) ** 3
    for budget in (1, 3, 10, 39, 40, 60):
        p = atomo_probabilities(w, budget)
        assert torch.all((p >= 0) & (p <= 1))
        torch.testing.assert_close(float(p.sum()), float(min(budget, 40)), rtol=1e-5, atol=1e-5)
        # KKT of min sum w^2/p s.t. sum p = budget, p <= 1: p = min(1, c * w)
        free = p < 1
        if free.any():
            c = p[free] / w[free]
            torch.testing.assert_close(c, c.expand_as(c).mean().expand_as(c), rtol=1e-4, atol=0)
            assert torch.all(w[~free] >= w[free].max() * (1 - 1e-6))
    assert torch.equal(atomo_probabilities(torch.tensor([3.0, 0.0, 2.0]), 5), torch.tensor([1.0, 0.0, 1.0]))


def test_atomo_exact_when_budget_covers_rank():
    g = torch.Generator().manual_seed(2)
    for shape, rank in [((12, 9), 3), ((7, 3, 3), 2), ((5, 20), 5)]:
        m, n = shape[0], math.prod(shape[1:])
        x = (torch.randn(m, rank, generator=g) @ torch.randn(rank, n, generator=g)).view(shape)
        for budget in (min(m, n), rank):
            codec = get_codec("atomo", budget=budget, seed=5)
            for _ in range(5):
                torch.testing.assert_close(codec.decode(codec.encode(x)), x, rtol=1e-4, atol=1e-4)
    x = torch.randn(6, 4)
    p = get_codec("atomo", budget=1).encode(x)
    k = parse_header(p.header).params[0]
    assert k <= 4 and torch.linalg.matrix_rank(get_codec("atomo").decode(p)) <= k


def test_dithering_is_an_alias_of_qsgd():
    x = torch.randn(20)
    a, b = get_codec("dithering", levels=3, seed=2), get_codec("qsgd", levels=3, seed=2)
    pa = a.encode(x)
    assert a.name == "qsgd" and a.codec_id == 9
    assert torch.equal(pa.header, b.encode(x).header)
    torch.testing.assert_close(b.decode(pa), a.decode(pa))
