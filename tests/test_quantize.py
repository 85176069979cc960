"""Uniform quantization (``quant``): error bounds, groups, stochastic rounding, exact wire size, edge cases."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgpipe.compression import Payload, get_codec
from dgpipe.compression.kernels.bitpack import unpack_bits


def header_bytes(ndim: int, n_params: int, n_tensors: int) -> int:
    return 8 * (4 + ndim + 1 + n_params + 1 + 2 * n_tensors)


def grid_of(payload, n_groups):
    """(lo, step) per group as sent."""
    params = payload.tensors[1]
    return params[:n_groups], params[n_groups:]


@settings(max_examples=40, deadline=None)
@given(
    bits=st.integers(1, 16),
    shape=st.lists(st.integers(1, 9), min_size=0, max_size=3),
    scale=st.sampled_from([1e-3, 1.0, 1e4]),
    seed=st.integers(0, 2**31),
)
def test_within_half_a_step(bits, shape, scale, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    codec = get_codec("quant", bits=bits)
    p = codec.encode(x)
    y = codec.decode(p)
    lo, step = grid_of(p, 1)
    err = (y - x).abs()
    assert float(err.max()) <= float(step) / 2 * (1 + 1e-5) + 1e-6 * scale
    # the grid is [min, max] with 2**bits points
    assert float(lo) == float(x.min())
    assert math.isclose(float(step) * ((1 << bits) - 1), float(x.max() - x.min()), rel_tol=1e-5)
    # codes are in range and decode to lo + code * step
    codes = unpack_bits(p.tensors[0], bits, x.numel())
    assert int(codes.max()) < 1 << bits
    torch.testing.assert_close(y.reshape(-1), lo + codes.float() * step, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [1, 4, 8, 12, 16])
def test_decode_of_encode_is_idempotent(bits):
    codec = get_codec("quant", bits=bits)
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(bits))
    y = codec.decode(codec.encode(x))
    y2 = codec.decode(codec.encode(y))
    step = float(x.max() - x.min()) / ((1 << bits) - 1)
    assert float((y2 - y).abs().max()) <= 1e-3 * step + 1e-6


@pytest.mark.parametrize(
    "bits,group_size,shape", [(8, 0, (3, 5, 7)), (3, 16, (100,)), (16, 7, (10, 10)), (5, 1000, (9,))]
)
def test_exact_nbytes(bits, group_size, shape):
    x = torch.randn(shape)
    n = x.numel()
    groups = math.ceil(n / group_size) if group_size else 1
    p = get_codec("quant", bits=bits, group_size=group_size).encode(x)
    assert p.nbytes == math.ceil(n * bits / 8) + 8 * groups + header_bytes(len(shape), 2, 2)  # params: bits, grouping


def test_groups_confine_an_outlier():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    x[3] = 1e4
    per_tensor = get_codec("quant", bits=6)
    grouped = get_codec("quant", bits=6, group_size=100)
    p = grouped.encode(x)
    y = grouped.decode(p)
    lo, step = grid_of(p, 10)
    # every value within half its own group's step
    err = (y - x).abs().view(10, 100)
    assert bool((err <= step[:, None] / 2 * (1 + 1e-5) + 1e-6).all())
    # the groups without the outlier are as good as if it did not exist
    clean = x.clone()
    clean[3] = 0.0
    e_grouped = ((y - x) ** 2)[100:].mean()
    e_tensor = ((per_tensor.decode(per_tensor.encode(x)) - x) ** 2)[100:].mean()
    assert e_grouped * 1000 < e_tensor
    assert float(lo[0]) == float(x[:100].min())


def test_ragged_last_group():
    x = torch.arange(10.0)
    codec = get_codec("quant", bits=2, group_size=4)
    p = codec.encode(x)
    lo, step = grid_of(p, 3)
    assert lo.tolist() == [0.0, 4.0, 8.0]
    torch.testing.assert_close(step, torch.tensor([1.0, 1.0, 1 / 3]))
    torch.testing.assert_close(codec.decode(p), x)


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    x = torch.linspace(-1, 1, 37)
    codec = get_codec("quant", bits=2, stochastic=True)
    step = 2 / 3
    torch.manual_seed(0)
    ys = torch.stack([codec.decode(codec.encode(x)) for _ in range(3000)])
    assert float((ys - x).abs().max()) < step * (1 + 1e-6)
    # mean of 3000 draws: standard error <= step / 2 / sqrt(3000) ~ 0.006
    assert float((ys.mean(0) - x).abs().max()) < 0.03
    # deterministic rounding of the same x is biased at some points
    det = get_codec("quant", bits=2)
    assert float((det.decode(det.encode(x)) - x).abs().max()) > 0.1


@pytest.mark.parametrize("value", [0.0, -3.5, 1e30])
def test_constant_tensor_is_exact(value):
    x = torch.full((4, 5), value)
    for codec in (get_codec("quant", bits=3), get_codec("quant", bits=3, group_size=3)):
        assert torch.equal(codec.decode(codec.encode(x)), x)


def test_empty_and_zero_dim():
    codec = get_codec("quant", bits=5, group_size=4)
    for x in (torch.zeros(0, 3), torch.tensor(2.5)):
        y = codec.decode(codec.encode(x))
        assert y.shape == x.shape and torch.equal(y, x)
    y = get_codec("quant").decode(get_codec("quant").encode(torch.zeros(0)))
    assert y.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_in_and_out(dtype):
    x = torch.randn(6, 7).to(dtype)
    codec = get_codec("quant", bits=8)
    y = codec.decode(codec.encode(x))
    assert y.dtype == dtype and y.shape == x.shape
    step = float(x.max() - x.min()) / 255
    tol = step / 2 + float(x.abs().max()) * torch.finfo(dtype).eps
    assert float((y.double() - x.double()).abs().max()) <= tol


def test_non_contiguous_input():
    base = torch.randn(8, 6)
    x = base.t()[::2]
    codec = get_codec("quant", bits=6)
    assert not x.is_contiguous()
    torch.testing.assert_close(codec.decode(codec.encode(x)), codec.decode(codec.encode(x.contiguous())))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_inf_nan_raise(bad):
    x = torch.randn(10)
    x[4] = bad
    for codec in (get_codec("quant", bits=4), get_codec("quant", bits=4, group_size=3)):
        with pytest.raises(ValueError, match="inf/NaN"):
            codec.encode(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("opts", [dict(bits=8), dict(bits=4, group="token", scale_dtype="bfloat16")])
def test_decode_refuses_a_grid_that_is_not_finite(bad, opts):
    """A GPU encoder of one grid sends its range unchecked (no read back): the decoder is where inf/NaN stop."""
    codec = get_codec("quant", **opts)
    p = codec.encode(torch.randn(4, 64))
    packed, meta = p.tensors
    meta = meta.clone()
    meta[-1] = bad
    with pytest.raises(ValueError, match="grid that is not finite"):
        codec.decode(Payload(p.header, (packed, meta)))


def test_range_overflow_raises():
    with pytest.raises(ValueError, match="wider than float32"):
        get_codec("quant", bits=4).encode(torch.tensor([-3e38, 3e38]))


@pytest.mark.parametrize("opts", [dict(bits=0), dict(bits=17), dict(bits=4.0), dict(group_size=-1), dict(foo=1)])
def test_bad_options(opts):
    with pytest.raises(ValueError):
        get_codec("quant", **opts)


def test_integer_input_rejected():
    with pytest.raises(ValueError, match="floating"):
        get_codec("quant").encode(torch.arange(5))
