"""send_payload / recv_payload between two gloo ranks: exact round trips, validation, timeouts.

All checks run in one spawned 2-rank world (one process-group start for the module);
each rank writes its outcome per check to a file, and every test reads its own check.
"""

import time

import pytest
import torch
import torch.distributed as dist

from dgpipe.comm.framing import MAGIC
from dgpipe.comm.transport import Receiver, Sender, TransportError, recv_payload, send_payload
from dgpipe.compression import Payload, get_codec
from dgpipe.compression.base import make_payload
from helpers import assert_ranks_ok, message_bytes, spawn_checks, wire_message


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (4, 2), generator=g),
        torch.rand(6, generator=g) > 0.5,
        torch.randn((), generator=g, dtype=torch.float64),
        torch.empty(0, 4),
        torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
    ]


def check_round_trip(rank):
    """Lossless payloads of many dtypes/shapes (0-d, empty) arrive bit-exact, in order."""
    none = get_codec("none")
    if rank == 0:
        works = [send_payload(none.encode(t), 1, tag=3) for t in _tensors()]
        for w in works:
            w.wait(10)
    else:
        for t in _tensors():
            p = recv_payload(0, "cpu", tag=3, timeout=10)
            assert p.nbytes == none.encode(t).nbytes
            got = none.decode(p)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got, t)


def check_multi_tensor_payload(rank):
    """A payload with several tensors (fp16 codec header + data) decodes to the sender's result."""
    codec = get_codec("fp16")
    x = torch.linspace(-3, 3, 50).reshape(5, 10)
    if rank == 0:
        send_payload(codec.encode(x), 1).wait(10)
    else:
        got = codec.decode(recv_payload(0, "cpu", timeout=10))
        assert torch.equal(got, x.half().float())


def check_tags_keep_streams_apart(rank):
    """Messages on different tags are matched by tag, not by arrival order."""
    none = get_codec("none")
    if rank == 0:
        a = send_payload(none.encode(torch.full((2,), 1.0)), 1, tag=11)
        b = send_payload(none.encode(torch.full((3,), 2.0)), 1, tag=12)
        a.wait(10)
        b.wait(10)
    else:
        second = none.decode(recv_payload(0, "cpu", tag=12, timeout=10))
        first = none.decode(recv_payload(0, "cpu", tag=11, timeout=10))
        assert torch.equal(first, torch.full((2,), 1.0)) and torch.equal(second, torch.full((3,), 2.0))


def check_stream_capacity_and_posting(rank):
    """A stream whose messages grow and shrink, received into pre-posted buffers, arrives
    bit-exact with its meta; each message's wire size is its exact packed size (and the first part's
    closing word where it grows the stream), and the
    capacity both ends agree on is the largest message so far."""
    none = get_codec("none")
    sizes = [3, 1000, 10, 5000, 5000, 2]
    messages = [[none.encode(torch.arange(n, dtype=torch.float32)), none.encode(torch.tensor([i]))]
                for i, n in enumerate(sizes)]  # fmt: skip
    if rank == 0:
        sender = Sender(1, tag=41)
        works = [sender.send(m, meta=[i, -n]) for i, (m, n) in enumerate(zip(messages, sizes))]
        capacity, want = 512, []
        for m in messages:  # a message past the capacity goes out in two parts, the first closed by 8 bytes
            want.append(message_bytes(m, 2) + (8 if message_bytes(m, 2) > capacity else 0))
            capacity = max(capacity, message_bytes(m, 2))
        assert [w.nbytes for w in works] == want
        for w in works:
            w.wait(10)
    else:
        receiver = Receiver(0, tag=41)
        for i, n in enumerate(sizes):
            receiver.post()
            payloads, meta = receiver.recv("cpu", timeout=10)
            assert meta == [i, -n]
            assert torch.equal(none.decode(payloads[0]), torch.arange(n, dtype=torch.float32))
            assert torch.equal(none.decode(payloads[1]), torch.tensor([i]))
        assert receiver.capacity == max(message_bytes(m, 2) for m in messages)


def check_corrupt_magic(rank):
    """A message without the magic is refused."""
    if rank == 0:
        dist.send(torch.tensor([12345, 40, 0, 0, 0], dtype=torch.int64).view(torch.uint8), 1, tag=21)
    else:
        with pytest.raises(ValueError, match="corrupt message from rank 0: magic 0x3039"):
            recv_payload(0, "cpu", tag=21, timeout=10)


def check_corrupt_header(rank):
    """A header with a bad dtype code is refused (parse_header)."""
    payload = make_payload(0, torch.float32, (4,), (), (torch.zeros(4),))
    payload.header[2] = 99  # dtype code of the original tensor
    if rank == 0:
        send_payload(payload, 1, tag=22).wait(10)
    else:
        with pytest.raises(ValueError, match="unknown dtype code 99"):
            recv_payload(0, "cpu", tag=22, timeout=10)


