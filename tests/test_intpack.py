"""intpack: integer and bool tensors bit-exact in the fewest bits their range needs, never
more bytes than the ``none`` codec, and corrupt headers refused."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgpipe.compression import Payload, get_codec
from dgpipe.compression.base import make_payload

INTPACK, NONE = get_codec("intpack"), get_codec("none")
HEADER = 8  # bytes per header field


def _round_trip(x):
    p = INTPACK.encode(x)
    y = INTPACK.decode(Payload(p.header, tuple(t.clone() for t in p.tensors)))
    assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, x)
    assert p.nbytes <= NONE.encode(x).nbytes
    return p


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool])
def test_every_integer_dtype_round_trips_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        x = torch.randint(0, 2, (7, 33), generator=g).bool()
    else:
        info = torch.iinfo(dtype)
        x = torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, (7, 33), generator=g, dtype=torch.int64).to(dtype)
    _round_trip(x)
    _round_trip(x.t())  # non-contiguous
    _round_trip(x[:, :0])  # empty


def test_an_attention_mask_costs_one_bit_a_value():
    mask = torch.ones(16, 32, dtype=torch.int64)
    mask[3, 20:] = 0
    p = _round_trip(mask)
    # fields: magic, codec, dtype, ndim, 2 dims, n_params, offset, bits, n_tensors, its dtype and numel
    assert p.nbytes == 12 * HEADER + 16 * 32 // 8
    assert p.header.tolist()[7:9] == [0, 1]  # offset 0, 1 bit
    assert NONE.encode(mask).nbytes == 10 * HEADER + 16 * 32 * 8


def test_the_range_not_the_values_sets_the_width():
    ids = torch.arange(1000, 2000).flip(0)  # 1000 values in [1000, 1999]: 10 bits each after the offset
    p = _round_trip(ids)
    assert p.header.tolist()[6:8] == [1000, 10]
    assert p.tensors[0].numel() == 1000 * 10 // 8
    assert _round_trip(torch.full((100,), -7, dtype=torch.int32)).header.tolist()[6:8] == [-7, 1]  # a constant


@pytest.mark.parametrize("x", [
    torch.tensor([1, 2], dtype=torch.int64),  # too few values: 2 bits + 16 bytes of params > 16 bytes
    torch.arange(256, dtype=torch.int64).to(torch.uint8),  # uint8 using its whole range
    torch.tensor([-2**63, 2**63 - 1] * 8),  # a range over 62 bits
    torch.tensor([2**62 + 1, 2**62 + 2] * 8),  # an offset a header param cannot hold
], ids=["few", "full-uint8", "wide-range", "huge-offset"])
def test_what_packing_would_not_shrink_goes_as_is_at_none_cost(x):
    p = _round_trip(x)
    assert p.header.tolist()[5 if x.dim() == 1 else 6] == 0  # no params: the values as they are
    assert p.nbytes == NONE.encode(x).nbytes and p.tensors[0].dtype == x.dtype


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=300), st.integers(0, 62))
def test_any_int64_values_round_trip(values, shift):
    _round_trip(torch.tensor(values, dtype=torch.int64).reshape(-1) >> shift)


def test_floating_input_is_refused():
    with pytest.raises(ValueError, match="needs an integer or bool tensor, got torch.float32"):
        INTPACK.encode(torch.zeros(3))


def _packed(dtype, shape, params, nbytes):
    return make_payload(INTPACK.codec_id, dtype, shape, params, (torch.zeros(nbytes, dtype=torch.uint8),))


@pytest.mark.parametrize("payload, message", [
    (_packed(torch.float32, (8,), (0, 1), 1), "field 'dtype' = torch.float32"),
    (_packed(torch.int64, (8,), (0, 0), 1), r"params\[1\]' \(bits\) = 0 outside \[1, 62\]"),
    (_packed(torch.int64, (8,), (0, 63), 63), r"params\[1\]' \(bits\) = 63 outside"),
    (_packed(torch.int64, (8,), (0,), 1), "field 'n_params' = 1, expected 2"),
    (_packed(torch.int64, (8,), (0, 2), 1), r"tensors\[0\]' \(packed\) is torch.uint8\[1\], expected torch.uint8\[2\]"),
    (_packed(torch.int64, (8,), (2**62 + 1, 1), 1), r"field 'params\[0\]' = 4611686018427387905 outside"),
    (_packed(torch.int8, (8,), (-129, 1), 1), r"outside the range of torch.int8 \[-128, 127\]"),
], ids=["float-dtype", "bits-0", "bits-63", "one-param", "short-data", "offset", "under-int8"])
def test_corrupt_headers_are_refused(payload, message):
    with pytest.raises(ValueError, match=message):
        INTPACK.decode(payload)


def test_decoded_values_over_the_dtype_are_refused():
    x = torch.tensor([100, 127] * 100, dtype=torch.int8)
    p = INTPACK.encode(x)  # offset 100, 5 bits: a corrupt code 31 would decode to 131
    assert p.header.tolist()[6:8] == [100, 5]
    bad = Payload(p.header, (torch.full_like(p.tensors[0], 255),))
    with pytest.raises(ValueError, match=r"outside the range of torch.int8"):
        INTPACK.decode(bad)
    assert np.array_equal(INTPACK.decode(p).numpy(), x.numpy())
