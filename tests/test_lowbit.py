"""Low-bit codec steps: Hadamard rotation, per-group scaling, codebook levels,
stochastic rounding, all bit widths, bad options, and a two-rank pipeline step.

Error bounds and codes are checked against independent float64/numpy computations,
wire bytes against the documented formula (metadata and header included).
"""

import copy
import math

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from torch import nn

from dgpipe.compression import get_codec
from dgpipe.compression.kernels.radix import pack_radix, radix_layout, radix_nbytes, unpack_radix
from dgpipe.compression.steps.levels import fit_levels, normal_codebook, normal_levels
from dgpipe.compression.steps.grouping import Grouping
from dgpipe.compression.kernels import fwht
from dgpipe.compression.steps.hadamard import HadamardRotation, random_signs
from dgpipe.pipeline import Pipeline
from dgpipe.compression import CodecSpec
from helpers import assert_ranks_ok, spawn_checks

BF16, FP16 = "bfloat16", "float16"
META_BYTES = {"float32": 4, FP16: 2, BF16: 2}


def header_bytes(ndim: int, n_params: int, n_tensors: int) -> int:
    return 8 * (4 + ndim + 1 + n_params + 1 + 2 * n_tensors)


def outlier_hidden(shape=(4, 12, 96), seed=0) -> torch.Tensor:
    """A transformer-like hidden state: Gaussian, plus 3 outlier features 20x larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    d = shape[-1]
    x[..., [5 * d // 96, 40 * d // 96, 77 * d // 96]] *= 20
    return x


def rel_mse(x, y) -> float:
    return float(((x.double() - y.double()) ** 2).mean() / x.double().var())


# --- Hadamard rotation -------------------------------------------------------------------

@pytest.mark.parametrize("b", [1, 2, 4, 8, 64])
def test_fwht_equals_scipy_hadamard_and_is_its_own_inverse(b):
    x = torch.randn(5, b, dtype=torch.float64)
    expected = x.numpy() @ scipy.linalg.hadamard(b) / math.sqrt(b)
    np.testing.assert_allclose(fwht(x).numpy(), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fwht(fwht(x)), x, rtol=1e-12, atol=1e-12)


def test_fwht_refuses_a_width_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.randn(3, 6))


@pytest.mark.parametrize("d, width, block", [(64, 64, 64), (384, 384, 128), (96, 96, 32), (7, 8, 8), (40, 64, 64), (1, 1, 1)])
def test_rotation_is_orthonormal_with_an_exact_inverse(d, width, block):
    rot = HadamardRotation(d)
    assert (rot.width, rot.block) == (width, block)
    x = torch.randn(6, d, dtype=torch.float64).float()
    y = rot.forward(x)
    assert y.shape == (6, width)
    # the same as the dense matrix: signs, zero padding, block-diagonal Hadamard
    dense = np.kron(np.eye(width // block), scipy.linalg.hadamard(block)) / math.sqrt(block)
    padded = np.zeros((6, width))
    padded[:, :d] = x.double().numpy() * random_signs(d).double().numpy()
    np.testing.assert_allclose(y.double().numpy(), padded @ dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y.norm(dim=1).numpy(), x.norm(dim=1).numpy(), rtol=1e-5)  # orthonormal
    torch.testing.assert_close(rot.inverse(y), x, rtol=1e-5, atol=1e-5)


def test_rotation_signs_are_derived_from_the_width_not_sent():
    assert torch.equal(random_signs(384), random_signs(384))
    assert not torch.equal(random_signs(384)[:256], random_signs(256))
    assert set(random_signs(1000).tolist()) == {-1.0, 1.0}


def test_rotation_spreads_outlier_features():
    x = outlier_hidden().reshape(-1, 96)
    y = HadamardRotation(96).forward(x)
    peak_to_rms = lambda t: float((t.abs().amax(1) / t.pow(2).mean(1).sqrt()).mean())  # noqa: E731
    assert peak_to_rms(x) > 5 and peak_to_rms(y) < 3.5


# --- grouping -----------------------------------------------------------------------------

@pytest.mark.parametrize("opts, shape, groups", [
    (dict(), (4, 6, 8), (1, 192)),
    (dict(group="token"), (4, 6, 8), (24, 8)),
    (dict(group="channel"), (4, 6, 8), (8, 24)),
    (dict(group="channel", axis=1), (4, 6, 8), (6, 32)),
    (dict(group="tile", group_size=50), (4, 6, 8), (4, 50)),
    (dict(group="token", rotate="hadamard"), (4, 6, 7), (24, 8)),
])  # fmt: skip
def test_grouping_rows_and_restore_are_inverse(opts, shape, groups):
    gp = Grouping(**opts).validate("t")
    x = torch.randn(shape)
    rows = gp.rows(x)
    assert tuple(rows.shape) == groups == gp.counts(shape)[:2]
    if opts.get("group") == "channel":  # a row is one index of the axis
        axis = opts.get("axis", -1)
        torch.testing.assert_close(rows[2], x.movedim(axis, 0)[2].reshape(-1))
    back = gp.restore(gp.sent(rows, shape), shape)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


# --- per-group uniform quantization ------------------------------------------------------

def reference_grid(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 per-row min-max grid: (decoded, lo, step)."""
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    step = (hi - lo) / (2**bits - 1)
    level = np.where(step > 0, np.round((x - lo) / np.where(step > 0, step, 1)), 0)
    return lo + level * step, lo, step


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_per_token_quant_equals_an_independent_float64_computation(bits):
    x = outlier_hidden()
    y = get_codec("quant", bits=bits, group="token").decode(get_codec("quant", bits=bits, group="token").encode(x))
    expected, _, step = reference_grid(x.reshape(-1, 96).double().numpy(), bits)
    got = y.reshape(-1, 96).double().numpy()
    # equal up to float32 rounding of the grid (a value on a rounding tie may pick the other level)
    off = np.abs(got - expected) > 1e-4 * np.maximum(1, np.abs(expected))
    assert off.mean() < 1e-3
    assert (np.abs(got - x.reshape(-1, 96).double().numpy()) <= step / 2 * (1 + 1e-4) + 1e-6).all()


