"""Wire rules shared by this package's codecs: registry, exact nbytes, shape/dtype/device, corrupt headers."""

import pytest
import torch

from dgpipe.compression import Payload, available_codecs, get_codec, parse_header
from dgpipe.compression.base import MAGIC

CODECS = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "quant": {"bits": 5},
    "sortquant": {"quant_bits": 3, "split_bits": 2},
    "topk": {"ratio": 0.3},
    "randomk": {"ratio": 0.3, "seed": 1},
    "lowrank": {"rank": 2},
    "codebook": {"bits": 3, "levels": "fit", "group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"},
}
IDS = {"none": 0, "fp16": 1, "bf16": 2, "quant": 3, "sortquant": 4, "topk": 5, "randomk": 6, "lowrank": 7,
       "codebook": 13}
SHAPES = [(4, 6), (3, 1, 5), (), (0,), (2, 0, 3), (7,)]


def test_registry():
    assert set(CODECS) <= set(available_codecs())
    for name, codec_id in IDS.items():
        assert get_codec(name).codec_id == codec_id and get_codec(name).name == name
    with pytest.raises(ValueError, match="available"):
        get_codec("nope")
    with pytest.raises(ValueError, match="bad options"):
        get_codec("quant", nonsense=1)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shape_dtype_device_and_plain_tensors(name, shape, dtype):
    x = torch.randn(shape).to(dtype)
    codec = get_codec(name, **CODECS[name])
    p = codec.encode(x)
    # a header of plain integers and flat plain tensors: nothing to unpickle
    assert p.header.dtype == torch.int64 and p.header.dim() == 1 and p.header.device.type == "cpu"
    assert all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in p.tensors)
    h = parse_header(p.header, IDS[name])
    assert h.shape == tuple(shape) and h.dtype == dtype
    assert p.nbytes == 8 * p.header.numel() + sum(t.numel() * t.element_size() for t in p.tensors)
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device


@pytest.mark.parametrize("name", CODECS)
def test_non_contiguous_input(name):
    x = torch.randn(9, 8).t()[:, 1::2]
    a, b = get_codec(name, **CODECS[name]), get_codec(name, **CODECS[name])
    torch.testing.assert_close(a.decode(a.encode(x)), b.decode(b.encode(x.contiguous())))


def corrupt(p: Payload, pos: int, value: int) -> Payload:
    h = p.header.clone()
    h[pos] = value
    return Payload(h, p.tensors)


def params_pos(p: Payload) -> int:
    """Index of the first codec parameter in the header."""
    ndim = int(p.header[3])
    return 4 + ndim + 1


@pytest.mark.parametrize("name", [n for n in CODECS if n not in ("none", "fp16", "bf16")])
def test_corrupt_headers_raise_naming_the_field(name):
    codec = get_codec(name, **CODECS[name])
    p = codec.encode(torch.randn(6, 5))
    cases = [
        (Payload(p.header[:-1], p.tensors), "truncated|trailing|n_tensors"),
        (corrupt(p, 0, MAGIC + 1), "magic"),
        (corrupt(p, 1, 99), "codec_id"),
        (corrupt(p, 1, IDS["topk"] if name != "topk" else IDS["quant"]), "codec_id"),
        (corrupt(p, 2, 77), "dtype"),
        (Payload(p.header, p.tensors[:-1]), "n_tensors"),
        (Payload(p.header, tuple(t.to(torch.float64) for t in p.tensors)), "tensors"),
        (corrupt(p, params_pos(p), -5), "params"),
        (corrupt(p, params_pos(p) + len(parse_header(p.header).params) - 1, 1 << 41), "params"),
    ]
    if name != "randomk":  # randomk's header has no redundancy to catch a changed shape
        cases.append((corrupt(p, 4, 7), "tensors|params"))  # shape[0]: the payload no longer fits
    for bad, field in cases:
        with pytest.raises(ValueError, match=field):
            codec.decode(bad)


@pytest.mark.parametrize(
    "name,param,value,field",
    [
        ("quant", 0, 17, "bits"),
        ("quant", 0, 0, "bits"),
        ("quant", 1, -1, "grouping"),
        ("quant", 1, 2 | 1 << 3 | 3 << 11, "axis"),  # a channel axis past the tensor's 2 dimensions
        ("sortquant", 0, 0, "quant_bits"),
        ("sortquant", 1, 16, "split_bits"),
        ("sortquant", 1, 3, "tensors"),  # S=3: wider codes and 16 bucket parameters than the payload has
        ("topk", 1, 9, "index_bits"),
        ("topk", 0, 31, "k"),
        ("randomk", 2, 31, "k"),
        ("randomk", 0, -1, "seed"),
        ("lowrank", 0, 6, "rank"),
        ("codebook", 1, 2, "levels"),
        ("codebook", 2, 3 | 1 << 3, "group_size"),  # tiles without a size
    ],
)
def test_codec_specific_params_are_validated(name, param, value, field):
    codec = get_codec(name, **CODECS[name])
    p = codec.encode(torch.randn(6, 5))
    with pytest.raises(ValueError, match=field):
        codec.decode(corrupt(p, params_pos(p) + param, value))


def test_sortquant_bits_sum_checked():
    codec = get_codec("sortquant", quant_bits=12, split_bits=4)
    p = codec.encode(torch.randn(10))
    with pytest.raises(ValueError, match="quant_bits"):
        codec.decode(corrupt(p, params_pos(p), 13))


def test_payload_moves_between_devices_and_header_stays_on_cpu():
    p = get_codec("sortquant").encode(torch.randn(20))
    q = p.to("cpu")
    assert q.header.device.type == "cpu" and q.nbytes == p.nbytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CODECS)
def test_cuda_round_trip(name):
    x = torch.randn(33, 17, device="cuda")
    codec = get_codec(name, **CODECS[name])
    p = codec.encode(x)
    assert p.header.device.type == "cpu" and all(t.is_cuda for t in p.tensors)
    y = codec.decode(p)
    assert y.is_cuda and y.shape == x.shape
    cpu = get_codec(name, **CODECS[name])
    torch.testing.assert_close(y.cpu(), cpu.decode(cpu.encode(x.cpu())), rtol=1e-4, atol=1e-4)
