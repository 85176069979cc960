"""Corrupt and hostile messages against the receiving side of the wire.

Real messages of every registered codec (packed by :func:`helpers.wire_message`) are
mutated -- random byte flips, truncation, extension, a lying size word -- and fed to
:func:`dgpipe.comm.framing.read_message` as a receiver would see them: the first part
is the stream's capacity, and ``rest(n)`` stands for allocating and receiving the second
part (bytes that were never sent time out as a :class:`TransportError`). Every outcome
must be a clean refusal (``ValueError`` from the transport or the codec, or that
timeout) or a tensor of the shape its header declares, in bounded time, and nothing may
be allocated above the stream's limit.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgpipe.pipeline import BoundarySpec
from dgpipe.comm.framing import read_message
from dgpipe.comm.transport import MIN_CAPACITY, TransportError
from dgpipe.compression import available_codecs, get_codec, parse_header
from helpers import wire_message, wire_parts

LIMIT = 1 << 20  # the stream's limit in these tests: 1 MiB
OPTIONS = {"quant": {"bits": 5, "group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"},
           "codebook": {"bits": 3, "levels": "fit", "group": "token", "rotate": "hadamard"},
           "sortquant": {"quant_bits": 2, "split_bits": 1, "group": "token"},
           "randomk": {"ratio": 0.3, "seed": 1}}


def _message(name: str) -> tuple[torch.Tensor, object]:
    codec = get_codec(name, **OPTIONS.get(name, {}))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2, (3, 40), generator=g) if name == "intpack" else torch.randn(3, 40, generator=g)  # a mask
    return wire_message([codec.encode(x)], [1, 2]), codec


MESSAGES = {name: _message(name) for name in available_codecs()}


def _size_word(data: torch.Tensor) -> int:
    return int(data[8:16].view(torch.int64))


def _set_size_word(data: torch.Tensor, value: int) -> None:
    data[8:16] = torch.tensor([value], dtype=torch.int64).view(torch.uint8)


def _receive(data: torch.Tensor, capacity: int):
    """Feed ``data`` to read_message as a receiver with ``capacity`` would get it from a sender that puts
    ``data`` on the wire as the transport's parts (:func:`helpers.wire_parts`). Receive buffers are zeroed,
    and gloo completes a receive with fewer bytes than its buffer holds."""
    parts = wire_parts(data, capacity)
    first = torch.zeros(capacity, dtype=torch.uint8)  # a posted buffer holds what the message leaves
    first[: parts[0].numel()] = parts[0]
    asked = []

    def rest(k: int) -> torch.Tensor:
        asked.append(k)
        assert k <= LIMIT, f"asked to allocate {k} bytes, over the limit"
        if len(parts) == 1:  # no second part was sent: the real receive times out
            raise TransportError("timed out", 0)
        if parts[1].numel() > k:  # gloo's fatal error: a part longer than the buffer ends the process
            raise TransportError("a part longer than its buffer", 0)
        buf = torch.zeros(k, dtype=torch.uint8)
        buf[: parts[1].numel()] = parts[1]
        return buf

    return read_message(first, rest, 0, LIMIT, "cpu"), asked


def _outcome(data: torch.Tensor, codec, capacity: int) -> str:
    start = time.monotonic()
    try:
        (payloads, meta, total), _ = _receive(data, capacity)
        for p in payloads:
            y = codec.decode(p)
            assert tuple(y.shape) == tuple(parse_header(p.header).shape)
        result = "decoded"
    except ValueError:
        result = "refused"
    except TransportError:
        result = "timed out"
    assert time.monotonic() - start < 5
    return result


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_intact_messages_decode_with_one_part_or_two(name):
    data, codec = MESSAGES[name]
    for capacity in (MIN_CAPACITY, data.numel(), 2 * data.numel()):
        (payloads, meta, total), asked = _receive(data, capacity)
        assert meta == [1, 2] and total == data.numel()
        assert asked == ([data.numel() - capacity + 8] if capacity < data.numel() else [])
        assert codec.decode(payloads[0]).shape == (3, 40)


mutation = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=600)),
    st.tuples(st.just("size"), st.integers(-(1 << 63), (1 << 63) - 1)),
)


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", 300)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(MESSAGES)), change=mutation, capacity=st.sampled_from([MIN_CAPACITY, 1024, 4096]))
def test_mutated_messages_are_refused_or_decode_to_their_declared_shape(name, change, capacity):
    data, codec = MESSAGES[name]
    data = data.clone()
    kind, arg = change
    if kind == "flip":
        for pos, xor in arg:
            data[pos % data.numel()] ^= xor
    elif kind == "truncate":
        data = data[: arg % data.numel()]
    elif kind == "extend":
        data = torch.cat([data, torch.frombuffer(bytearray(arg), dtype=torch.uint8)])
    else:
        _set_size_word(data, arg)
    _outcome(data, codec, capacity)


@pytest.mark.parametrize("name", sorted(MESSAGES))
@pytest.mark.parametrize("extra", [1, 4096, 1 << 30, 1 << 40])
def test_a_lying_size_word_is_refused_before_any_second_part(name, extra):
    data, _ = MESSAGES[name]
    lie = data.clone()
    _set_size_word(lie, _size_word(lie) + extra)
    for capacity in (MIN_CAPACITY, data.numel()):
        with pytest.raises(ValueError, match="corrupt message from rank 0: its size word says"):
            _receive(lie, capacity)


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_a_truncated_message_is_refused_at_every_cut(name):
    """A sender that puts fewer bytes on the wire than its size word says, cut anywhere after the fixed
    fields, in one part or in two: refused, never decoded from the zeros the receive buffer held."""
    data, _ = MESSAGES[name]
    fields = 8 * (5 + 2 + 1 + int(data[32:40].view(torch.int64)))
    for capacity in (MIN_CAPACITY, data.numel()):
        parts = wire_parts(data, capacity)
        cuts = range(40, data.numel()) if len(parts) == 1 else range(40, parts[0].numel() + parts[1].numel())
        for cut in cuts:
            short = [parts[0][:cut], parts[1][: max(cut - parts[0].numel(), 0)]] if len(parts) == 2 else [data[:cut]]
            first = torch.zeros(capacity, dtype=torch.uint8)
            first[: short[0].numel()] = short[0]

            def rest(k: int) -> torch.Tensor:
                buf = torch.zeros(k, dtype=torch.uint8)
                buf[: short[1].numel()] = short[1]
                return buf

            with pytest.raises(ValueError, match="truncated" if cut >= fields else "corrupt message from rank 0"):
                read_message(first, rest, 0, LIMIT, "cpu")


def test_headers_beyond_the_first_part_are_bounded_by_the_limit():
    """With more header words than the first part holds, only the limit bounds the size word."""
    codec = get_codec("none")
    payloads = [codec.encode(torch.randn(2)) for _ in range(40)]  # 40 headers: > 512 bytes of fields
    data = wire_message(payloads, [])
    (got, _, total), asked = _receive(data, MIN_CAPACITY)
    assert len(got) == 40 and asked == [total - MIN_CAPACITY + 8]
    lie = data.clone()
    _set_size_word(lie, LIMIT + 1)
    with pytest.raises(ValueError, match=f"size word says {LIMIT + 1} bytes, outside"):
        _receive(lie, MIN_CAPACITY)
    _set_size_word(lie, data.numel() + 8)  # within the limit: found out once the message is complete
    with pytest.raises(ValueError, match="but its headers describe"):  # found out once the message is complete
        _receive(lie, MIN_CAPACITY)
    ext = torch.cat([data, torch.zeros(8, dtype=torch.uint8)])
    _set_size_word(ext, ext.numel())
    with pytest.raises(ValueError, match="but its headers describe"):
        _receive(ext, MIN_CAPACITY)


def test_a_header_declaring_a_huge_tensor_is_refused_before_decoding():
    """A sparse payload may decode to far more than it sends, but not to gigabytes from a few
    hundred bytes: the declared tensors are bounded by MAX_EXPANSION x the message (or MIN_DECLARED)."""
    codec = get_codec("randomk", ratio=0.3, seed=1)
    payload = codec.encode(torch.randn(3, 40))
    payload.header[4:6] = torch.tensor([3, 40 * 10**6])  # ndim 2: the shape words follow dtype and ndim
    assert parse_header(payload.header).shape == (3, 40 * 10**6)
    with pytest.raises(ValueError, match="declare tensors of 480000000 bytes, more than 4096x"):
        _receive(wire_message([payload], []), MIN_CAPACITY)


class _NeverDecodes(type(get_codec("quant", bits=8))):
    """The receiver's 8-bit codec: reaching its decode means a refused frame was decoded."""

    def __init__(self) -> None:
        super().__init__(bits=8)

    def decode(self, payload):
        raise AssertionError("a refused frame was decoded")


