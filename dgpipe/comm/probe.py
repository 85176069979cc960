"""Link probe: time messages between two ranks and fit ``seconds = latency + bytes / bandwidth``.

Timing is **ping-pong**: rank 0 sends ``n`` bytes to rank 1, rank 1 sends the same bytes
back, and rank 0 takes half the round trip as the one-way time of an ``n``-byte message.
One clock measures both ends of the interval, so no clock synchronisation or barrier
is needed (a one-way timing would need both); on a symmetric link (``SlowLink`` shapes
both directions alike) half the round trip is the one-way time.

The fit is the classic latency/bandwidth ("alpha-beta", Hockney) model of a
point-to-point message, solved by weighted least squares with the variance of a
timing taken proportional to the time itself (a message is a train of packets, each
with independent jitter). Plain least squares would let the largest message decide
everything, latency included (its noise dwarfs a microsecond latency); weighting by
relative error would let small messages in a shaper's burst allowance (a ``tbf``
bucket passes its first kilobytes at line rate) drag the bandwidth far off.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import nnls

__all__ = ["LinkFit", "fit_latency_bandwidth", "pingpong_seconds"]


class LinkFit(NamedTuple):
    """Result of :func:`fit_latency_bandwidth`.

    latency_s: fitted fixed cost per message, seconds (>= 0).
    bandwidth_Bps: fitted bandwidth, bytes per second (``inf`` if time does not grow
        with size at all).
    r2: coefficient of determination of the weighted fit; close to 1 when time grows
        linearly with size.
    rel_residuals: per message ``(fitted - measured) / measured``, in input order.
    """

    latency_s: float
    bandwidth_Bps: float
    r2: float
    rel_residuals: tuple[float, ...]


def fit_latency_bandwidth(sizes_bytes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Fit ``seconds = latency_s + sizes_bytes / bandwidth_Bps`` by least squares.

    Minimises ``sum((latency + size / bandwidth - t) ** 2 / t)`` (weights ``1 / t``:
    timing variance proportional to time) subject to ``latency >= 0`` and
    ``1 / bandwidth >= 0`` (non-negative least squares, ``scipy.optimize.nnls``).
    Model: Hockney, "The communication challenge for MPP", Parallel Computing 20(3),
    1994.

    Args:
        sizes_bytes: message sizes in bytes, > 0, at least two distinct values.
        seconds: measured times in seconds, finite and > 0, same length.

    Returns:
        LinkFit(latency_s, bandwidth_Bps, r2, rel_residuals).

    Raises:
        ValueError: lengths differ, fewer than two distinct sizes, or a size or time
            that is not finite and positive.
    """
    x = np.asarray(sizes_bytes, dtype=np.float64).ravel()
    t = np.asarray(seconds, dtype=np.float64).ravel()
    if x.shape != t.shape:
        raise ValueError(f"got {x.size} sizes but {t.size} times; pass one time per size")
    if not (np.all(np.isfinite(x)) and np.all(x > 0)):
        raise ValueError("message sizes must be finite and > 0 bytes")
    if not (np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ValueError("times must be finite and > 0 seconds")
    if np.unique(x).size < 2:
        raise ValueError("need at least two distinct message sizes to separate "
                         "latency from bandwidth")
    w = 1.0 / t  # weight of a squared residual
    s = np.sqrt(w)
    (latency, inv_bw), _ = nnls(np.stack([s, x * s], axis=1), t * s)
    fitted = latency + x * inv_bw
    # R^2 in the weighted space: weighted residual vs total sum of squares.
    mean_w = np.sum(w * t) / np.sum(w)
    total = float(np.sum(w * (t - mean_w) ** 2))
    r2 = 1.0 - float(np.sum(w * (fitted - t) ** 2)) / total if total > 0 else 1.0
    rel = (fitted - t) / t
    bandwidth = 1.0 / inv_bw if inv_bw > 0 else float("inf")
    return LinkFit(float(latency), float(bandwidth), r2, tuple(float(r) for r in rel))


def pingpong_seconds(sizes_bytes: Sequence[int], repeats: int = 5, warmup: int = 1,
                     min_time_s: float = 0.0, max_repeats: int = 1000,
                     group: dist.ProcessGroup | None = None) -> list[float] | None:
    """Median one-way seconds per message size, by ping-pong between ranks 0 and 1.

    Call on both ranks of an initialised two-rank process group (gloo; tensors are
    CPU ``torch.uint8`` buffers of the given sizes). Rank 0 sends random bytes, rank 1
    echoes them, rank 0 checks that the echo equals what it sent.

    Args:
        sizes_bytes: message sizes in bytes (each >= 1), same list on both ranks.
        repeats: least number of timed round trips per size (>= 1); the median is
            reported.
        warmup: untimed round trips per size before timing (>= 0).
        min_time_s: keep timing a size until its timed round trips add up to this
            many seconds (more samples for short messages, where noise is largest),
            but at most ``max_repeats`` round trips (>= ``repeats``).
        group: process group of exactly two ranks (default: the world).

    Returns:
        On rank 0 a list of median one-way seconds (half the round trip), one per
        size; on rank 1 ``None``.

    Raises:
        ValueError: bad sizes/repeats/warmup, or a group that is not two ranks.
        RuntimeError: the echo differs from what was sent; the peer failed or timed
            out (raised by torch.distributed).
    """
    sizes = [int(s) for s in sizes_bytes]
    if not sizes or min(sizes) < 1:
        raise ValueError("sizes_bytes must be a non-empty list of sizes >= 1 byte")
    if repeats < 1 or warmup < 0 or min_time_s < 0 or max_repeats < repeats:
        raise ValueError("need repeats >= 1, warmup >= 0, min_time_s >= 0 and "
                         f"max_repeats >= repeats, got {repeats}, {warmup}, {min_time_s}, "
                         f"{max_repeats}")
    if dist.get_world_size(group) != 2:
        raise ValueError(f"the probe needs exactly 2 ranks, got {dist.get_world_size(group)}")
    rank = dist.get_rank(group)
    peer = dist.get_global_rank(group, 1 - rank) if group is not None else 1 - rank
    medians = []
    for size in sizes:
        recv_buf = torch.empty(size, dtype=torch.uint8)
        # flag[0] = 1: one more round trip follows; 0: this size is done. Rank 0 decides
        # (it alone holds the clock), rank 1 follows.
        flag = torch.ones(1, dtype=torch.uint8)
        if rank == 0:
            send_buf = torch.randint(0, 256, (size,), dtype=torch.uint8)
            times: list[float] = []
            for i in itertools.count():
                more = i < warmup or len(times) < repeats or (
                    sum(times) < min_time_s and len(times) < max_repeats)
                flag[0] = int(more)
                dist.send(flag, peer, group=group)
                if not more:
                    break
                start = time.perf_counter()
                dist.send(send_buf, peer, group=group)
                dist.recv(recv_buf, peer, group=group)
                if i >= warmup:
                    times.append((time.perf_counter() - start) / 2)
            if not torch.equal(recv_buf, send_buf):
                raise RuntimeError(f"ping-pong echo of {size} bytes differs from what was sent")
            medians.append(statistics.median(times))
        else:
            while True:
                dist.recv(flag, peer, group=group)
                if not flag[0]:
                    break
                dist.recv(recv_buf, peer, group=group)
                dist.send(recv_buf, peer, group=group)
    return medians if rank == 0 else None
