"""dgpipe.comm.link: every message coded, framed and metered in one place.

Bytes are checked against the message layout computed independently in ``helpers.message_bytes``; a two-rank
gloo world checks that the sender's and the receiver's records of one stream agree; and a scan of the package checks
that nothing outside ``dgpipe/comm`` records into a meter.
"""

import ast
from pathlib import Path

import pytest
import torch

import dgpipe
from dgpipe.comm import BandwidthMeter
from dgpipe.comm.link import Link
from dgpipe.comm.framing import message_size, pack_message
from dgpipe.comm.transport import Receiver, Sender
from dgpipe.compression import get_codec
from helpers import assert_ranks_ok, message_bytes, spawn_checks

QUANT = get_codec("quant", bits=4)
MASK = get_codec("intpack")


def _message(link: Link, x: torch.Tensor, mask: torch.Tensor):
    with link.encoding("forward") as out:
        out.add(QUANT.encode(x), x.numel() * x.element_size())
        out.add(MASK.encode(mask))
    return out


def test_a_framed_message_is_recorded_with_its_exact_bytes_in_every_meter():
    a, b = BandwidthMeter(), BandwidthMeter()
    sender, receiver = Link("stage0->stage1", a, None, b), Link("stage0->stage1", a)
    x, mask = torch.randn(3, 5, 8), (torch.arange(15).reshape(3, 5) % 2)
    out = _message(sender, x, mask)
    buf = sender.frame(out)
    total = message_bytes(out.payloads, 0)
    assert buf.numel() == total == message_size(out.payloads)
    wire = sum(p.nbytes for p in out.payloads)
    for meter in (a, b):
        (rec,) = meter.records()
        assert (rec["raw_bytes"], rec["wire_bytes"], rec["frame_bytes"], rec["count"]) == (480, wire, total - wire, 1)
        assert rec["encode_seconds"] > 0
    incoming = receiver.unframe(buf, 0, "cpu")
    assert incoming.meta == [] and incoming.recv_seconds == 0.0 and incoming.nbytes == wire
    with receiver.decoding("forward", incoming):
        y = QUANT.decode(incoming.payloads[0])
        assert torch.equal(MASK.decode(incoming.payloads[1]), mask)
    assert torch.equal(y, QUANT.decode(out.payloads[0]))
    (rec,) = a.records()
    assert (rec["recv_bytes"], rec["recv_count"]) == (wire, 1) and rec["decode_seconds"] > 0
    assert b.records()[0]["recv_count"] == 0  # the receiving end records only into its own meter


def test_a_block_that_raises_records_nothing_received():
    meter = BandwidthMeter()
    link = Link("client->server", meter)
    buf = link.frame(_message(link, torch.randn(2, 4), torch.ones(2, 4, dtype=torch.long)))
    incoming = link.unframe(buf, 0, "cpu")
    with pytest.raises(ValueError, match="refused"), link.decoding("forward", incoming):
        raise ValueError("refused")
    assert meter.records()[0]["recv_count"] == 0


def test_an_in_process_message_has_no_framing_and_a_meterless_link_records_nothing():
    meter = BandwidthMeter()
    out = _message(Link("x", meter), torch.randn(4, 4), torch.ones(4, 4, dtype=torch.long))
    Link("x", meter).account(out)
    (rec,) = meter.records()
    assert rec["frame_bytes"] == 0 and rec["wire_bytes"] == sum(p.nbytes for p in out.payloads)
    Link("x").frame(out)  # no meter: framed, nothing recorded
    assert meter.records()[0]["count"] == 1


def test_a_cut_message_is_refused_by_unframe():
    link = Link("x")
    buf, total = pack_message(_message(link, torch.randn(4, 4), torch.ones(4, 4, dtype=torch.long)).payloads)
    cut = buf.clone()
    cut[total - 8:] = 0  # what gloo leaves in a zeroed buffer when the sender put fewer bytes
    with pytest.raises(ValueError, match="corrupt message from rank 3: truncated"):
        link.unframe(cut, 3, "cpu")


def check_both_ends_agree(rank):
    """Three messages of changing shapes over one stream (the later ones past the stream's first capacity, so
    sent in two parts): the receiver's recv_bytes equal the sender's wire_bytes, and the sender's frame bytes are
    what the transport put on the wire beyond the payloads."""
    meter = BandwidthMeter()
    link = Link("stage0->stage1", meter)
    shapes = [(2, 3, 8), (5, 64), (1, 1, 4096)]
    if rank == 0:
        sender = Sender(1, tag=5)
        works = []
        for i, shape in enumerate(shapes):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(i))
            out = _message(link, x, torch.ones(shape[:2], dtype=torch.long))
            works.append(link.send(sender, out, [i, 7], f"message {i}"))
            if i == 0:  # within the stream's first capacity: one part, the message itself
                assert works[0].nbytes == message_bytes(out.payloads, 2)
        for w in works:
            w.wait(30)
        rec = meter.records()[0]
        assert rec["count"] == 3 and rec["frame_bytes"] == sum(w.nbytes for w in works) - rec["wire_bytes"]
        sent = torch.tensor([rec["wire_bytes"], rec["raw_bytes"]], dtype=torch.float64)
        torch.distributed.send(sent, 1)
    else:
        receiver = Receiver(0, tag=5)
        for i, shape in enumerate(shapes):
            incoming = link.receive(receiver, "cpu", 30)
            assert incoming.meta == [i, 7] and incoming.recv_seconds >= 0
            with link.decoding("forward", incoming):
                x = torch.randn(shape, generator=torch.Generator().manual_seed(i))
                assert torch.equal(QUANT.decode(incoming.payloads[0]), QUANT.decode(QUANT.encode(x)))
        sent = torch.empty(2, dtype=torch.float64)
        torch.distributed.recv(sent, 0)
        rec = meter.records()[0]
        assert rec["recv_count"] == 3 and rec["recv_bytes"] == sent[0].item() and sent[1].item() > 0


def test_both_ends_of_a_stream_agree(tmp_path):
    assert_ranks_ok(spawn_checks({"agree": check_both_ends_agree}, 2, tmp_path), "agree", 2)


def test_only_comm_records_into_a_meter():
    """The meter's record methods are called from dgpipe/comm alone: every other module moves its traffic
    through a Link."""
    root = Path(dgpipe.__file__).parent
    callers = []
    for path in root.rglob("*.py"):
        if path.parent.name == "comm" and path.parent.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("record_send", "record_recv"):
                callers.append(f"{path.relative_to(root)}:{node.lineno}")
    assert callers == []
