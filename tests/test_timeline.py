"""The timeline model of a GPipe step (dgpipe.pipeline.timeline) against step times worked out by hand,
and the task seconds the runtime measures for it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dgpipe.pipeline import Pipeline
from dgpipe.pipeline.timeline import StepProfile, simulate_step


def _profile(ranks, micro, forward, backward, fbytes=None, bbytes=None):
    n = len(ranks) - 1
    return StepProfile(tuple(ranks), micro, tuple(forward), tuple(backward), tuple(fbytes or [0.0] * n),
                       tuple(bbytes or [0.0] * n))


def test_one_micro_batch_is_the_chain_of_tasks_and_messages():
    p = _profile([0, 1], 1, [1.0, 2.0], [3.0, 4.0], [1000.0], [500.0])
    rate, latency = 8000.0, 0.25  # 1000 bytes = 1 s, 500 bytes = 0.5 s
    # F0, latency + transfer, F1, B1, latency + transfer, B0
    assert simulate_step(p, rate, latency) == pytest.approx(1 + 0.25 + 1 + 2 + 3 + 0.25 + 0.5 + 4)
    assert simulate_step(p) == pytest.approx(1 + 2 + 3 + 4)


def test_equal_stages_take_gpipes_clock_count():
    # S stages of equal tasks, free links: (M + S - 1) forward and (M + S - 1) backward clock cycles (GPipe, sec. 2.3)
    for stages, micro in [(4, 4), (3, 8), (2, 1)]:
        p = _profile(range(stages), micro, [1.0] * stages, [2.0] * stages)
        assert simulate_step(p) == pytest.approx((micro + stages - 1) * (1.0 + 2.0))


def test_latency_on_the_critical_path():
    # linear: the first micro-batch's activations cross every boundary, the last one's gradients come back
    for stages in (2, 4):
        p = _profile(range(stages), 4, [0.0] * stages, [0.0] * stages)
        assert simulate_step(p, math.inf, 1.0) == pytest.approx(2 * (stages - 1))
    # client/server [0, 1, 0]: the client sends every micro-batch before it waits, so two round trips
    p = _profile([0, 1, 0], 4, [0.0] * 3, [0.0] * 3)
    assert simulate_step(p, math.inf, 1.0) == pytest.approx(4.0)


def test_messages_on_one_link_queue_behind_each_other():
    # 2 micro-batches; each forward message takes 5 s on the link, the first rank computes 1 s per task
    p = _profile([0, 1], 2, [1.0, 0.0], [0.0, 0.0], [5 * 1000.0], [0.0])
    # F0(0) 0-1, sent 1-6; F0(1) 1-2, queued behind it: 6-11; F1(1) at 11, B1 and B0 free
    assert simulate_step(p, 8000.0, 0.0) == pytest.approx(11.0)
    # messages on the two directions of a link do not queue behind each other
    q = _profile([0, 1], 1, [0.0, 0.0], [0.0, 0.0], [1000.0], [1000.0])
    assert simulate_step(q, 8000.0, 0.0) == pytest.approx(2.0)


def test_compute_hides_transfers():
    # client/server: the server's 4 tasks of 3 s each leave the client's 1 s transfers in their shadow
    p = _profile([0, 1, 0], 4, [0.0, 3.0, 0.0], [0.0, 0.0, 0.0], [1000.0, 1000.0], [0.0, 0.0])
    # first message 0-1, server 1-13 (its later inputs arrive by 4), last answer 13-14
    assert simulate_step(p, 8000.0, 0.0) == pytest.approx(14.0)


def test_profile_is_validated_and_round_trips():
    p = _profile([0, 1, 0], 2, [0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [10.0, 20.0], [30.0, 40.0])
    assert StepProfile.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="2 boundaries"):
        _profile([0, 1, 0], 2, [0.1] * 3, [0.1] * 3, [1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="consecutive segments on one rank"):
        _profile([0, 0], 1, [0.1] * 2, [0.1] * 2)
    with pytest.raises(ValueError, match="finite"):
        _profile([0, 1], 1, [float("nan"), 0.1], [0.1] * 2)
    with pytest.raises(ValueError, match="malformed step profile"):
        StepProfile.from_json({"ranks": [0, 1]})
    with pytest.raises(ValueError, match="rate > 0"):
        simulate_step(p, 0.0)


def test_the_runtime_counts_every_training_task_once():
    torch.manual_seed(0)
    pipe = Pipeline([nn.Linear(8, 8), nn.Linear(8, 2)], [0, 0], chunks=4, loss_fn=nn.functional.cross_entropy)
    for _ in range(3):
        pipe.train_step(torch.randn(8, 8), torch.randint(0, 2, (8,)))
    pipe.eval_step(torch.randn(8, 8))  # evaluation is not counted
    seconds, count = pipe.take_task_seconds()
    assert count.tolist() == [[12.0], [12.0]]  # one segment: 3 steps x 4 micro-batches, forward and backward
    assert (seconds > 0).all()
    assert pipe.take_task_seconds().sum() == 0  # taken: the next call starts from zero
