"""CompressedPipelineStage under every schedule torch ships, against torch's PipelineStage.

The model has a tuple boundary (hidden state, integer mask): the hidden state is coded, the
mask travels as torch sends it. Every check runs the same two steps (SGD between them) twice
in one gloo world, once with torch's ``PipelineStage`` and once with the compressed stage,
and compares what each rank saw: the last stage's micro-batch losses and every local
parameter's gradient, per step.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
                                          ScheduleZBVZeroBubble)

from dgpipe.compression import Codec, get_codec
from dgpipe.pipeline import SpawnError, spawn
from dgpipe.pipeline.tied import TiedParameters
from dgpipe.pipelining import UNTESTED_TORCH_ENV, CompressedPipelineStage, check_torch_version
from helpers import assert_ranks_ok, message_bytes, spawn_checks

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "loopedbfs": ScheduleLoopedBFS, "interleavedzb": ScheduleInterleavedZeroBubble,
             "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
LOOPED, V_SHAPED = ("interleaved", "loopedbfs", "interleavedzb"), ("zbv", "dualpipev")
MICRO = 8  # DualPipeV on 4 ranks needs as many micro-batches as its 8 stages
BATCH = 16
WIDTH = 32


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x)), (x[:, :1] > 0).long()


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, mask):
        return torch.tanh(self.linear(h)) * (1 + mask), mask


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, 4)

    def forward(self, h, mask):
        return self.linear(h * (1 + mask))


def _stage_indices(schedule: str, rank: int, world: int) -> tuple[int, list[int]]:
    """(number of stages, this rank's stage indices): one per rank, or two (looped or V-shaped)."""
    if schedule in LOOPED:
        return 2 * world, [rank, rank + world]
    if schedule in V_SHAPED:
        return 2 * world, [rank, 2 * world - 1 - rank]
    return world, [rank]


def _train(rank: int, world: int, schedule: str, **codecs) -> tuple[list, list[CompressedPipelineStage]]:
    """Two steps of ``schedule``; per step (losses, gradients). ``codecs`` given: the compressed stage."""
    n, mine = _stage_indices(schedule, rank, world)
    torch.manual_seed(0)
    modules = [First()] + [Middle() for _ in range(n - 2)] + [Last()]
    make = (lambda i: CompressedPipelineStage(modules[i], i, n, torch.device("cpu"), **codecs)) if codecs else (
        lambda i: PipelineStage(modules[i], i, n, torch.device("cpu")))
    stages = [make(i) for i in mine]
    pipe = SCHEDULES[schedule](stages if len(stages) > 1 else stages[0], MICRO, loss_fn=F.cross_entropy)
    params = [p for i in mine for p in modules[i].parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(2):
        x, y = torch.randn(BATCH, 16, generator=gen), torch.randint(0, 4, (BATCH,), generator=gen)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": losses} if n - 1 in mine else {}
        pipe.step(x, **kwargs) if 0 in mine else pipe.step(**kwargs)
        seen.append(([float(v) for v in losses], [p.grad.clone() for p in params]))
        opt.step()
    return seen, [s for s in stages if isinstance(s, CompressedPipelineStage)]


def _lossless(schedule: str, world: int):
    def check(rank: int) -> None:
        reference, _ = _train(rank, world, schedule)
        coded, stages = _train(rank, world, schedule, act_codec="none", grad_codec="none")
        for (ref_losses, ref_grads), (losses, grads) in zip(reference, coded):
            assert losses == ref_losses
            assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads))
        assert sum(r["wire_bytes"] for s in stages for r in s.meter.records()) > 0  # it did code
    check.__name__ = f"lossless_{schedule}_{world}"
    return check


