"""lowrank: exact on low-rank tensors, near the SVD optimum with power iterations, wire size, edge cases."""

import pytest
import torch

from dgpipe.compression import get_codec, parse_header


def low_rank_tensor(shape, rank, seed=0):
    g = torch.Generator().manual_seed(seed)
    n0, m = shape[0], torch.Size(shape[1:]).numel()
    return (torch.randn(n0, rank, generator=g) @ torch.randn(rank, m, generator=g)).view(shape)


@pytest.mark.parametrize("shape", [(16, 40), (8, 3, 5, 5), (50, 6)])
@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("power_iters", [0, 2])
def test_exact_on_rank_r(shape, rank, power_iters):
    x = low_rank_tensor(shape, rank)
    codec = get_codec("lowrank", rank=rank, power_iters=power_iters)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape
    torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4 * float(x.abs().max()))


def test_rank_at_least_the_matrix_size_is_exact():
    x = torch.randn(5, 7)
    codec = get_codec("lowrank", rank=9)
    p = codec.encode(x)
    assert parse_header(p.header).tensor_specs[0][1] == 5 * 5  # P is 5 x 5: the rank is clipped to min(n0, m)
    torch.testing.assert_close(codec.decode(p), x, rtol=1e-4, atol=1e-4)


def test_power_iterations_approach_the_svd_optimum():
    g = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(60, 60, generator=g))
    v, _ = torch.linalg.qr(torch.randn(80, 60, generator=g))
    x = u @ torch.diag(0.7 ** torch.arange(60.0)) @ v.T  # decaying spectrum
    r = 4
    s = torch.linalg.svdvals(x)
    best = float((s[r:] ** 2).sum())  # Eckart-Young: the least squared error of any rank-r matrix
    errs = []
    for iters in (0, 1, 3):
        codec = get_codec("lowrank", rank=r, power_iters=iters)
        y = codec.decode(codec.encode(x))
        errs.append(float(((y - x) ** 2).sum()))
    assert all(e >= best * (1 - 1e-4) for e in errs)
    assert errs[2] < errs[0] and errs[2] <= 1.1 * best


@pytest.mark.parametrize("shape,rank", [((64, 32, 7, 7), 4), ((10,), 2), ((), 3), ((3, 4), 1)])
def test_nbytes(shape, rank):
    x = torch.randn(shape)
    n0 = shape[0] if shape else 1
    m = x.numel() // n0
    r = min(rank, n0, m)
    p = get_codec("lowrank", rank=rank).encode(x)
    assert p.nbytes == 4 * r * (n0 + m) + 8 * (4 + len(shape) + 1 + 1 + 1 + 2 * 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(dtype):
    x = low_rank_tensor((6, 9), 2).to(dtype)
    codec = get_codec("lowrank", rank=2)
    y = codec.decode(codec.encode(x))
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), x.double(), rtol=0.02, atol=0.02 * float(x.abs().max()))


def test_edge_shapes_and_zeros():
    codec = get_codec("lowrank", rank=2)
    for x in (torch.tensor(3.5), torch.zeros(0, 4), torch.zeros(4, 0), torch.zeros(5, 6), torch.randn(7)):
        y = codec.decode(codec.encode(x))
        assert y.shape == x.shape
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)  # 0-d, 1-D (m = 1) and zero matrices are exact
    x = torch.randn(6, 8).t()  # non-contiguous
    torch.testing.assert_close(codec.decode(codec.encode(x)), codec.decode(codec.encode(x.contiguous())))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_inf_nan_raise(bad):
    x = torch.randn(4, 4)
    x[1, 2] = bad
    with pytest.raises(ValueError, match="inf/NaN"):
        get_codec("lowrank").encode(x)


@pytest.mark.parametrize("opts", [dict(rank=0), dict(power_iters=-1), dict(rank=2.0), dict(rank=True)])
def test_bad_options(opts):
    with pytest.raises(ValueError):
        get_codec("lowrank", **opts)
