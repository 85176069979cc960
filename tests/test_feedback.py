"""ErrorFeedback: decoded sums track input sums with a bounded residual; state, streams, delegation."""

import pytest
import torch

from dgpipe.compression import ErrorFeedback, get_codec


def run(codec, xs):
    total_in, total_out = torch.zeros_like(xs[0]), torch.zeros_like(xs[0])
    for x in xs:
        total_in += x
        total_out += codec.decode(codec.encode(x))
    return total_in, total_out


@pytest.mark.parametrize(
    "name,opts",
    [("topk", dict(ratio=0.05)), ("quant", dict(bits=2)), ("sortquant", dict(quant_bits=1, split_bits=1)),
     ("randomk", dict(ratio=0.1, seed=3)), ("lowrank", dict(rank=1))],
)
def test_sum_of_outputs_tracks_sum_of_inputs(name, opts):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(20, 30, generator=g) + 0.3 for _ in range(200)]  # a bias that plain compression drops
    ef = ErrorFeedback(get_codec(name, **opts))
    total_in, total_out = run(ef, xs)
    # exactly: sum of outputs = sum of inputs - last residual
    residual = ef.state_dict()["residual"]
    torch.testing.assert_close(total_out, total_in - residual, rtol=1e-4, atol=1e-3)
    # the residual stays bounded, while without feedback the error grows with the steps
    _, plain_out = run(get_codec(name, **opts), xs)
    err_ef, err_plain = float((total_out - total_in).abs().mean()), float((plain_out - total_in).abs().mean())
    assert err_ef < 15 and err_ef * 3 < err_plain


def test_residual_is_exactly_the_compression_error():
    ef = ErrorFeedback(get_codec("topk", ratio=0.25))
    x1, x2 = torch.tensor([4.0, -1.0, 0.5, 2.0]), torch.tensor([0.0, 0.0, 1.0, 0.0])
    y1 = ef.decode(ef.encode(x1))
    assert y1.tolist() == [4.0, 0.0, 0.0, 0.0]
    assert ef.state_dict()["residual"].tolist() == [0.0, -1.0, 0.5, 2.0]
    y2 = ef.decode(ef.encode(x2))  # corrected input: [0, -1, 1.5, 2]
    assert y2.tolist() == [0.0, 0.0, 0.0, 2.0]
    assert ef.state_dict()["residual"].tolist() == [0.0, -1.0, 1.5, 0.0]


def test_state_dict_round_trip_continues_identically():
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(50, generator=g) for _ in range(6)]
    a = ErrorFeedback(get_codec("randomk", ratio=0.2, seed=7))
    for x in xs[:3]:
        a.encode(x)
    b = ErrorFeedback(get_codec("randomk", ratio=0.2, seed=7))
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["codec"] == {"step": 3}
    for x in xs[3:]:
        pa, pb = a.encode(x), b.encode(x)
        assert torch.equal(pa.header, pb.header) and torch.equal(pa.tensors[0], pb.tensors[0])


def test_receiver_decodes_with_the_plain_codec():
    ef = ErrorFeedback(get_codec("sortquant", quant_bits=3, split_bits=1))
    x = torch.randn(8, 8)
    p = ef.encode(x)
    assert torch.equal(get_codec("sortquant").decode(p), ef.decode(p))
    assert ef.stateful and ef.codec_id == get_codec("sortquant").codec_id


def test_new_shape_starts_a_new_stream_and_reset():
    ef = ErrorFeedback(get_codec("topk", ratio=0.5))
    ef.encode(torch.tensor([3.0, 1.0]))
    y = ef.decode(ef.encode(torch.tensor([5.0, 1.0, 2.0, 0.0])))  # the [0, 1] residual is dropped
    assert y.tolist() == [5.0, 0.0, 2.0, 0.0]
    ef.reset()
    assert ef.state_dict()["residual"] is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(dtype):
    ef = ErrorFeedback(get_codec("quant", bits=4))
    x = torch.randn(10).to(dtype)
    y = ef.decode(ef.encode(x))
    assert y.dtype == dtype
    assert ef.state_dict()["residual"].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_errors():
    with pytest.raises(ValueError):
        ErrorFeedback("topk")
    with pytest.raises(ValueError):
        ErrorFeedback(ErrorFeedback(get_codec("topk")))
    ef = ErrorFeedback(get_codec("topk"))
    with pytest.raises(ValueError, match="floating"):
        ef.encode(torch.arange(4))
    with pytest.raises(ValueError, match="residual"):
        ef.load_state_dict({"residual": [1.0, 2.0]})
    with pytest.raises(ValueError, match="no state"):
        ef.load_state_dict({"residual": None, "codec": {"step": 1}})
    # a failing inner encode leaves the residual as it was
    ef = ErrorFeedback(get_codec("quant", bits=2))
    ef.encode(torch.tensor([0.0, 1.0, 0.3]))
    before = ef.state_dict()["residual"]
    with pytest.raises(ValueError, match="inf/NaN"):
        ef.encode(torch.tensor([0.0, float("nan"), 0.3]))
    assert torch.equal(ef.state_dict()["residual"], before)