@pytest.mark.parametrize("scale_dtype", ["float32", FP16, BF16])
@pytest.mark.parametrize("opts", [dict(group="token"), dict(group="channel"), dict(group="tile", group_size=64),
                                  dict(group="token", rotate="hadamard")])
def test_per_group_error_within_half_a_step_of_its_own_group(opts, scale_dtype):
    x = outlier_hidden()
    codec = get_codec("quant", bits=3, scale_dtype=scale_dtype, **opts)
    p = codec.encode(x)
    y = codec.decode(p)
    gp = codec.grouping
    rows_x, rows_y = gp.rows(x).double(), gp.rows(y).double()  # the same rotation and grouping
    ng = rows_x.shape[0]
    step = p.tensors[1][ng:].double()[:, None]
    assert p.tensors[1].dtype == gp.meta_dtype
    # metadata rounded outward: the grid still covers the group
    lo = p.tensors[1][:ng].double()[:, None]
    hi = rows_x.amax(1, keepdim=True)
    assert bool((lo <= rows_x.amin(1, keepdim=True)).all()) and bool((lo + 7 * step >= hi - 1e-5 * hi.abs()).all())
    slack = 1e-4 if opts.get("rotate") else 1e-6
    assert bool(((rows_x - rows_y).abs() <= step / 2 + slack).all())
    # per-group scales beat one scale for the tensor on outlier features
    assert rel_mse(x, y) < rel_mse(x, get_codec("quant", bits=3).decode(get_codec("quant", bits=3).encode(x)))


