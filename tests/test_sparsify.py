"""topk and randomk: which values are kept, exact wire size, reproducible positions across processes."""

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgpipe.compression import Payload, get_codec
from dgpipe.compression.gradients.sparsify import kept_count, random_positions


def header_bytes(ndim: int, n_params: int, n_tensors: int) -> int:
    return 8 * (4 + ndim + 1 + n_params + 1 + 2 * n_tensors)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 500), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 2**31))
def test_topk_keeps_exactly_the_largest_magnitudes(n, ratio, seed):
    x = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).float() + 1  # distinct magnitudes
    x *= torch.where(torch.rand(n, generator=torch.Generator().manual_seed(seed + 1)) < 0.5, -1.0, 1.0)
    codec = get_codec("topk", ratio=ratio)
    y = codec.decode(codec.encode(x))
    k = max(1, math.ceil(ratio * n))
    top = set(np.argsort(-x.abs().numpy())[:k].tolist())  # independent: numpy's sort
    kept = set(torch.nonzero(y).view(-1).tolist())
    assert kept == top
    assert torch.equal(y[list(kept)], x[list(kept)])


@pytest.mark.parametrize("shape,ratio", [((10, 20), 0.05), ((1000,), 0.3), ((), 0.5), ((7, 0), 0.5)])
def test_topk_nbytes(shape, ratio):
    x = torch.randn(shape)
    n = x.numel()
    k = kept_count(n, ratio)
    bits = max(1, math.ceil(math.log2(n))) if n > 1 else 1
    p = get_codec("topk", ratio=ratio).encode(x)
    assert p.nbytes == 4 * k + math.ceil(k * bits / 8) + header_bytes(len(shape), 2, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_values_sent_exactly_in_their_dtype(dtype):
    x = torch.randn(30, 4).to(dtype)
    for codec in (get_codec("topk", ratio=0.25), get_codec("randomk", ratio=0.25, seed=1)):
        p = codec.encode(x)
        y = codec.decode(p)
        assert y.dtype == dtype and y.shape == x.shape
        kept = y != 0
        assert int(kept.sum()) == 30 and torch.equal(y[kept], x[kept])
        assert p.tensors[0].dtype == dtype


def test_topk_inf_nan_pass_through():
    x = torch.tensor([1.0, float("nan"), -2.0, float("-inf"), 0.5, 3.0])
    y = get_codec("topk", ratio=0.5).decode(get_codec("topk", ratio=0.5).encode(x))
    assert torch.isnan(y[1]) and y[3] == float("-inf") and y[5] == 3.0
    assert int((y == 0).sum()) == 3


def test_non_contiguous():
    x = torch.randn(12, 10).t()[::3]
    for codec in (get_codec("topk", ratio=0.2), get_codec("randomk", ratio=0.2, seed=5)):
        c2 = get_codec(codec.name, **({"ratio": 0.2} if codec.name == "topk" else {"ratio": 0.2, "seed": 5}))
        torch.testing.assert_close(codec.decode(codec.encode(x)), c2.decode(c2.encode(x.contiguous())))


def test_random_positions_are_distinct_stratified_and_seeded():
    n, k = 1000, 70
    pos = random_positions(3, 0, n, k)
    assert pos.dtype == torch.int64 and pos.numel() == k
    assert torch.equal(pos, torch.sort(pos).values) and torch.unique(pos).numel() == k
    bounds = torch.arange(k + 1) * n // k
    assert bool(((pos >= bounds[:-1]) & (pos < bounds[1:])).all())  # one per stratum
    assert torch.equal(pos, random_positions(3, 0, n, k))
    assert not torch.equal(pos, random_positions(3, 1, n, k))
    assert not torch.equal(pos, random_positions(4, 0, n, k))
    assert random_positions(3, 0, 5, 5).tolist() == [0, 1, 2, 3, 4]
    assert random_positions(3, 0, 0, 0).numel() == 0


def test_random_positions_are_uniform():
    n, k, draws = 50, 5, 4000
    hits = torch.zeros(n)
    for step in range(draws):
        hits[random_positions(0, step, n, k)] += 1
    # each position kept with probability k / n = 0.1: 400 expected, sd 19
    assert float((hits - draws * k / n).abs().max()) < 100


def test_randomk_steps_and_state():
    x = torch.randn(200)
    a, b = get_codec("randomk", ratio=0.1, seed=9), get_codec("randomk", ratio=0.1, seed=9)
    p1, p2 = a.encode(x), a.encode(x)
    assert a.stateful
    assert not torch.equal(a.decode(p1), a.decode(p2))  # a new step keeps other positions
    assert torch.equal(b.decode(b.encode(x)), a.decode(p1))  # equal seeds in step: equal positions
    state = a.state_dict()
    c = get_codec("randomk", ratio=0.1, seed=9)
    c.load_state_dict(state)
    assert torch.equal(c.encode(x).header, a.encode(x).header)
    # the receiving side needs nothing but the payload
    fresh = get_codec("randomk", ratio=0.5, seed=123)
    assert torch.equal(fresh.decode(p2), a.decode(p2))


def test_randomk_positions_in_another_process(tmp_path):
    x = torch.randn(64, 33)
    codec = get_codec("randomk", ratio=0.05, seed=2024)
    codec.encode(x)  # step 0
    payload = codec.encode(x)  # step 1
    payload.header.numpy().tofile(tmp_path / "header.bin")
    payload.tensors[0].numpy().tofile(tmp_path / "values.bin")
    script = textwrap.dedent(
        f"""
        import numpy as np, torch
        from dgpipe.compression import Payload, get_codec
        header = torch.from_numpy(np.fromfile(r"{tmp_path / 'header.bin'}", dtype=np.int64))
        values = torch.from_numpy(np.fromfile(r"{tmp_path / 'values.bin'}", dtype=np.float32))
        y = get_codec("randomk").decode(Payload(header, (values,)))
        np.save(r"{tmp_path / 'decoded.npy'}", y.numpy())
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    remote = torch.from_numpy(np.load(tmp_path / "decoded.npy"))
    assert torch.equal(remote, codec.decode(payload))
    assert int((remote != 0).sum()) == kept_count(x.numel(), 0.05)


def test_randomk_nbytes_has_no_positions():
    x = torch.randn(100, 10)
    p = get_codec("randomk", ratio=0.01).encode(x)
    assert p.nbytes == 4 * 10 + header_bytes(2, 3, 1)


def test_corrupt_topk_position_raises():
    codec = get_codec("topk", ratio=0.5)
    p = codec.encode(torch.randn(6))  # 3-bit positions: 6 and 7 are out of range
    bad = Payload(p.header, (p.tensors[0], torch.full_like(p.tensors[1], 0xFF)))
    with pytest.raises(ValueError, match="indices"):
        codec.decode(bad)


@pytest.mark.parametrize("name", ["topk", "randomk"])
@pytest.mark.parametrize("opts", [dict(ratio=0), dict(ratio=1.5), dict(ratio="0.1"), dict(ratio=True)])
def test_bad_options(name, opts):
    with pytest.raises(ValueError):
        get_codec(name, **opts)


def test_bad_seed_and_input():
    with pytest.raises(ValueError):
        get_codec("randomk", seed=-1)
    with pytest.raises(ValueError):
        get_codec("randomk", seed=1 << 62)
    for name in ("topk", "randomk"):
        with pytest.raises(ValueError, match="floating"):
            get_codec(name).encode(torch.arange(10))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_positions_match_cpu():
    x = torch.randn(1000)
    a, b = get_codec("randomk", ratio=0.1, seed=1), get_codec("randomk", ratio=0.1, seed=1)
    torch.testing.assert_close(a.decode(a.encode(x.cuda())).cpu(), b.decode(b.encode(x)))
    t = get_codec("topk", ratio=0.1)
    torch.testing.assert_close(t.decode(t.encode(x.cuda())).cpu(), t.decode(t.encode(x)))