def check_inconsistent_layout(rank):
    """A header that does not describe the bytes that follow is refused."""
    honest = make_payload(0, torch.float32, (4,), (), (torch.zeros(4),))
    lying = Payload(honest.header, (torch.zeros(2),))  # header says 4 values, 2 are sent
    if rank == 0:
        send_payload(lying, 1, tag=23).wait(10)
    else:
        described, sent = message_bytes([honest], 0), message_bytes([lying], 0)
        with pytest.raises(ValueError, match=f"size word says {sent} bytes but its headers describe {described}"):
            recv_payload(0, "cpu", tag=23, timeout=10)


def check_oversized_message(rank):
    """A message announcing more than max_bytes is refused before allocating for it."""
    if rank == 0:
        dist.send(torch.tensor([MAGIC, 4 * 10**9, 0, 0, 0], dtype=torch.int64).view(torch.uint8), 1, tag=24)
    else:
        with pytest.raises(ValueError, match="size word says 4000000000 bytes, outside \\[40, 1000000\\]"):
            recv_payload(0, "cpu", tag=24, timeout=10, max_bytes=10**6)


def check_size_word_lie_refused_at_once(rank):
    """A real message whose size word claims 1 GiB more than is sent is refused at once, before any
    allocation for or wait on a second part; the stream then carries on."""
    x = torch.randn(6, 40)
    payload = get_codec("sortquant", quant_bits=3, split_bits=1).encode(x)
    good = get_codec("none").encode(x)
    lies = {1 << 20: "but its headers describe", 1 << 30: "outside \\[176, 268435456\\]"}  # the stream's limit
    if rank == 0:
        for extra in lies:
            buf = wire_message([payload], [7])
            buf.view(torch.int64)[1] += extra
            dist.send(buf, 1, tag=26)
        Sender(1, tag=26).send([good]).wait(10)
    else:
        receiver = Receiver(0, tag=26)
        for extra, why in lies.items():
            start = time.monotonic()
            size = extra + message_bytes([payload], 1)
            with pytest.raises(ValueError, match=f"corrupt message from rank 0: its size word says {size} bytes.*{why}"):
                receiver.recv("cpu", timeout=30)
            assert time.monotonic() - start < 5  # not the 30 s timeout
        (p,), _ = receiver.recv("cpu", timeout=10)
        assert torch.equal(get_codec("none").decode(p), x)


def check_dropped_handle_still_delivers(rank):
    """A message whose send handle is dropped unwaited, before the receiver asks for it, still arrives:
    its Sender holds the send until it completes (gloo alone would drop it with the handle)."""
    x = torch.arange(6.0)
    if rank == 0:
        sender = Sender(1, tag=41)
        sender.send([get_codec("none").encode(x)])  # the handle is dropped here
        assert len(sender._unfinished) == 1
        dist.barrier()  # the receiver asks only after this
        dist.barrier()  # the sender lives until the message has arrived
    else:
        dist.barrier()
        time.sleep(0.5)
        got = recv_payload(0, "cpu", tag=41, timeout=10)
        assert torch.equal(get_codec("none").decode(got), x)
        dist.barrier()


def check_timeout_names_peer(rank):
    """A receive from a silent (alive) peer ends within its timeout with an error naming the peer."""
    if rank == 0:
        time.sleep(2)  # stay alive and silent
    else:
        start = time.monotonic()
        with pytest.raises(TransportError, match="timed out after 1 s: rank 0 is stalled") as info:
            recv_payload(0, "cpu", tag=31, timeout=1.0)
        assert info.value.peer == 0
        assert time.monotonic() - start < 5
        # gloo closed the pair: later receives are TransportErrors naming the peer too, not raw RuntimeErrors
        with pytest.raises(TransportError, match="receiving from rank 0 failed") as info:
            recv_payload(0, "cpu", tag=32, timeout=1.0)
        assert info.value.peer == 0


CHECKS = [
    check_round_trip,
    check_multi_tensor_payload,
    check_tags_keep_streams_apart,
    check_stream_capacity_and_posting,
    check_corrupt_magic,
    check_corrupt_header,
    check_inconsistent_layout,
    check_oversized_message,
    check_size_word_lie_refused_at_once,
    check_dropped_handle_still_delivers,
    check_timeout_names_peer,  # last: a timed-out gloo pair is closed afterwards
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    # No barrier after the last check: its timed-out gloo pair is closed.
    return spawn_checks({c.__name__: c for c in CHECKS}, 2, tmp_path_factory.mktemp("transport"),
                        barrier_after_last=False)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_transport(outcomes, check):
    assert_ranks_ok(outcomes, check, 2)