def _lying_boundary(rank: int, world_size: int, lie: str) -> None:
    """Rank 0 sends one forward message whose lanes lie (``lie``); rank 1 receives it."""
    from dgpipe.comm import BandwidthMeter
    from dgpipe.compression.wrappers.reference import TokenReference
    from dgpipe.pipeline.boundary import Boundary

    rows = lie == "rows"
    codec = (lambda: get_codec("quant", bits=8)) if rank == 0 else _NeverDecodes
    spec = BoundarySpec(row_mask=1) if rows else BoundarySpec(token_reference=TokenReference(50))
    boundary = Boundary(0, 0, 1, codec, codec, BandwidthMeter(), torch.device("cpu"), 60.0, rank=rank, report=None,
                        spec=spec)
    if rank == 1:
        boundary.recv_forward(0, "forward")
        raise AssertionError("the lying message was accepted")
    honest = boundary._send

    def lying(direction, message, tensors, ids=None, keep=None, tokens=None):
        if lie == "rows":  # one row fewer than the row mask keeps
            keep = keep.clone()
            keep[tuple(keep.nonzero()[0])] = False
        elif lie == "ids":  # the token ids sent are out of the vocabulary (the sender coded with its own)
            tensors[message.token_ids] = tensors[message.token_ids] + 50
        else:  # token ids of another length than the hidden states
            tensors[message.token_ids] = tensors[message.token_ids][:, :-1]
        return honest(direction, message, tensors, ids, keep, tokens)

    boundary._send = lying
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    second = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]) if rows else torch.randint(0, 50, (2, 5), generator=g)
    boundary.send_forward(0, (x, second), 1, "forward")
    time.sleep(60)  # until the launcher ends this rank, once rank 1 has refused the message


