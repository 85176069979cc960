"""``dgpipe-probe`` (``bandwidth/probe_link.py``): probe a link between two ranks -- one-way
time and MB/s per message size, and a ``seconds = latency + bytes / bandwidth`` fit.

Local (spawns two processes on 127.0.0.1)::

    dgpipe-probe [--min-size 1K] [--max-size 64M] [--factor 4] [--repeats 5] [--warmup 2] [--min-time 0.2]

Two machines or a slow link (torchrun-style env vars RANK, WORLD_SIZE=2, MASTER_ADDR,
MASTER_PORT are set, so it joins with ``env://``)::

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:PORT ... bandwidth/probe_link.py
    python bandwidth/slow_link.py --rate 100mbit -- dgpipe-probe

Timing is ping-pong over gloo (see ``dgpipe.comm.probe``): one-way seconds = half the
round trip; per size the median of at least ``--repeats`` round trips and at least
``--min-time`` seconds of them. Rank 0 prints the table and the fit.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch.distributed as dist

from dgpipe.comm.probe import fit_latency_bandwidth, pingpong_seconds
from dgpipe.pipeline.launch import SpawnError, init_distributed, spawn
from dgpipe.cli import entry_point
from dgpipe.train.flags import HelpFormatter, JobParser

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'1K' -> 1024, '64M' -> 67108864, '4096' -> 4096 (binary suffixes K, M, G)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 1K, 64M or 4096")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def message_sizes(min_size: int, max_size: int, factor: int) -> list[int]:
    """Geometric sizes min_size, min_size*factor, ... up to and including max_size."""
    if factor < 2 or min_size > max_size:
        raise ValueError(f"need factor >= 2 and min size <= max size, got factor {factor}, "
                         f"sizes {min_size}..{max_size}")
    sizes = [min_size]
    while sizes[-1] * factor <= max_size:
        sizes.append(sizes[-1] * factor)
    return sizes


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def report(sizes: list[int], seconds: list[float], how: str) -> str:
    """The printed table plus the latency/bandwidth fit and a linearity verdict."""
    fit = fit_latency_bandwidth(sizes, seconds)
    lines = [f"probe: {how}; one-way seconds = round trip / 2",
             f"{'size':>10} {'median s':>12} {'MB/s':>10} {'fit s':>12} {'resid':>8}"]
    for size, t, rel in zip(sizes, seconds, fit.rel_residuals):
        fitted = fit.latency_s + size / fit.bandwidth_Bps
        lines.append(f"{human(size):>10} {t:12.6f} {size / t / 1e6:10.2f} {fitted:12.6f} "
                     f"{rel:+8.1%}")
    worst = max(abs(r) for r in fit.rel_residuals)
    off = [human(size) for size, rel in zip(sizes, fit.rel_residuals) if abs(rel) > 0.25]
    lines.append(f"fit: latency {fit.latency_s * 1e6:.1f} us, bandwidth "
                 f"{fit.bandwidth_Bps / 1e6:.2f} MB/s ({fit.bandwidth_Bps * 8 / 1e6:.1f} Mbit/s), "
                 f"R^2 {fit.r2:.4f}, max |relative residual| {worst:.1%}")
    if fit.r2 >= 0.99 and not off:
        verdict = "yes (R^2 >= 0.99, every size within 25% of the line)"
    else:
        verdict = (f"no (R^2 {fit.r2:.4f}; more than 25% off the line: "
                   f"{', '.join(off) or 'none'})")
    lines.append("time grows linearly with size: " + verdict)
    return "\n".join(lines)


def run_rank(rank: int, world_size: int, args: argparse.Namespace, how: str) -> None:
    """Body of one rank once torch.distributed is initialised; rank 0 prints."""
    sizes = message_sizes(args.min_size, args.max_size, args.factor)
    seconds = pingpong_seconds(sizes, repeats=args.repeats, warmup=args.warmup,
                               min_time_s=args.min_time)
    if seconds is not None:
        print(report(sizes, seconds, f"{how}; median of >= {args.repeats} round trips "
                                     f"and >= {args.min_time:g} s per size"), flush=True)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The probe's flags (one-line argument errors, each default shown once)."""
    parser = JobParser(prog=prog, description="Probe the link between two ranks: one-way time and MB/s per message "
                                              "size, and a seconds = latency + bytes / bandwidth fit.",
                       formatter_class=HelpFormatter,
                       epilog="example: %(prog)s --max-size 16M   (two local processes; see the module doc for "
                              "two machines and a shaped link)")
    parser.add_argument("--min-size", type=parse_size, default="1K",
                        help="smallest message, bytes (K/M/G suffixes)")
    parser.add_argument("--max-size", type=parse_size, default="64M", help="largest message, bytes")
    parser.add_argument("--factor", type=int, default=4, help="size step factor")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed round trips per size; the median is printed")
    parser.add_argument("--warmup", type=int, default=2, help="untimed round trips per size")
    parser.add_argument("--min-time", type=float, default=0.2,
                        help="time each size for at least this many seconds in all, up to 1000 round trips")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before a stalled peer ends the run")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse (one-line errors, exit status 2), probe, print; returns 0, or 1 when a rank failed."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        message_sizes(args.min_size, args.max_size, args.factor)
        if not (1 <= args.repeats <= 1000) or args.warmup < 0 or args.min_time < 0 \
                or args.timeout <= 0:
            raise ValueError("need 1 <= --repeats <= 1000, --warmup >= 0, --min-time >= 0 "
                             "and --timeout > 0")
    except ValueError as err:
        parser.error(str(err))

    if "RANK" in os.environ:  # launched by torchrun or bandwidth/slow_link.py
        if os.environ.get("WORLD_SIZE") != "2":
            parser.error(f"the probe needs WORLD_SIZE=2, got {os.environ.get('WORLD_SIZE')}")
        rank, world_size = init_distributed(backend="gloo", timeout=args.timeout)
        try:
            run_rank(rank, world_size, args, "2 ranks, gloo via env:// (MASTER_ADDR "
                                             f"{os.environ['MASTER_ADDR']})")
        finally:
            dist.destroy_process_group()
        return 0
    try:
        spawn(run_rank, world_size=2, args=(args, "2 local processes, gloo over 127.0.0.1"),
              backend="gloo", timeout=args.timeout)
    except SpawnError as err:
        print(f"probe failed: {err}", file=sys.stderr)
        return 1
    return 0


#: The ``dgpipe-probe`` console script.
console = entry_point(main)
