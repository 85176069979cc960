"""Bit-packing: exact round trips at every width, the documented byte layout, block access, errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgpipe.compression.bitpack import MAX_BITS, index_bits, pack_bits, pack_bits_into, packed_nbytes, unpack_bits


def reference_pack(codes: list[int], bits: int) -> bytes:
    """The documented layout, computed with Python integers (independent of the torch code)."""
    if bits > 8:
        k = (bits - 1) // 8
        planes = b"".join(bytes((c >> (8 * p)) & 0xFF for c in codes) for p in range(k))
        return planes + reference_pack([c >> (8 * k) for c in codes], bits - 8 * k)
    stream = sum(c << (i * bits) for i, c in enumerate(codes))
    return stream.to_bytes((len(codes) * bits + 7) // 8, "little")


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 16), st.data())
def test_round_trip_and_layout_every_width(bits, data):
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=67))
    t = torch.tensor(codes, dtype=torch.int64)
    packed = pack_bits(t, bits)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == (len(codes) * bits + 7) // 8 == packed_nbytes(len(codes), bits)
    assert bytes(packed.tolist()) == reference_pack(codes, bits)
    assert torch.equal(unpack_bits(packed, bits, len(codes)), t)
    assert torch.equal(unpack_bits(packed, bits, len(codes), dtype=torch.int32), t.int())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_all_values_at_odd_lengths(bits, n):
    gen = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (n,), generator=gen)
    codes[0], codes[-1] = (1 << bits) - 1, (1 << bits) - 1  # extremes at both ends
    assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, n), codes)


@pytest.mark.parametrize("bits", [17, 24, 31, 32, 40, MAX_BITS])
def test_wide_codes(bits):
    codes = torch.tensor([0, 1, (1 << bits) - 1, 1 << (bits - 1), 12345 % (1 << bits)], dtype=torch.int64)
    packed = pack_bits(codes, bits)
    assert bytes(packed.tolist()) == reference_pack(codes.tolist(), bits)
    assert torch.equal(unpack_bits(packed, bits, 5), codes)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16])
def test_any_integer_dtype_and_shape(dtype):
    codes = torch.arange(24).remainder(7).to(dtype).view(2, 3, 4)
    assert torch.equal(unpack_bits(pack_bits(codes, 3), 3, 24), codes.reshape(-1).long())


@pytest.mark.parametrize("bits", [3, 8, 12, 21])
def test_block_access_matches_whole_stream(bits):
    n = 1003
    codes = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(bits))
    whole = pack_bits(codes, bits)
    out = torch.zeros_like(whole)
    for i in range(0, n, 64):
        pack_bits_into(out, codes[i : i + 64], bits, n, i)
        assert torch.equal(unpack_bits(whole, bits, n, start=i, stop=min(i + 64, n)), codes[i : i + 64])
    assert torch.equal(out, whole)


def test_empty():
    packed = pack_bits(torch.zeros(0, dtype=torch.int64), 5)
    assert packed.numel() == 0 and packed.dtype == torch.uint8
    assert unpack_bits(packed, 5, 0).numel() == 0


def test_index_bits():
    assert [index_bits(n) for n in (0, 1, 2, 3, 4, 5, 256, 257)] == [1, 1, 1, 2, 2, 3, 8, 9]


@pytest.mark.parametrize("bits", [0, MAX_BITS + 1, True, 2.0])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.zeros(3, dtype=torch.int64), bits)
    with pytest.raises(ValueError, match="bits"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), bits, 3)


@pytest.mark.parametrize("codes", [torch.tensor([0, 8]), torch.tensor([-1, 2]), torch.tensor([1.0, 2.0]), torch.tensor([True])])
def test_bad_codes(codes):
    with pytest.raises(ValueError):
        pack_bits(codes, 3)


def test_bad_packed_and_ranges():
    packed = pack_bits(torch.arange(10), 4)
    with pytest.raises(ValueError, match="5 bytes"):
        unpack_bits(packed[:4], 4, 10)
    with pytest.raises(ValueError, match="uint8"):
        unpack_bits(packed.to(torch.int8), 4, 10)
    with pytest.raises(ValueError, match="multiple of 8"):
        unpack_bits(packed, 4, 10, start=3)
    with pytest.raises(ValueError, match="stop"):
        unpack_bits(packed, 4, 10, start=0, stop=11)
    with pytest.raises(ValueError, match="dtype"):
        unpack_bits(packed, 4, 10, dtype=torch.int16)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_bits_into(torch.empty(5, dtype=torch.uint8), torch.arange(2), 4, 10, 4)
    with pytest.raises(ValueError, match="out must be"):
        pack_bits_into(torch.empty(4, dtype=torch.uint8), torch.arange(2), 4, 10, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [1, 3, 8, 12, 16])
def test_cuda_matches_cpu(bits):
    codes = torch.randint(0, 1 << bits, (1001,))
    packed = pack_bits(codes.cuda(), bits)
    assert packed.is_cuda and torch.equal(packed.cpu(), pack_bits(codes, bits))
    assert torch.equal(unpack_bits(packed, bits, 1001).cpu(), codes)