def check_two_bits_forward_four_back(rank: int) -> None:
    """Each direction its own codec and size; losses near the uncompressed run's at 8 bits."""
    reference, _ = _train(rank, 2, "1f1b")
    coded, (stage,) = _train(rank, 2, "1f1b", act_codec=("quant", {"bits": 8}), grad_codec=("quant", {"bits": 8}))
    if rank == 1:
        for (ref_losses, _), (losses, _) in zip(reference, coded):
            assert max(abs(a - b) for a, b in zip(ref_losses, losses)) < 0.01 * max(ref_losses)
    _, (stage,) = _train(rank, 2, "1f1b", act_codec=("quant", {"bits": 2}), grad_codec=("quant", {"bits": 4}))
    records = {r["direction"]: r for r in stage.meter.records()}
    messages = 2 * MICRO  # two steps of MICRO micro-batches, one hidden state each
    shape = (BATCH // MICRO, WIDTH)
    for direction, bits in (("forward", 2), ("backward", 4)):
        payload = get_codec("quant", bits=bits).encode(torch.zeros(shape))
        sent_here = (direction == "forward") == (rank == 0)
        r = records[direction]
        mask = 8 * shape[0] if direction == "forward" else 0  # the int64 mask goes raw, forward only
        if sent_here:
            assert r["count"] == messages * (2 if mask else 1)
            assert r["raw_bytes"] == messages * (4 * shape[0] * shape[1] + mask)
            assert r["wire_bytes"] == messages * (payload.nbytes + mask)
            assert r["frame_bytes"] == messages * (message_bytes([payload], 0) - payload.nbytes)
        else:
            assert r["recv_bytes"] == messages * (payload.nbytes + mask)
        assert stage.message_nbytes(direction, shape, torch.float32) == message_bytes([payload], 0)


CHECKS = [_lossless(s, w) for w in (2, 4) for s in SCHEDULES] + [check_two_bits_forward_four_back]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    two = spawn_checks({c.__name__: c for c in CHECKS if not c.__name__.endswith("_4")}, 2,
                       tmp_path_factory.mktemp("pipelining2"))
    four = spawn_checks({c.__name__: c for c in CHECKS if c.__name__.endswith("_4")}, 4,
                        tmp_path_factory.mktemp("pipelining4"))
    return two, four


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_compressed_stage_under_torch_schedules(outcomes, check):
    world = 4 if check.endswith("_4") else 2
    assert_ranks_ok(outcomes[world == 4], check, world)


def test_refuses_variable_size_codecs_and_warns_on_untested_torch(monkeypatch):
    part = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"payload size depends on the values \(\[\d+, \d+\] bytes"):
        CompressedPipelineStage(part, 0, 2, torch.device("cpu"), act_codec="atomo")
    with pytest.raises(ValueError, match="cannot code the floating-point tensors a stage sends"):
        CompressedPipelineStage(part, 0, 2, torch.device("cpu"), act_codec="intpack")
    with pytest.raises(ValueError, match="unknown codec"):
        CompressedPipelineStage(part, 0, 2, torch.device("cpu"), grad_codec="no-such-codec")
    monkeypatch.delenv(UNTESTED_TORCH_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match=r"tested with torch 2\.13, 2\.14, 2\.15; this is torch 2\.12\.1.*"
                                            r"DGPIPE_UNTESTED_TORCH=1"):
        assert not check_torch_version("2.12.1+cu126")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_torch_version("2.13.0+cpu") and check_torch_version("2.14.1") and check_torch_version("2.15.0")
        monkeypatch.setenv(UNTESTED_TORCH_ENV, "1")
        assert not check_torch_version("2.16.0")


def test_tied_parameters_on_a_rank_of_several_stages_are_refused():
    """Stages 0 and 3 share a weight on ranks 0 and 1, which hold two stages each: torch's multi-stage schedules
    call no end-of-step hook, so the stage refuses to own the sum and says what to call instead."""
    shared = nn.Linear(4, 4)
    stages = [shared, nn.Linear(4, 4), nn.Linear(4, 4), nn.Sequential(shared)]
    tied = TiedParameters(stages, [0, 1, 0, 1], 0)
    assert [ranks for ranks, _ in tied.shared] == [(0, 1), (0, 1)]  # weight and bias
    with pytest.raises(ValueError, match=r"stage 0: tied parameters across ranks, and this rank holds 2 stages.*"
                                         r"call tied.sum_gradients\(\) after each schedule.step"):
        CompressedPipelineStage(stages[0], 0, 4, torch.device("cpu"), tied=tied)


class _FailingDecode(Codec):
    """The ``none`` codec's payloads, but decoding raises: a peer that fails mid-schedule."""

    name, codec_id = "none", get_codec("none").codec_id

    def encode(self, x):
        return get_codec("none").encode(x)

    def decode(self, payload):
        raise ValueError("decoder broke on purpose")


def _one_failing_rank(rank: int, world_size: int) -> None:
    _train(rank, world_size, "1f1b", act_codec=_FailingDecode, grad_codec="none")


