"""Bit-packing: exact round trips at every width, the documented byte layout, block access, errors."""

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgpipe.compression.kernels import bitpack
from dgpipe.compression.kernels.bitpack import (
    CHUNK,
    MAX_BITS,
    index_bits,
    pack_bits,
    pack_bits_into,
    packed_nbytes,
    unpack_bits,
)


def reference_pack(codes: list[int], bits: int, chunk: int = CHUNK) -> bytes:
    """The documented layout, computed with Python integers (independent of the torch code)."""
    k = (bits - 1) // 8
    planes = b"".join(bytes((c >> (8 * p)) & 0xFF for c in codes) for p in range(k))
    r = bits - 8 * k
    rest = [c >> (8 * k) for c in codes]
    g = 8 // math.gcd(r, 8)
    w, lane = g * r // 8, chunk // g
    full = len(rest) - len(rest) % chunk
    out = b""
    for c0 in range(0, full, chunk):
        words = [sum(rest[c0 + j + lane * i] << (i * r) for i in range(g)) for j in range(lane)]
        out += b"".join(bytes((word >> (8 * q)) & 0xFF for word in words) for q in range(w))
    stream = sum(c << (i * r) for i, c in enumerate(rest[full:]))
    return planes + out + stream.to_bytes((len(rest[full:]) * r + 7) // 8, "little")


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 16), st.sampled_from([8, 16, 64]), st.data())
def test_round_trip_and_layout_every_width(bits, chunk, data):
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=3 * chunk + 5))
    t = torch.tensor(codes, dtype=torch.int64)
    with mock.patch.object(bitpack, "CHUNK", chunk):  # small chunks: whole chunks and a tail in small tensors
        packed = pack_bits(t, bits)
        assert packed.dtype == torch.uint8 and packed.dim() == 1
        assert packed.numel() == (len(codes) * bits + 7) // 8 == packed_nbytes(len(codes), bits)
        assert bytes(packed.tolist()) == reference_pack(codes, bits, chunk)
        assert torch.equal(unpack_bits(packed, bits, len(codes)), t)
        assert torch.equal(unpack_bits(packed, bits, len(codes), dtype=torch.int32), t.int())


@pytest.mark.parametrize("bits", [1, 3, 4, 6, 8, 12, 16])
def test_layout_at_the_real_chunk_size(bits):
    n = 2 * CHUNK + 37
    codes = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(bits))
    assert bytes(pack_bits(codes, bits).tolist()) == reference_pack(codes.tolist(), bits)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001, CHUNK, 3 * CHUNK + 1])
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


@pytest.mark.parametrize("bits", [3, 4, 8, 12, 21])
def test_block_access_matches_whole_stream(bits):
    n = 5 * CHUNK + 1003
    codes = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(bits))
    whole = pack_bits(codes, bits)
    out = torch.zeros_like(whole)
    step = 2 * CHUNK
    for i in range(0, n, step):
        pack_bits_into(out, codes[i : i + step], bits, n, i)
        assert torch.equal(unpack_bits(whole, bits, n, start=i, stop=min(i + step, n)), codes[i : i + step])
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


@pytest.mark.parametrize(
    "codes", [torch.tensor([0, 8]), torch.tensor([-1, 2]), torch.tensor([1.0, 2.0]), torch.tensor([True])]
)
def test_bad_codes(codes):
    with pytest.raises(ValueError):
        pack_bits(codes, 3)


def test_bad_packed_and_ranges():
    packed = pack_bits(torch.arange(10), 4)
    with pytest.raises(ValueError, match="5 bytes"):
        unpack_bits(packed[:4], 4, 10)
    with pytest.raises(ValueError, match="uint8"):
        unpack_bits(packed.to(torch.int8), 4, 10)
    with pytest.raises(ValueError, match="multiple of CHUNK"):
        unpack_bits(packed, 4, 10, start=8)
    with pytest.raises(ValueError, match="multiple of CHUNK"):
        unpack_bits(packed, 4, 10, start=0, stop=11)
    with pytest.raises(ValueError, match="multiple of CHUNK"):
        unpack_bits(packed, 4, 10, start=0, stop=5)
    with pytest.raises(ValueError, match="dtype"):
        unpack_bits(packed, 4, 10, dtype=torch.int16)
    with pytest.raises(ValueError, match="multiple of CHUNK"):
        pack_bits_into(torch.empty(5, dtype=torch.uint8), torch.arange(2), 4, 10, 8)
    with pytest.raises(ValueError, match="out must be"):
        pack_bits_into(torch.empty(4, dtype=torch.uint8), torch.arange(10), 4, 10, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [1, 3, 8, 12, 16])
def test_cuda_matches_cpu(bits):
    codes = torch.randint(0, 1 << bits, (1001,))
    packed = pack_bits(codes.cuda(), bits)
    assert packed.is_cuda and torch.equal(packed.cpu(), pack_bits(codes, bits))
    assert torch.equal(unpack_bits(packed, bits, 1001).cpu(), codes)
