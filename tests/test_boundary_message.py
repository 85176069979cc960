"""A boundary message's meta (:class:`Message`) and its lanes, on their own.

The meta's wire form is checked field by field against an independent encoding of the
loss (numpy's view of the float64 bits); the lanes against the codecs they wrap.
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dgpipe.compression import DeltaCache, DeltaCoder, get_codec
from dgpipe.pipeline.lanes import LOSSLESS_LANE, CodedLane, DeltaLane, DeltaWarmupLane, LaneContext
from dgpipe.pipeline.message import (ABSENT, CODED, DELTA_CODED, DELTA_WARMUP, LOSSLESS, MAX_BOUNDARY_TENSORS,
                                     REQUIRES_GRAD, Message)

FLAGS = [ABSENT, LOSSLESS, CODED, LOSSLESS | REQUIRES_GRAD, CODED | REQUIRES_GRAD, DELTA_WARMUP | REQUIRES_GRAD,
         DELTA_CODED | REQUIRES_GRAD]


def test_meta_fields_are_the_documented_ones():
    m = Message((CODED | REQUIRES_GRAD, LOSSLESS), n_micro=4, slot=3, loss=0.625, has_ids=True)
    assert m.to_meta() == [2, 4, 3, int(np.float64(0.625).view(np.int64)), 6, 1]
    assert Message((CODED,), atomic=True).to_meta() == [1, 0, 0, 0, 2]
    assert m.n_payloads == 3 and m.kind(0) == CODED and m.requires_grad(0) and not m.requires_grad(1)


@given(flags=st.lists(st.sampled_from(FLAGS), min_size=1, max_size=MAX_BOUNDARY_TENSORS),
       n_micro=st.integers(0, 1 << 20), slot=st.integers(0, 1 << 20),
       loss=st.floats(allow_nan=False), has_ids=st.booleans(), atomic=st.booleans())
def test_meta_round_trips(flags, n_micro, slot, loss, has_ids, atomic):
    flags = flags[:1] if atomic else flags
    m = Message(tuple(flags), n_micro, slot, loss, atomic, has_ids)
    assert Message.from_meta(m.to_meta(), m.n_payloads) == m


@pytest.mark.parametrize("meta, n", [
    ([3, 4, 0, 0, DELTA_CODED | REQUIRES_GRAD], 1),  # the ids payload is missing
    ([4, 4, 0, 0, 1], 1),  # unknown head bit
    ([0, 4, 0, 0, 8], 1),  # delta without a coded/lossless kind
    ([0, 4, 0, 0, DELTA_CODED], 1),  # a delta lane that does not require grad
    ([0, 4, 0, 0, DELTA_CODED | REQUIRES_GRAD | 1 << 6], 1),  # bits above the flags
    ([1, 4, 0, 0, 1, 1], 2),  # an atomic value with two tensors
    ([0, -1, 0, 0, 1], 1),  # negative n_micro
    ([0, 4, 0], 0),  # too short
    ([0, 4, 0, 0, *[1] * (MAX_BOUNDARY_TENSORS + 1)], MAX_BOUNDARY_TENSORS + 1),
])
def test_bad_meta_is_refused(meta, n):
    with pytest.raises(ValueError, match="corrupt message meta"):
        Message.from_meta(meta, n)


def test_a_boundary_refuses_a_message_of_another_micro_batch():
    from dgpipe.comm import BandwidthMeter
    from dgpipe.pipeline.boundary import Boundary

    b = Boundary(0, 0, 1, lambda: get_codec("none"), lambda: get_codec("none"), BandwidthMeter(),
                 torch.device("cpu"), 5.0, rank=1, report=None)
    assert b._parse_meta([1, 4, 2, 0, 6], 1, 2, 0) == Message((6,), 4, 2, atomic=True)
    with pytest.raises(ValueError, match=r"rank 0 sent micro-batch 2, expected 1 \(ranks out of step\)"):
        b._parse_meta([1, 4, 2, 0, 6], 1, 1, 0)
    with pytest.raises(ValueError, match=r"stage0->stage1: corrupt message meta.*\(from rank 0\)"):
        b._parse_meta([1, 4, 2, 0, 6], 0, 2, 0)


def test_lossless_lane_is_exact_and_packs_masks():
    ctx = LaneContext()
    mask = torch.rand(4, 33) > 0.5
    p = LOSSLESS_LANE.encode(mask, ctx)
    assert p.header[1] == get_codec("intpack").codec_id and p.nbytes == get_codec("intpack").encode(mask).nbytes
    assert torch.equal(LOSSLESS_LANE.decode(p, ctx), mask)
    x = torch.randn(3, 5, dtype=torch.float64)
    assert torch.equal(LOSSLESS_LANE.decode(LOSSLESS_LANE.encode(x, ctx), ctx), x)
    with pytest.raises(ValueError, match="neither 'none' nor 'intpack'"):
        LOSSLESS_LANE.decode(get_codec("quant", bits=8).encode(x.float()), ctx)


def test_coded_lane_is_its_codec():
    codec, x = get_codec("quant", bits=4), torch.randn(6, 7)
    lane = CodedLane(codec)
    p = lane.encode(x, LaneContext())
    assert torch.equal(p.header, codec.encode(x).header)
    assert torch.equal(lane.decode(p, LaneContext()), codec.decode(codec.encode(x)))


def test_warmup_then_delta_lanes_share_one_cache_per_side():
    """A warm-up visit stores the activation exactly on both sides; the next visit codes only
    the change, so the receiver's reconstruction is the cache plus a 2-bit change."""
    make = lambda: DeltaCoder(get_codec("quant", bits=2), DeltaCache(8, torch.float32))  # noqa: E731
    sender, receiver = make(), make()
    ctx = LaneContext(torch.tensor([6, 1]))
    a = torch.randn(2, 16)
    assert torch.equal(DeltaWarmupLane(receiver).decode(DeltaWarmupLane(sender).encode(a, ctx), ctx), a)
    b = a + 0.01 * torch.randn(2, 16)
    r = DeltaLane(receiver).decode(DeltaLane(sender).encode(b, ctx), ctx)
    assert sender.cache.digest() == receiver.cache.digest()
    assert (r - b).abs().max() <= (b - a).abs().max()  # within one change of b, far from a 2-bit code of b
    with pytest.raises(ValueError, match="warm-up tensor"):
        DeltaWarmupLane(receiver).decode(get_codec("none").encode(torch.randn(3, 16)), ctx)
