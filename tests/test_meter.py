"""BandwidthMeter: sums, derived fields, gathering across ranks, and exact wire bytes of a
2-rank pipeline with sort-quantized boundaries."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dgpipe.comm import BandwidthMeter
from dgpipe.comm import meter as meter_module
from dgpipe.comm.meter import DeviceSpan, timer
from dgpipe.compression import available_codecs, get_codec
from dgpipe.pipeline import Pipeline, split_layers
from helpers import assert_ranks_ok, spawn_checks

HAS_SORTQUANT = "sortquant" in available_codecs()


def test_records_sum_and_derive():
    m = BandwidthMeter()
    m.record_send("stage0->stage1", "forward", raw_bytes=4000, wire_bytes=1000, frame_bytes=64, encode_seconds=0.5)
    m.record_send("stage0->stage1", "forward", raw_bytes=4000, wire_bytes=1100, encode_seconds=0.25)
    m.record_recv("stage0->stage1", "forward", recv_bytes=2100, recv_seconds=0.5, decode_seconds=0.125)
    m.record_send("stage0->stage1", "backward", raw_bytes=100, wire_bytes=100)
    recs = m.records()
    keys = [(r["name"], r["direction"]) for r in recs]
    assert keys == [("stage0->stage1", "backward"), ("stage0->stage1", "forward")]
    fwd = recs[1]
    assert fwd["raw_bytes"] == 8000 and fwd["wire_bytes"] == 2100 and fwd["frame_bytes"] == 64
    assert fwd["count"] == 2 and fwd["recv_count"] == 1
    assert fwd["encode_seconds"] == 0.75 and fwd["decode_seconds"] == 0.125
    assert fwd["recv_bytes_per_s"] == 4200.0
    assert fwd["ratio"] == 2100 / 8000
    assert recs[0]["recv_bytes_per_s"] == 0.0  # nothing received: no division by zero
    tot = m.totals()
    assert tot["raw_bytes"] == 8100 and tot["wire_bytes"] == 2200 and tot["ratio"] == 2200 / 8100
    assert m.totals("backward")["raw_bytes"] == 100
    m.reset()
    assert m.records() == [] and m.totals()["wire_bytes"] == 0


class _Span(DeviceSpan):
    """A GPU span's stand-in: finished or not, as set; counts how often its seconds were read."""

    def __init__(self, seconds: float, finished: bool) -> None:
        self.value, self.finished, self.reads = seconds, finished, 0

    def done(self) -> bool:
        return self.finished

    def seconds(self) -> float:
        self.reads += 1
        return self.value


def test_gpu_spans_are_read_when_the_meter_is_read(monkeypatch):
    """Codec seconds on a GPU arrive as spans (CUDA events) that nobody waits for when a message is sent:
    the meter adds finished ones once it holds many, and all of them when it is read -- each once."""
    monkeypatch.setattr(meter_module, "_SETTLE_AT", 3)
    m = BandwidthMeter()
    spans = [_Span(0.25, finished=i != 1) for i in range(3)]
    m.record_send("stage0->stage1", "forward", raw_bytes=8, wire_bytes=2, encode_seconds=spans[0])
    m.record_recv("stage0->stage1", "forward", recv_bytes=2, recv_seconds=0.5, decode_seconds=spans[1])
    assert [s.reads for s in spans] == [0, 0, 0]  # nothing read while messages go
    m.record_send("stage0->stage1", "forward", raw_bytes=8, wire_bytes=2, encode_seconds=spans[2])
    assert [s.reads for s in spans] == [1, 0, 1]  # the finished ones, at the third
    (rec,) = m.records()
    assert rec["encode_seconds"] == 0.5 and rec["decode_seconds"] == 0.25 and rec["recv_seconds"] == 0.5
    assert [s.reads for s in spans] == [1, 1, 1]
    m.records()
    assert [s.reads for s in spans] == [1, 1, 1]


def test_cpu_timer_is_wall_time():
    stop = timer(torch.device("cpu"))
    assert isinstance(stop(), float) and stop() >= 0.0


def test_rejects_separator_characters_in_names():
    with pytest.raises(ValueError, match="control characters"):
        BandwidthMeter().record_send("a\x1fb", "forward", raw_bytes=1, wire_bytes=1)


# --- multi-process checks (one spawned 2-rank world for the module) --------------------------


