"""GPipe fill-drain schedule: the order in which one rank runs forward and backward tasks.

GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
Pipeline Parallelism", NeurIPS 2019) splits a mini-batch into M micro-batches, runs
every forward, then every backward in reverse, then one optimizer step. A rank runs
its forward tasks (micro-batch m, segment k) in the order (k, m) -- every micro-batch
of its earliest segment first -- and its backward tasks in exactly the reverse order.
Every task depends only on tasks earlier in that order (the previous segment of the
same micro-batch; in backward, the next one), so with asynchronous sends and blocking
receives no rank ever waits on a task that waits on it.

Why segment by segment rather than by torchgpipe's clock cycles (task (m, k) at clock
m + k): a rank's earlier segment feeds the other ranks, so running all of it first
sends every micro-batch on as early as possible. For a client holding the first and
the last stage (client/server ``[0, 1, 0]``) a step then waits for two round trips of
the link -- 4 one-way latencies -- where clock order, which runs the last stage of
micro-batch m before the first stage of micro-batch m + 2, waits for up to 8 with 4
micro-batches (:func:`dgpipe.pipeline.timeline.simulate_step`); on a rank with one
segment the two orders are the same.

A *segment* is a maximal run of consecutive stages held by one rank: nothing
crosses the wire inside it, so it runs as one unit. Client/server ``[0, 1, 0]`` has
three segments; ``[0, 0, 1]`` has two.

Pure functions and :class:`StepState` (what a rank tracks during a step), no torch.distributed: the runtime
(:mod:`dgpipe.pipeline.runtime`) executes the tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Segment", "Task", "StepState", "segments", "gpipe_tasks", "bubble_fraction"]


@dataclass(frozen=True)
class Segment:
    """Consecutive stages ``first..last`` (inclusive) on one rank; ``index`` in the chain."""

    index: int
    rank: int
    first: int
    last: int


@dataclass(frozen=True)
class Task:
    """One unit of work: ``phase`` is ``"forward"`` or ``"backward"``."""

    phase: str
    micro: int
    segment: int


def segments(placement: Sequence[int]) -> list[Segment]:
    """Maximal runs of consecutive stages on the same rank, in stage order.

    Example: ``segments([0, 1, 0])`` -> three segments on ranks 0, 1, 0;
    ``segments([0, 0, 1])`` -> stages 0-1 on rank 0, stage 2 on rank 1.
    """
    out: list[Segment] = []
    for stage, rank in enumerate(placement):
        if out and out[-1].rank == rank:
            prev = out[-1]
            out[-1] = Segment(prev.index, rank, prev.first, stage)
        else:
            out.append(Segment(len(out), rank, stage, stage))
    return out


def gpipe_tasks(segs: Sequence[Segment], rank: int, n_micro: int, backward: bool = True) -> list[Task]:
    """Tasks of ``rank`` in execution order for ``n_micro`` micro-batches.

    Forward tasks sorted by (segment, micro-batch), then -- if ``backward`` -- the
    backward tasks in the reverse of that order (module docstring).
    """
    fwd = [(s.index, m) for s in segs if s.rank == rank for m in range(n_micro)]
    tasks = [Task("forward", m, k) for k, m in fwd]
    if backward:
        tasks += [Task("backward", m, k) for k, m in reversed(fwd)]
    return tasks


def bubble_fraction(n_stages: int, n_micro: int) -> float:
    """Idle fraction of an S-stage GPipe pipeline with M micro-batches: (S-1)/(M+S-1).

    Assumes equal stage times and free communication (GPipe paper, section 2.3).
    """
    if n_stages < 1 or n_micro < 1:
        raise ValueError(f"need n_stages >= 1 and n_micro >= 1, got {n_stages}, {n_micro}")
    return (n_stages - 1) / (n_micro + n_stages - 1)


@dataclass
class StepState:
    """What one rank tracks while it runs one train or eval step's tasks (:class:`~dgpipe.pipeline.Pipeline`)."""

    direction: str  # "forward" (training) or "eval"
    n_micro: int
    inputs: list | None  # micro-batches of the inputs (rank holding stage 0)
    targets: list | None  # micro-batches of the targets (rank holding the last stage)
    keep_outputs: bool
    ids: list | None = None  # micro-batches of the sample ids (rank holding stage 0, delta coding)
    received: dict = field(default_factory=dict)  # (micro, segment) -> (value, leaves, ids), received ahead
    saved: dict = field(default_factory=dict)  # (micro, segment) -> (leaves, loss, outputs needing grad)
    losses: list = field(default_factory=list)  # per micro-batch, detached (last-stage rank)
    loss: float | None = None  # mean over micro-batches: computed or received with the gradients
    outputs: list = field(default_factory=list)
    works: list = field(default_factory=list)  # SendWork handles to wait for at the end