@pytest.mark.parametrize("lie, error", [
    ("rows", r"tensor 0 declares \(6, 8\) rows for a row mask that keeps 7"),
    ("ids", r"token ids: token ids in \[\d+, \d+\], outside \[0, 50\)"),
    ("length", r"tensor 0 declares shape \(2, 5, 8\) for token ids \(2, 4\)"),
])
def test_lying_row_masks_and_token_ids_are_refused_before_decoding(lie, error):
    """dgpipe's runtime, two ranks: a forward message whose row mask keeps more rows than were sent,
    or whose token ids lie outside the vocabulary or do not fit the hidden states, is refused by the
    receiving rank before any tensor is decoded, naming the boundary and the sender; the launcher
    ends both ranks."""
    from dgpipe.pipeline import SpawnError, spawn

    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank 1 failed: ValueError: stage0->stage1 forward, micro-batch 0: "
                                         r"corrupt payload from rank 0: " + error):
        spawn(_lying_boundary, 2, args=(lie,), timeout=120, start_method="fork")
    assert time.monotonic() - start < 60  # the refusal, not a timeout, ended the ranks


def _truncating_boundary(rank: int, world_size: int, part: int) -> None:
    """Rank 0 sends one forward message of the runtime's boundary with part ``part`` (0: the whole message of one
    part; 1: the second of two) 100 bytes short; rank 1 receives it through its Boundary."""
    from dgpipe.comm import BandwidthMeter
    from dgpipe.comm.framing import pack_message, split_parts
    from dgpipe.compression.base import Payload
    from dgpipe.pipeline.boundary import Boundary
    from dgpipe.pipeline.message import CODED, REQUIRES_GRAD, Message

    boundary = Boundary(0, 0, 1, _NeverDecodes, _NeverDecodes, BandwidthMeter(), torch.device("cpu"), 60.0, rank=rank,
                        report=None)
    if rank == 1:
        boundary.recv_forward(0, "forward")
        raise AssertionError("the truncated message was accepted")
    x = torch.randn(2, 40 if part == 0 else 400)
    payload: Payload = get_codec("quant", bits=8).encode(x)
    buf, _ = pack_message([payload], Message((CODED | REQUIRES_GRAD,), 1, 0, atomic=True).to_meta())
    parts = split_parts(buf, MIN_CAPACITY)
    assert len(parts) == part + 1
    parts[part] = parts[part][:-100]
    for p in parts:
        torch.distributed.isend(p, 1, tag=0).wait()
    time.sleep(60)  # until the launcher ends this rank, once rank 1 has refused the message


@pytest.mark.parametrize("part", [0, 1])
def test_a_truncated_message_is_refused_by_the_runtimes_boundary(part):
    """dgpipe's runtime, two ranks on gloo: a forward message cut 100 bytes short (gloo completes the receive, the
    buffer's tail stays zero) is refused by the receiving rank before anything is decoded, naming the boundary
    and the sender; the launcher ends both ranks."""
    from dgpipe.pipeline import SpawnError, spawn

    with pytest.raises(SpawnError, match=r"rank 1 failed: ValueError: stage0->stage1 forward, micro-batch 0: corrupt "
                                         r"message from rank 0: truncated: the closing word is missing from its "
                                         r"\d+ bytes"):
        spawn(_truncating_boundary, 2, args=(part,), timeout=120, start_method="fork")