@pytest.mark.parametrize("name, opts, bits_per_value, meta_per_group", [
    ("quant", dict(bits=3, group="token", scale_dtype=BF16), 3, 2 * 2),
    ("quant", dict(bits=5, group="channel", axis=1, scale_dtype=FP16), 5, 2 * 2),
    ("quant", dict(bits=4, group="tile", group_size=100, rotate="hadamard"), 4, 2 * 4),
    ("sortquant", dict(quant_bits=2, split_bits=1, group="token", scale_dtype=BF16), 3, 2 * 2 * 2),
    ("sortquant", dict(quant_bits=1, split_bits=1, group="tensor", rotate="hadamard"), 2, 2 * 2 * 4),
    ("codebook", dict(bits=2, group="token", rotate="hadamard", scale_dtype=BF16), 2, 2),
    ("codebook", dict(bits=3, levels="fit", group="token", scale_dtype=FP16), 3, 2),
])  # fmt: skip
@pytest.mark.parametrize("shape", [(4, 12, 96), (3, 5, 7)])
def test_exact_wire_bytes_with_metadata(name, opts, bits_per_value, meta_per_group, shape):
    x = torch.randn(shape)
    p = get_codec(name, **opts).encode(x)
    rshape = list(shape)
    if opts.get("rotate") == "hadamard":
        rshape[-1] = HadamardRotation(shape[-1]).width  # 7 -> 8: padding is sent
    n = math.prod(rshape)
    group = opts.get("group")
    groups = {"token": n // rshape[-1], "channel": rshape[opts.get("axis", -1)], "tensor": 1,
              "tile": -(-n // opts.get("group_size", 1))}[group]
    n_params = {"quant": 2, "sortquant": 3, "codebook": 3}[name]
    table = 4 * 2 ** opts["bits"] if opts.get("levels") == "fit" else 0
    n_tensors = 3 if table else 2
    expected = math.ceil(n * bits_per_value / 8) + groups * meta_per_group + table + header_bytes(len(shape), n_params, n_tensors)
    assert p.nbytes == expected


# --- per-group sort quantization ----------------------------------------------------------

@pytest.mark.parametrize("q, s", [(1, 1), (2, 1), (1, 2), (3, 2)])
def test_grouped_sortquant_has_equal_count_buckets_per_group(q, s):
    x = torch.randn(6, 64)
    codec = get_codec("sortquant", quant_bits=q, split_bits=s, group="token")
    p = codec.encode(x)
    from dgpipe.compression.kernels.bitpack import unpack_bits

    codes = unpack_bits(p.tensors[0], q + s, x.numel()).view(6, 64)
    buckets = codes >> q
    for row, b in zip(x, buckets):
        counts = torch.bincount(b, minlength=2**s)
        assert (counts == 64 // 2**s).all()
        # bucket order follows value order: every value of bucket i is <= every value of bucket i+1
        for i in range(2**s - 1):
            assert row[b == i].max() <= row[b == i + 1].min()
    y = codec.decode(p)
    mins, steps = p.tensors[1][: 6 * 2**s].view(6, -1), p.tensors[1][6 * 2**s :].view(6, -1)
    err = (x - y).abs()
    assert bool((err <= torch.gather(steps, 1, buckets) / 2 + 1e-6).all())


def test_grouped_sortquant_with_fewer_values_than_buckets():
    x = torch.randn(5, 3)
    codec = get_codec("sortquant", quant_bits=2, split_bits=3, group="token")
    torch.testing.assert_close(codec.decode(codec.encode(x)), x, rtol=0, atol=1e-6)  # one value per bucket at most


# --- codebook -------------------------------------------------------------------------------

def test_normal_levels_match_max_1960():
    torch.testing.assert_close(normal_levels(1), torch.tensor([-0.7979, 0.7979]), atol=1e-4, rtol=0)
    torch.testing.assert_close(normal_levels(2), torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104]), atol=1e-4, rtol=0)
    three = torch.tensor([0.2451, 0.7560, 1.3439, 2.1519])
    torch.testing.assert_close(normal_levels(3), torch.cat((-three.flip(0), three)), atol=1e-4, rtol=0)


def test_normal_levels_minimise_gaussian_mse():
    """Lloyd-Max levels beat a uniform grid and normal-quantile levels of the same count on N(0,1)."""
    v = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
    for bits in (2, 3, 4):
        def mse(levels):
            idx = torch.bucketize(v, (levels[1:] + levels[:-1]) / 2)
            return float(((v - levels[idx]) ** 2).mean())
        n = 2**bits
        quantiles = torch.special.ndtri((torch.arange(n) + 0.5) / n)
        uniform = torch.linspace(-3, 3, n)
        assert mse(normal_levels(bits)) < min(mse(quantiles), mse(uniform))


def test_fitted_levels_adapt_to_a_skewed_distribution():
    v = torch.distributions.Exponential(1.0).sample((50_000,))
    fitted = fit_levels(v, 4)
    idx = lambda lv: torch.bucketize(v, (lv[1:] + lv[:-1]) / 2)  # noqa: E731
    err = lambda lv: float(((v - lv[idx(lv)]) ** 2).mean())  # noqa: E731
    assert err(fitted) < 0.5 * err(normal_levels(2))


def test_codebook_decodes_to_level_times_group_scale():
    x = outlier_hidden()
    codec = get_codec("codebook", bits=3, group="token")
    p = codec.encode(x)
    rows = x.reshape(-1, 96).double()
    rms = rows.pow(2).mean(1, keepdim=True).sqrt()
    torch.testing.assert_close(p.tensors[1].double()[:, None], rms, rtol=1e-6, atol=0)
    levels = normal_levels(3).double()
    v = rows / rms
    expected = levels[(v[..., None] - levels).abs().argmin(-1)] * rms
    torch.testing.assert_close(codec.decode(p).reshape(-1, 96).double(), expected, rtol=1e-5, atol=1e-5)


# --- level counts that are not a power of two: radix packing -------------------------------

def test_radix_layout_packs_near_log2_of_the_count():
    assert [radix_layout(c) for c in (3, 5, 6, 7)] == [(17, 27), (3, 7), (5, 13), (11, 31)]
    assert [radix_layout(1 << m) for m in (1, 2, 3, 16)] == [(1, 1), (1, 2), (1, 3), (1, 16)]
    for count in range(2, 300):
        k, b = radix_layout(count)
        assert count**k <= 2**b <= 2**31  # every word fits its bits
        assert b / k <= (count - 1).bit_length()  # never more than whole-bit codes
        assert count > 16 or b / k <= math.log2(count) + 0.25


def test_radix_words_are_base_count_numbers_of_k_codes():
    # 5 levels: 3 codes per 7-bit word, word = c0 + 5 c1 + 25 c2; words bit-packed at 7 bits
    codes = torch.tensor([1, 2, 3, 4, 0, 4, 2])  # words 86, 104, 2 (the last completed with zeros)
    packed = pack_radix(codes, 5)
    bits = "".join(format(w, "07b")[::-1] for w in (86, 104, 2))  # little-endian bit stream of 3 words
    expected = [int(bits[i : i + 8].ljust(8, "0")[::-1], 2) for i in range(0, 21, 8)]
    assert packed.tolist() == expected and radix_nbytes(7, 5) == 3


@pytest.mark.parametrize("count", [3, 5, 6, 7, 11, 100, 1000])
@pytest.mark.parametrize("n", [0, 1, 16, 4097, 3 * 4096 * 11 + 5])
def test_radix_packing_round_trips(count, n):
    codes = torch.randint(count, (n,), generator=torch.Generator().manual_seed(n + count))
    packed = pack_radix(codes, count)
    assert packed.dtype == torch.uint8 and packed.numel() == radix_nbytes(n, count)
    assert torch.equal(unpack_radix(packed, count, n), codes)


@pytest.mark.parametrize("count", [3, 5, 6, 7])
def test_normal_codebook_of_any_count_is_lloyd_max(count):
    levels = normal_codebook(count).double()
    assert torch.equal(levels, -levels.flip(0))  # symmetric; an odd count has an exact 0
    # each level is the conditional mean of its cell under N(0, 1): the centroid condition, to 1e-6
    v = torch.randn(4_000_000, generator=torch.Generator().manual_seed(count), dtype=torch.float64)
    idx = torch.bucketize(v, (levels[1:] + levels[:-1]) / 2)
    means = torch.zeros(count, dtype=torch.float64).index_add_(0, idx, v) / torch.bincount(idx, minlength=count)
    torch.testing.assert_close(means, levels, atol=5e-3, rtol=0)
    assert normal_codebook(4).tolist() == normal_levels(2).tolist()


@pytest.mark.parametrize("count, mse", [(3, 0.1902), (5, 0.07994), (6, 0.05798), (7, 0.04400)])
def test_codebook_with_a_level_count_decodes_to_level_times_scale(count, mse):
    """Codes of ``count`` levels: the nearest level times the token's RMS scale (an independent
    float64 computation), the Lloyd-Max error of Max's 1960 table on Gaussian data, exact wire bytes."""
    x = torch.randn(64, 8, 96, generator=torch.Generator().manual_seed(count))
    codec = get_codec("codebook", count=count, group="token")
    p = codec.encode(x)
    rows = x.reshape(-1, 96).double()
    rms = rows.pow(2).mean(1, keepdim=True).sqrt()
    levels = normal_codebook(count).double()
    expected = levels[(rows / rms - levels[:, None, None]).abs().argmin(0)] * rms
    y = codec.decode(p)
    torch.testing.assert_close(y.reshape(-1, 96).double(), expected, rtol=1e-5, atol=1e-5)
    assert float(((y - x) ** 2).mean() / (x**2).mean()) == pytest.approx(mse, rel=0.05)
    n = x.numel()
    assert p.nbytes == radix_nbytes(n, count) + 4 * (n // 96) + header_bytes(3, 4, 2)


def test_codebook_count_of_a_power_of_two_is_the_bits_codec():
    x = outlier_hidden()
    a = get_codec("codebook", count=8, group="token", rotate="hadamard").encode(x)
    b = get_codec("codebook", bits=3, group="token", rotate="hadamard").encode(x)
    assert torch.equal(a.header, b.header) and all(torch.equal(u, v) for u, v in zip(a.tensors, b.tensors))


def test_codebook_count_with_fitted_levels_sends_them():
    x = torch.distributions.Exponential(1.0).sample((4096,))
    codec = get_codec("codebook", count=5, levels="fit")
    p = codec.encode(x)
    assert p.tensors[2].numel() == 5 and p.nbytes == radix_nbytes(4096, 5) + 4 + 4 * 5 + header_bytes(1, 4, 3)
    assert float(((codec.decode(p) - x) ** 2).mean()) < float(((get_codec("codebook", count=5).decode(
        get_codec("codebook", count=5).encode(x)) - x) ** 2).mean())


def test_codebook_count_in_a_corrupt_header_is_refused():
    codec = get_codec("codebook", count=5, group="token")
    p = codec.encode(torch.randn(4, 96))
    for i, bad in ((10, 8), (10, 4), (10, 9)):  # header: magic, codec, dtype, ndim, 2 sizes, n_params, 4 params
        h = p.header.clone()
        assert int(h[i]) == 5
        h[i] = bad
        with pytest.raises(ValueError, match="count"):
            codec.decode(type(p)(h, p.tensors))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("data", ["gaussian", "outliers"])
def test_codebook_is_at_least_as_good_as_quant_and_sortquant(bits, data):
    """At equal bits the codebook codec beats per-tensor uniform and sort quantization, and on Gaussian
    data also per-token uniform quantization (with synthetic block outliers per-token uniform can win:
    docs/quality.md's real-tensor table is the measure)."""
    x = outlier_hidden() if data == "outliers" else torch.randn(4, 12, 96, generator=torch.Generator().manual_seed(2))
    rt = lambda c: rel_mse(x, c.decode(c.encode(x)))  # noqa: E731
    for levels in ("normal", "fit"):
        best = rt(get_codec("codebook", bits=bits, levels=levels, group="token", rotate="hadamard", scale_dtype=BF16))
        others = [get_codec("quant", bits=bits), get_codec("sortquant", quant_bits=max(bits - 1, 1), split_bits=bits - 1 and 1)]
        if data == "gaussian":
            others.append(get_codec("quant", bits=bits, group="token", scale_dtype=BF16))
        assert all(best <= rt(c) for c in others), (levels, best, [rt(c) for c in others])


# --- stochastic rounding, bit widths, bad options --------------------------------------------

@pytest.mark.parametrize("name, opts", [
    ("quant", dict(bits=2, group="token", rotate="hadamard", scale_dtype=BF16)),
    ("sortquant", dict(quant_bits=1, split_bits=1, group="token")),
    ("codebook", dict(bits=2, group="token", scale_dtype=BF16)),
])  # fmt: skip
def test_stochastic_rounding_is_unbiased(name, opts):
    torch.manual_seed(0)
    # half the values +-1, half uniform in [-1, 1]: per-row RMS ~0.82, so |x| / RMS <= 1.23 stays inside
    # the 2-bit codebook's outer levels (+-1.51): no clipping
    x = torch.where(torch.rand(4, 32) < 0.5, torch.randint(0, 2, (4, 32)) * 2.0 - 1, torch.rand(4, 32) * 2 - 1)
    codec = get_codec(name, stochastic=True, **opts)
    draws = 4000
    mean = sum(codec.decode(codec.encode(x)) for _ in range(draws)) / draws
    nearest = get_codec(name, **opts)
    bias_nearest = (nearest.decode(nearest.encode(x)) - x).abs().mean()
    assert (mean - x).abs().mean() < 0.1 * bias_nearest
    assert (mean - x).abs().max() < 0.05


@pytest.mark.parametrize("name", ["quant", "sortquant", "codebook"])
def test_every_bit_width_from_1_to_16(name):
    x = outlier_hidden((2, 8, 64))
    errors = []
    for bits in range(1, 17):
        if name == "sortquant":
            opts = dict(quant_bits=max(bits - 1, 1), split_bits=min(bits - 1, 1), group="token")
        else:
            opts = dict(bits=bits, group="token", rotate="hadamard")
        codec = get_codec(name, **opts)
        p = codec.encode(x)
        y = codec.decode(p)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert p.tensors[0].numel() == math.ceil(x.numel() * bits / 8)
        errors.append(rel_mse(x, y))
    assert all(b < a for a, b in zip(errors[1:], errors[2:]))  # more bits, less error (from 2 bits)
    assert errors[-1] < 1e-6


@pytest.mark.parametrize("name, opts, match", [
    ("quant", dict(group="token", group_size=8), "group_size"),
    ("quant", dict(group="tile"), "group_size"),
    ("quant", dict(group="row"), "group must be"),
    ("quant", dict(rotate="fourier"), "rotate"),
    ("quant", dict(scale_dtype="float8"), "scale_dtype"),
    ("quant", dict(axis=99, group="channel"), "axis"),
    ("sortquant", dict(quant_bits=0, split_bits=1), "quant_bits"),
    ("sortquant", dict(group="tile", group_size=-3), "group_size"),
    ("codebook", dict(bits=0), "bits"),
    ("codebook", dict(bits=17), "bits"),
    ("codebook", dict(levels="nf4"), "levels"),
    ("codebook", dict(count=1), "count"),
    ("codebook", dict(count=65537), "count"),
    ("codebook", dict(bits=2, count=5), "not both"),
])  # fmt: skip
def test_bad_options_are_refused(name, opts, match):
    with pytest.raises(ValueError, match=match):
        get_codec(name, **opts)


@pytest.mark.parametrize("name", ["quant", "codebook"])
def test_rotation_of_a_non_floating_tensor_is_refused(name):
    with pytest.raises(ValueError, match="floating"):
        get_codec(name, rotate="hadamard", group="token").encode(torch.arange(12).view(3, 4))


def test_metadata_overflowing_float16_is_refused_with_the_fix():
    x = torch.tensor([[0.0, 1e6], [1.0, 2.0]])
    with pytest.raises(ValueError, match="overflows scale_dtype float16; use scale_dtype='bfloat16'"):
        get_codec("quant", bits=4, group="token", scale_dtype=FP16).encode(x)
    y = get_codec("quant", bits=4, group="token", scale_dtype=BF16)
    assert y.decode(y.encode(x))[0, 1] == pytest.approx(1e6, rel=1e-2)


def test_tiny_gradients_keep_their_scale_in_bfloat16():
    g = torch.randn(8, 64) * 1e-9
    codec = get_codec("codebook", bits=4, group="token", rotate="hadamard", scale_dtype=BF16)
    assert rel_mse(g, codec.decode(codec.encode(g))) < 0.02


@pytest.mark.parametrize("name", ["quant", "sortquant", "codebook"])
def test_inf_and_nan_are_refused(name):
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="inf/NaN"):
        get_codec(name, group="token", rotate="hadamard").encode(x)


# --- a two-rank pipeline step with rotated per-group codecs in both directions ---------------

ACT = ("codebook", {"bits": 4, "group": "token", "rotate": "hadamard", "scale_dtype": BF16})
GRAD = ("quant", {"bits": 4, "group": "token", "rotate": "hadamard", "scale_dtype": BF16})
GRAD_EF = CodecSpec(GRAD[0], {**GRAD[1], "error_feedback": True}).build  # what --grad-codec-opt error_feedback=true builds
CHUNKS, BATCH, WIDTH = 4, 8, 64


def run_lowbit_pipeline_step(rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3))
    ref_model = copy.deepcopy(model)
    stages = [model[:2], model[2:]]
    pipe = Pipeline(stages, [0, 1], chunks=CHUNKS, loss_fn=F.cross_entropy, act_codec=ACT, grad_codec=GRAD_EF, timeout=30)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 16, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    loss = pipe.train_step(x, y)
    ref_loss = F.cross_entropy(ref_model(x), y)
    ref_loss.backward()
    if rank == 1:
        assert loss == pytest.approx(ref_loss.item(), rel=2e-2) and loss != ref_loss.item()
    ref_stages = [ref_model[:2], ref_model[2:]]
    for i, stage in pipe.stages.items():
        for p, r in zip(stage.parameters(), ref_stages[i].parameters()):
            cos = F.cosine_similarity(p.grad.flatten(), r.grad.flatten(), dim=0)
            assert cos > 0.97, (i, float(cos))
    # exact wire bytes per micro-batch: (2, 64) float32 through each codec
    n, groups = (BATCH // CHUNKS) * WIDTH, BATCH // CHUNKS
    act_bytes = math.ceil(n * 4 / 8) + groups * 2 + header_bytes(2, 3, 2)
    grad_bytes = math.ceil(n * 4 / 8) + groups * 2 * 2 + header_bytes(2, 2, 2)
    for r in pipe.meter.records():
        if r["recv_count"]:
            expected = act_bytes if r["direction"] == "forward" else grad_bytes
            assert r["recv_bytes"] == CHUNKS * expected, (r["direction"], r["recv_bytes"], expected)
    # error feedback on the backward direction: the sender (rank 1) keeps one residual per
    # micro-batch slot, the codec's error on that slot's gradient (about 2**-4 of its range)
    states = pipe.state_dict()["codecs"]
    residuals = {k: v["residual"] for codecs in states.values() for k, v in codecs.items()
                 if isinstance(v, dict) and v.get("residual") is not None}
    if rank == 1:
        assert sorted(residuals) == [f"backward/{m}/0" for m in range(CHUNKS)]
        for e in residuals.values():
            assert e.shape == (BATCH // CHUNKS, WIDTH) and 0 < e.abs().max() < 1e-2
    else:
        assert residuals == {}


@pytest.fixture(scope="module")
def pipeline_outcome(tmp_path_factory):
    return spawn_checks({"lowbit-step": run_lowbit_pipeline_step}, 2, tmp_path_factory.mktemp("lowbit"))


def test_two_rank_step_with_rotated_per_group_codecs(pipeline_outcome):
    assert_ranks_ok(pipeline_outcome, "lowbit-step", 2)
