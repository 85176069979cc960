"""An emulated one-way link latency for benchmarks on kernels without ``netem`` (``--link-delay``):
:class:`DelayLine` posts every send it is handed a fixed time later, :class:`HeldWork` waits for such a
send. Never on by default."""

from __future__ import annotations

import datetime
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

__all__ = ["DelayLine", "HeldWork"]


class DelayLine:
    """Holds every message back by a one-way latency before it goes on the wire: an emulated link
    latency for benchmarks on kernels without ``netem`` (never on by default).

    One daemon thread posts the sends handed to :meth:`submit` in order, each ``seconds`` after it was
    submitted; the caller does not wait (its compute goes on, as with a real link's latency), and a
    message submitted while another is held back waits only for its own deadline, so messages overlap
    in flight as on a link. The receiver reads a message no earlier than ``seconds`` after it was sent,
    plus the transfer time. This is how ProtocolNanoGPT (Pluralis) simulates a boundary's latency.

    Args:
        seconds: the latency, >= 0.

    Raises:
        ValueError: negative ``seconds``.
    """

    def __init__(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"a link delay must be >= 0 seconds, got {seconds}")
        self.seconds = float(seconds)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dgpipe-delay-line", daemon=True)
        self._thread.start()

    def submit(self, post: Callable[[], list]) -> Future:
        """Run ``post`` (which posts the sends and returns their works) ``seconds`` from now; returns a
        future of its result (or its exception)."""
        future: Future = Future()
        self._queue.put((time.monotonic() + self.seconds, post, future))
        return future

    def _run(self) -> None:
        while True:
            due, post, future = self._queue.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                future.set_result(post())
            except BaseException as err:  # handed to the waiting caller
                future.set_exception(err)


class HeldWork:
    """The works of a send that a :class:`DelayLine` posts later, as one work: ``wait`` waits for the
    posting, then for the works, within one timeout."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def is_completed(self) -> bool:
        """Whether the works were posted and completed, or the posting failed; never blocks."""
        if not self._future.done():
            return False
        return self._future.exception() is not None or all(w.is_completed() for w in self._future.result())

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        start = time.monotonic()
        try:
            works = self._future.result(None if timeout is None else timeout.total_seconds())
        except TimeoutError:
            raise RuntimeError("timed out waiting for a held-back message to be sent") from None
        for work in works:
            if timeout is None:
                work.wait()
            else:
                left = timeout.total_seconds() - (time.monotonic() - start)
                work.wait(timeout=datetime.timedelta(seconds=max(left, 0.001)))
