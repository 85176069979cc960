"""The emulated link latency (``--link-delay``, :class:`~dgpipe.comm.delay.DelayLine`).

Unit: every send is posted no earlier than its deadline, in the order submitted, without blocking the
caller; a failed post reaches the caller. Spawned (gloo, 2 ranks, client/server): a pipeline whose
boundaries hold messages back trains to the same losses and gradients as one without, and a step takes
at least the latency of the four messages on its critical path (a lower bound only, which a loaded
machine cannot break).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dgpipe.comm.delay import DelayLine
from dgpipe.pipeline import BoundarySpec, Pipeline
from helpers import assert_ranks_ok, spawn_checks

DELAY = 0.05


def test_posts_after_the_delay_in_order_without_blocking():
    line = DelayLine(DELAY)
    posted: list[tuple[int, float]] = []
    start = time.monotonic()
    futures = [line.submit(lambda i=i: posted.append((i, time.monotonic())) or [i]) for i in range(3)]
    assert time.monotonic() - start < DELAY  # submit returned at once
    assert [f.result(timeout=30) for f in futures] == [[0], [1], [2]]
    assert [i for i, _ in posted] == [0, 1, 2]
    assert all(t - start >= DELAY for _, t in posted)


def test_a_failed_post_reaches_the_caller():
    def fail():
        raise RuntimeError("link closed")

    with pytest.raises(RuntimeError, match="link closed"):
        DelayLine(0.0).submit(fail).result(timeout=30)
    with pytest.raises(ValueError, match="must be >= 0"):
        DelayLine(-1.0)


def _model():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 3)]


def check_same_training_and_latency_bound(rank: int) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    results = []
    for delay in (0.0, DELAY):
        stages = _model()
        pipe = Pipeline(stages, [0, 1, 0], chunks=4, loss_fn=F.cross_entropy,
                        boundary=BoundarySpec(link_delay=delay))
        pipe.train_step(x, y)  # warm up the streams
        for p in pipe.parameters():
            p.grad = None
        start = time.monotonic()
        loss = pipe.train_step(x, y)
        results.append((time.monotonic() - start, loss, [p.grad.clone() for p in pipe.parameters()]))
    (_, loss0, grads0), (seconds, loss1, grads1) = results
    assert loss0 == loss1 and all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    if rank == 0:  # the client's step waits for client -> server -> client, forward and back
        assert seconds >= 4 * DELAY, seconds


def test_pipeline_with_a_link_delay(tmp_path):
    out = spawn_checks({"delay": check_same_training_and_latency_bound}, 2, tmp_path)
    assert_ranks_ok(out, "delay", 2)