def test_a_rank_that_fails_mid_schedule_ends_every_rank_with_its_error():
    """Rank 1 fails decoding its first activation while rank 0 waits for its gradient: the
    launcher ends both and names rank 1 and its error, well before the process-group timeout."""
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank 1 failed: ValueError: stage 1: corrupt forward message from rank 0 "
                                         r"\(micro-batch 0\): decoder broke on purpose"):
        spawn(_one_failing_rank, 2, timeout=300, start_method="fork")
    assert time.monotonic() - start < 300  # the peer's failure, not the process group's timeout, ended it


QUANT8 = type(get_codec("quant", bits=8))


class _Lying(QUANT8):
    """8-bit payloads whose header lies in one field (``lie``), at the honest message's size."""

    lie = ""

    def __init__(self) -> None:
        super().__init__(bits=8)

    def encode(self, x):
        payload = super().encode(x)
        header = payload.header.clone()  # [MAGIC, codec id, dtype code, ndim, *shape, ...]
        if self.lie == "codec":
            header[1] = get_codec("sortquant").codec_id
        elif self.lie == "dtype":
            header[2] = int(get_codec("none").encode(torch.zeros(1, dtype=torch.float16)).header[2])
        else:  # the same number of values in another shape
            header[4], header[5] = header[4] * 2, header[5] // 2
        return type(payload)(header, payload.tensors)


class _NeverDecodes(QUANT8):
    """The receiving side's 8-bit codec: reaching its decode means a refused frame was decoded."""

    def __init__(self) -> None:
        super().__init__(bits=8)

    def decode(self, payload):
        raise AssertionError("a refused frame was decoded")


def _lying_sender(rank: int, world_size: int, lie: str) -> None:
    lying = type("Lying", (_Lying,), {"lie": lie})
    _train(rank, world_size, "1f1b", act_codec=lying if rank == 0 else _NeverDecodes, grad_codec="none")


@pytest.mark.parametrize("lie, field", [
    ("shape", r"its header declares a torch.float32 \(4, 16\) tensor, torch's buffer is torch.float32 \(2, 32\)"),
    ("dtype", r"its header declares a torch.float16 \(2, 32\) tensor, torch's buffer is torch.float32 \(2, 32\)"),
    ("codec", r"corrupt header: .*codec"),
])
def test_a_lying_frame_is_refused_before_it_is_decoded(lie, field):
    """Rank 0's stage sends activations whose header lies about their shape, dtype or codec inside the
    fixed-size buffer torch receives into: rank 1 refuses the first one without decoding it, naming the
    stage, the peer and the field, and the launcher ends both ranks."""
    with pytest.raises(SpawnError, match=r"rank 1 failed: ValueError: stage 1: corrupt forward message from rank 0 "
                                         r"\(micro-batch 0\): " + field):
        spawn(_lying_sender, 2, args=(lie,), timeout=300, start_method="fork")


class _Honest(QUANT8):
    def __init__(self) -> None:
        super().__init__(bits=8)


def _truncating_sender(rank: int, world_size: int) -> None:
    """Rank 0 puts every coded message on the wire 8 bytes short of its size (torch's receive completes)."""
    if rank == 0:
        import dgpipe.comm.link as link

        honest = link.pack_message

        def short(*args, **kwargs):
            buf, total = honest(*args, **kwargs)
            return buf[:-8], total

        link.pack_message = short
    _train(rank, world_size, "1f1b", act_codec=_Honest if rank == 0 else _NeverDecodes, grad_codec="none")


def test_a_truncated_frame_is_refused_before_it_is_decoded():
    """Inside torch's schedules the receive buffer is the size the shape implies; a message cut short leaves its
    closing word zero, and rank 1 refuses it without decoding, naming the stage and the peer."""
    with pytest.raises(SpawnError, match=r"rank 1 failed: ValueError: stage 1: corrupt forward message from rank 0 "
                                         r"\(micro-batch 0\): corrupt message from rank 0: truncated"):
        spawn(_truncating_sender, 2, timeout=300, start_method="fork")


def _one_stalled_rank(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(120)  # alive but silent: never posts its receives
    _train(rank, world_size, "1f1b", act_codec="none", grad_codec="none")


def test_a_stalled_peer_ends_the_waiting_rank_at_the_process_group_timeout():
    """Rank 1 stalls before its first step: rank 0's sends time out after the process group's
    timeout (3 s here) and the launcher ends both, naming rank 0 -- long before rank 1 wakes."""
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank 0 failed: .*[Tt]imed? ?out"):
        spawn(_one_stalled_rank, 2, timeout=3, start_method="fork")
    assert time.monotonic() - start < 120
