"""The subspace + residual codec: its projection against an independent SVD, exact wire bytes,
the residual's codebook, edge cases and corrupt payloads."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dgpipe.compression import Payload, get_codec
from dgpipe.compression.base import make_payload, parse_header
from dgpipe.pipeline import Pipeline
from helpers import assert_ranks_ok, spawn_checks

TOKEN = dict(group="token", rotate="hadamard", scale_dtype="bfloat16")


def hidden(n=256, d=384, seed=0) -> torch.Tensor:
    """Rows with two dominant directions (a large mean and one outlier feature) over Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x += 4 * torch.randn(d, generator=g)  # a shared mean direction
    x[:, 7] *= 30  # an outlier feature
    return x.view(4, n // 4, d)


def rel(x, y) -> float:
    return float((x.double() - y.double()).square().sum() / x.double().square().sum())


def test_the_projection_is_as_good_as_the_svd_of_the_same_rank():
    """``M - P^ R^`` (what the codebook then codes) leaves at most 1% more energy than the best rank-r
    approximation (an independent float64 SVD), with bfloat16 factors."""
    x = hidden()
    m = x.reshape(-1, 384).double()
    for r in (1, 2, 4):
        payload = get_codec("subspace", rank=r, **TOKEN).encode(x)
        p, q = (t.float().double() for t in payload.tensors[:2])
        left = m - p.view(-1, r) @ q.view(r, 384)
        s = torch.linalg.svdvals(m)
        assert float(left.square().sum()) <= 1.01 * float(s[r:].square().sum())


def test_decode_is_the_factors_plus_the_residual_codebook():
    x = hidden()
    codec = get_codec("subspace", rank=2, bits=2, **TOKEN)
    payload = codec.encode(x)
    p, q = (t.float() for t in payload.tensors[:2])
    low = (p.view(-1, 2) @ q.view(2, 384)).view(x.shape)
    cb = get_codec("codebook", bits=2, **TOKEN)
    expected = low + cb.decode(cb.encode(x - low))
    torch.testing.assert_close(codec.decode(payload), expected, rtol=1e-6, atol=1e-5)


def test_it_beats_the_codebook_alone_where_a_few_directions_dominate():
    x = hidden()
    sub = get_codec("subspace", rank=2, bits=2, **TOKEN)
    cb = get_codec("codebook", bits=2, **TOKEN)
    e_sub, e_cb = rel(x, sub.decode(sub.encode(x))), rel(x, cb.decode(cb.encode(x)))
    assert e_sub < 0.5 * e_cb


def test_a_tensor_of_low_rank_is_nearly_exact():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(128, 2, generator=g) @ torch.randn(2, 64, generator=g)
    codec = get_codec("subspace", rank=2)
    assert rel(x, codec.decode(codec.encode(x))) < 1e-5


@pytest.mark.parametrize("opts, fbytes", [
    (dict(rank=2), 2), (dict(rank=3, factor_dtype="float32", count=5), 4), (dict(rank=1, factor_dtype="float16",
                                                                                 bits=3, group="channel", axis=1), 2),
])  # fmt: skip
def test_exact_wire_bytes(opts, fbytes):
    x = hidden()
    payload = get_codec("subspace", **opts).encode(x)
    n, d, r = 256, 384, opts["rank"]
    residual = {k: v for k, v in opts.items() if k not in ("rank", "factor_dtype")}
    if "count" not in residual:
        residual.setdefault("bits", 2)
    inner = get_codec("codebook", **{**TOKEN, **residual}).encode(torch.randn(4, 64, 384))
    n_params = 2 + len(parse_header(inner.header).params)
    header = 8 * (4 + 3 + 1 + n_params + 1 + 2 * (2 + len(inner.tensors)))
    assert payload.nbytes == fbytes * r * (n + d) + sum(t.numel() * t.element_size() for t in inner.tensors) + header


def test_bits_0_sends_the_factors_only():
    """``bits=0``: two tensors (P^, R^) and two params on the wire, decode = P^ R^ exactly; any subspace
    codec decodes it (decode reads the header only); residual options beside it are refused."""
    x = hidden()
    codec = get_codec("subspace", rank=3, bits=0)
    payload = codec.encode(x)
    p, q = (t.float() for t in payload.tensors)
    assert len(payload.tensors) == 2 and parse_header(payload.header).params == (3, 0)
    assert payload.nbytes == 2 * 3 * (256 + 384) + 8 * (4 + 3 + 1 + 2 + 1 + 2 * 2)
    expected = (p.view(-1, 3) @ q.view(3, 384)).view(x.shape)
    torch.testing.assert_close(codec.decode(payload), expected, rtol=0, atol=0)
    torch.testing.assert_close(get_codec("subspace", rank=1, bits=3).decode(payload), expected, rtol=0, atol=0)
    s = torch.linalg.svdvals(x.reshape(-1, 384).double())
    assert rel(x, expected) <= 1.01 * float(s[3:].square().sum() / s.square().sum())
    with pytest.raises(ValueError, match="no residual options"):
        get_codec("subspace", bits=0, group="tensor")


@pytest.mark.parametrize("shape", [(0, 8), (5, 0), (7,), (3, 1), (1, 1), (2, 3, 5)])
def test_small_and_empty_shapes_round_trip(shape):
    x = torch.randn(shape, dtype=torch.float64)
    codec = get_codec("subspace", rank=4)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.numel():
        assert rel(x, y) < 0.12  # rank min(4, n, d) exact, the rest 2-bit


def test_bad_options_and_inputs_are_refused():
    for opts, match in ((dict(rank=0), "rank"), (dict(power_iters=-1), "power_iters"),
                        (dict(factor_dtype="int8"), "factor_dtype"), (dict(bits=2, count=5), "not both")):
        with pytest.raises(ValueError, match=match):
            get_codec("subspace", **opts)
    codec = get_codec("subspace")
    with pytest.raises(ValueError, match="0-d"):
        codec.encode(torch.tensor(1.0))
    with pytest.raises(ValueError, match="floating"):
        codec.encode(torch.arange(6).view(2, 3))
    bad = hidden()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="inf/NaN"):
        codec.encode(bad)