def check_gather_merges_ranks(rank):
    """Records of both ranks, including ones only one rank has, are summed on rank 0 only."""
    m = BandwidthMeter()
    m.record_send("stage0->stage1", "forward", raw_bytes=10 * (rank + 1), wire_bytes=5, encode_seconds=0.5)
    m.record_recv("stage0->stage1", "forward", recv_bytes=7, recv_seconds=0.25)
    m.record_send(f"only-rank{rank}->é", "backward", raw_bytes=3, wire_bytes=2)
    merged = m.gather(dst=0)
    if rank != 0:
        assert merged is None
        return
    recs = {(r["name"], r["direction"]): r for r in merged.records()}
    assert set(recs) == {("stage0->stage1", "forward"), ("only-rank0->é", "backward"), ("only-rank1->é", "backward")}
    fwd = recs[("stage0->stage1", "forward")]
    assert fwd["raw_bytes"] == 30 and fwd["wire_bytes"] == 10 and fwd["recv_bytes"] == 14
    assert fwd["count"] == 2 and fwd["recv_count"] == 2 and fwd["encode_seconds"] == 1.0
    assert fwd["recv_bytes_per_s"] == 14 / 0.5


def check_empty_meter_gathers(rank):
    merged = BandwidthMeter().gather(dst=1)
    assert (merged is None) == (rank == 0)
    assert rank == 0 or merged.records() == []


def check_sortquant_8bit_wire_bytes(rank):
    """Wire bytes == sum of sortquant payload sizes; wire/raw within 1% of 8/32 (headers included)."""
    if not HAS_SORTQUANT:
        return
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 1024), nn.Tanh(), nn.Linear(1024, 3))
    spec = ("sortquant", {"quant_bits": 6, "split_bits": 2})
    chunks, batch, steps = 4, 64, 2
    pipe = Pipeline(split_layers(model, [2, 1]), [0, 1], chunks=chunks, loss_fn=F.cross_entropy,
                    act_codec=spec, timeout=30)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 16, generator=g), torch.randint(0, 3, (batch,), generator=g)
    for _ in range(steps):
        pipe.train_step(x, y)
    micro = torch.randn(batch // chunks, 1024)  # activation and its gradient: float32[16, 1024]
    payload_bytes = get_codec(spec[0], **spec[1]).encode(micro).nbytes
    raw = micro.numel() * 4
    # This rank's last step: it sent `chunks` payloads one way and received `chunks` the other.
    last = pipe.last_step_totals
    assert (last["raw_bytes"], last["wire_bytes"], last["recv_bytes"]) == (chunks * raw, *[chunks * payload_bytes] * 2)
    merged = pipe.meter.gather(dst=0)
    if rank != 0:
        return
    recs = {r["direction"]: r for r in merged.records()}
    assert set(recs) == {"forward", "backward"}
    for direction, r in recs.items():
        n = chunks * steps
        assert r["name"] == "stage0->stage1"
        assert r["count"] == n and r["recv_count"] == n
        assert r["raw_bytes"] == n * raw
        assert r["wire_bytes"] == n * payload_bytes == r["recv_bytes"]
        assert abs(r["ratio"] - 8 / 32) <= 0.01 * 8 / 32, (direction, r["ratio"])
        assert r["recv_seconds"] > 0 and r["encode_seconds"] > 0 and r["decode_seconds"] > 0


CHECKS = [check_gather_merges_ranks, check_empty_meter_gathers, check_sortquant_8bit_wire_bytes]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return spawn_checks({c.__name__: c for c in CHECKS}, 2, tmp_path_factory.mktemp("meter"))


@pytest.mark.parametrize(
    "check",
    [
        "check_gather_merges_ranks",
        "check_empty_meter_gathers",
        pytest.param(
            "check_sortquant_8bit_wire_bytes",
            marks=pytest.mark.skipif(not HAS_SORTQUANT, reason="sortquant not registered yet"),
        ),
    ],
)
def test_meter_across_ranks(outcomes, check):
    assert_ranks_ok(outcomes, check, 2)


def test_meter_state_restores_the_sums():
    """A checkpoint carries the meter's sums of the epoch so far; a malformed state is refused."""
    meter = BandwidthMeter()
    meter.record_send("0->1", "forward", raw_bytes=400, wire_bytes=100, frame_bytes=8, encode_seconds=0.5)
    meter.record_recv("0->1", "backward", recv_bytes=96, recv_seconds=0.25)
    restored = BandwidthMeter()
    restored.load_state_dict(meter.state_dict())
    assert restored.records() == meter.records()
    restored.record_send("0->1", "forward", raw_bytes=400, wire_bytes=100)
    assert restored.totals("forward")["wire_bytes"] == 200 and restored.totals("forward")["count"] == 2
    with pytest.raises(ValueError, match="is not a boundary record"):
        restored.load_state_dict({"no separator": dict.fromkeys(meter.records()[0], 0.0)})
