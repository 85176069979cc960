"""The timeline of one GPipe step on a link with a rate and a latency: a model of the step time.

A training step of dgpipe's runtime is a fixed set of tasks (:func:`~dgpipe.pipeline.schedule.gpipe_tasks`:
each rank runs its forward tasks segment by segment, then its backward tasks in reverse) tied together by
messages: the forward of segment ``s`` (``s`` not the last) sends its micro-batch's activations to segment
``s + 1``, the backward of segment ``s > 0`` sends the gradients back to segment ``s - 1``. A task starts
when its rank is free and its message has arrived. :func:`simulate_step` plays that out:

- a task takes its measured compute seconds (:class:`StepProfile`: the mean over the run of that segment's
  forward or backward per micro-batch, wall time less the time its rank was blocked in a receive);
- a message is held back by the one-way ``latency`` (what ``--link-delay`` does, and what a wide-area link
  does), then takes ``bytes x 8 / rate`` on its link; a link is one direction between two ranks (a full-duplex
  path, as two ``tc tbf`` queues shape it), and the messages on one link queue behind each other in the
  order their sender posted them;
- the step ends when every rank has run its tasks and every message has arrived.

This is list scheduling of a task graph with communication delays (as in the analyses of pipeline
schedules, e.g. Narayanan et al., "PipeDream", SOSP 2019, and Huang et al., "GPipe", NeurIPS 2019), with each
rank's task order fixed by the runtime. It gives the latency the order of the tasks puts on a step's
critical path -- two round trips of every link for client/server ``[0, 1, 0]``, one latency per boundary
each way on a linear partition -- and how much of a message's transfer hides behind compute. It does not
model processor sharing (ranks that share cores: their measured compute already holds that run's
contention) nor TCP's own dynamics (on a link busy both ways the acknowledgements of one direction queue
behind the data of the other); ``rate`` is the payload's, which :func:`dgpipe.train.compare.project` takes
as the line rate less the headers of every segment (:data:`dgpipe.train.compare.TCP_FRAMING`).

:mod:`dgpipe.train.compare` projects a run measured on loopback onto a link with it: measured seconds per step
``+ simulate_step(link) - simulate_step(loopback)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from .schedule import Segment, gpipe_tasks

__all__ = ["StepProfile", "simulate_step"]


@dataclass(frozen=True)
class StepProfile:
    """What the timeline of one training step needs, measured over a run.

    Attributes:
        ranks: the rank of each segment (maximal run of stages on one rank), in stage order; ``S`` segments.
        micro: micro-batches per step (M).
        forward, backward: seconds of one micro-batch's forward / backward task of each segment (``S`` floats;
            wall time less the time blocked in receives).
        forward_bytes: bytes of one forward message over each segment boundary (``S - 1`` floats; payloads and
            framing, as on the wire); ``backward_bytes``: the same for the gradients coming back.
    """

    ranks: tuple[int, ...]
    micro: int
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    forward_bytes: tuple[float, ...]
    backward_bytes: tuple[float, ...]

    def __post_init__(self) -> None:
        s = len(self.ranks)
        if s < 1 or self.micro < 1:
            raise ValueError(f"a step profile needs >= 1 segment and >= 1 micro-batch, got {s} and {self.micro}")
        if len(self.forward) != s or len(self.backward) != s:
            raise ValueError(f"{s} segments need {s} forward and backward seconds, got {len(self.forward)} and "
                             f"{len(self.backward)}")
        if len(self.forward_bytes) != s - 1 or len(self.backward_bytes) != s - 1:
            raise ValueError(f"{s} segments have {s - 1} boundaries, got {len(self.forward_bytes)} forward and "
                             f"{len(self.backward_bytes)} backward byte counts")
        if any(a == b for a, b in zip(self.ranks, self.ranks[1:])):
            raise ValueError(f"consecutive segments on one rank: {self.ranks} (segments are maximal)")
        if any(not (v >= 0 and math.isfinite(v)) for v in (*self.forward, *self.backward, *self.forward_bytes,
                                                            *self.backward_bytes)):
            raise ValueError("step profile seconds and bytes must be finite and >= 0")

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (the ``profile`` field of an epoch record)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "StepProfile":
        """The inverse of :meth:`to_json`. Raises ``ValueError`` on a malformed profile."""
        try:
            return cls(tuple(int(r) for r in d["ranks"]), int(d["micro"]), tuple(map(float, d["forward"])),
                       tuple(map(float, d["backward"])), tuple(map(float, d["forward_bytes"])),
                       tuple(map(float, d["backward_bytes"])))
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed step profile {dict(d)!r}: {err}") from None


def simulate_step(profile: StepProfile, rate: float = math.inf, latency: float = 0.0) -> float:
    """Seconds one GPipe training step of dgpipe's runtime takes on a link (module docstring).

    Args:
        profile: the measured tasks and messages.
        rate: bits per second of every link (``inf``: transfers take no time).
        latency: one-way seconds every message is held back before its transfer.

    Returns:
        The step's makespan in seconds: from every rank starting at 0 to the last task's end or the last
        message's arrival, whichever is later.

    Raises:
        ValueError: ``rate <= 0`` or ``latency < 0``.
    """
    if not rate > 0 or not latency >= 0:
        raise ValueError(f"need rate > 0 bits/s and latency >= 0 s, got {rate!r} and {latency!r}")
    segs = [Segment(i, r, i, i) for i, r in enumerate(profile.ranks)]
    last = len(segs) - 1
    todo = {r: gpipe_tasks(segs, r, profile.micro, backward=True) for r in sorted(set(profile.ranks))}
    free = dict.fromkeys(todo, 0.0)
    link_free: dict[tuple[int, int], float] = {}
    arrived: dict[tuple[str, int, int], float] = {}  # (phase, micro, receiving segment) -> seconds

    def post(phase: str, micro: int, to: int, sent: float, nbytes: float) -> None:
        link = (profile.ranks[to + (1 if phase == "backward" else -1)], profile.ranks[to])
        start = max(sent + latency, link_free.get(link, 0.0))
        link_free[link] = arrived[(phase, micro, to)] = start + 8 * nbytes / rate

    while any(todo.values()):
        progressed = False
        for rank, tasks in todo.items():
            while tasks:
                t = tasks[0]
                forward = t.phase == "forward"
                waits = t.segment > 0 if forward else t.segment < last
                key = (t.phase, t.micro, t.segment)
                if waits and key not in arrived:
                    break
                done = max(free[rank], arrived.get(key, 0.0)) + (
                    profile.forward if forward else profile.backward)[t.segment]
                free[rank] = done
                if forward and t.segment < last:
                    post("forward", t.micro, t.segment + 1, done, profile.forward_bytes[t.segment])
                elif not forward and t.segment > 0:
                    post("backward", t.micro, t.segment - 1, done, profile.backward_bytes[t.segment - 1])
                tasks.pop(0)
                progressed = True
        if not progressed:  # cannot happen with gpipe_tasks' order; guards a schedule change
            raise RuntimeError(f"the step's tasks wait on each other: {todo}")
    return max([*free.values(), *arrived.values()])