def _with_header(payload: Payload, i: int, value: int) -> Payload:
    h = payload.header.clone()
    h[i] = value
    return Payload(h, payload.tensors)


def test_corrupt_payloads_are_refused():
    codec = get_codec("subspace", rank=2)
    payload = codec.encode(hidden())
    assert payload.header[7:11].tolist() == [5, 2, 0, 2]  # after magic, id, dtype, ndim, 3 sizes: n_params, rank,
    # factor dtype, then the codebook's bits, levels, grouping
    with pytest.raises(ValueError, match="rank"):
        codec.decode(_with_header(payload, 8, 385))
    with pytest.raises(ValueError, match="factor_dtype"):
        codec.decode(_with_header(payload, 9, 7))
    p = payload.tensors[0].clone()
    p[0] = float("inf")
    with pytest.raises(ValueError, match="factors"):
        codec.decode(Payload(payload.header, (p, *payload.tensors[1:])))
    with pytest.raises(ValueError, match="bits"):  # the residual codebook's own params are checked too
        codec.decode(_with_header(payload, 10, 0))


def test_a_payload_without_its_factors_is_refused():
    codec = get_codec("subspace", rank=2)
    payload = codec.encode(hidden())
    h = parse_header(payload.header)
    short = make_payload(codec.codec_id, torch.float32, h.shape, h.params[:1], payload.tensors[:1])
    with pytest.raises(ValueError, match="at least 2"):
        codec.decode(short)


def run_subspace_pipeline_step(rank):
    """Both directions through ``subspace`` in a two-rank pipeline: parameter gradients close to the
    unsplit model's, and the wire bytes of every message as computed from the formula."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    ref = copy.deepcopy(model)
    codec = ("subspace", {"rank": 2, "bits": 4, "group": "token", "scale_dtype": "bfloat16"})
    pipe = Pipeline([model[:2], model[2:]], [0, 1], chunks=4, loss_fn=F.cross_entropy, act_codec=codec,
                    grad_codec=codec, timeout=30)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 3, (16,), generator=g)
    pipe.train_step(x, y)
    F.cross_entropy(ref(x), y).backward()
    for i, stage in pipe.stages.items():
        for p, r in zip(stage.parameters(), [ref[:2], ref[2:]][i].parameters()):
            assert F.cosine_similarity(p.grad.flatten(), r.grad.flatten(), dim=0) > 0.97
    # (4, 64) float32 per micro-batch: bf16 factors 2 * 2 * (4 + 64), 4-bit codes, 4 bf16 scales
    header = 8 * (4 + 2 + 1 + 5 + 1 + 2 * 4)
    expected = 2 * 2 * (4 + 64) + 4 * 64 * 4 // 8 + 4 * 2 + header
    for r in pipe.meter.records():
        if r["recv_count"]:
            assert r["recv_bytes"] == 4 * expected, (r["direction"], r["recv_bytes"], expected)


@pytest.fixture(scope="module")
def pipeline_outcome(tmp_path_factory):
    return spawn_checks({"subspace-step": run_subspace_pipeline_step}, 2, tmp_path_factory.mktemp("subspace"))


def test_two_rank_step_with_subspace_both_ways(pipeline_outcome):
    assert_ranks_ok(pipeline_outcome, "subspace-step", 2)
