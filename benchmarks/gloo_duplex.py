"""Does a gloo link carry both directions at once? Side by side in one run between two ranks: a message one
way, the same message both ways at once on one process group (gloo's one TCP connection per pair of
ranks), and both ways at once with each direction on a process group of its own (what dgpipe's pipeline
does: messages to a lower rank take a second group, :class:`dgpipe.pipeline.Pipeline`).

Run it across a shaped link (root; ``bandwidth/slow_link.py`` starts the two ranks)::

    sudo python bandwidth/slow_link.py --rate 10mbit -- python benchmarks/gloo_duplex.py [--mib 1] [--repeats 5]

Prints the median seconds of each case over ``--repeats`` interleaved rounds (after one untimed round) and
their ratios to the one-way time: a full-duplex link moves a message both ways in about the one-way time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _exchange(n: int, both: bool, send_group, recv_group) -> float:
    """Seconds for rank 0 -> 1 (and, if ``both``, 1 -> 0 at the same time) of ``n`` bytes, barrier to barrier."""
    rank = dist.get_rank()
    out, into = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    works = []
    if both or rank == 0:
        works.append(dist.isend(out, 1 - rank, group=send_group))
    if both or rank == 1:
        works.append(dist.irecv(into, 1 - rank, group=recv_group))
    for w in works:
        w.wait()
    dist.barrier()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=1.0, help="message size in MiB")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("gloo_duplex.py needs exactly 2 ranks (run it under bandwidth/slow_link.py)")
    rank, n = dist.get_rank(), int(args.mib * 2**20)
    second = dist.new_group([0, 1])
    up, down = (None, second) if rank == 0 else (second, None)  # rank 0 sends on the default group, rank 1 on the second
    cases = {"one way": (False, None, None), "both ways, one group": (True, None, None),
             "both ways, a group per direction": (True, up, down)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.repeats + 1):
        for name, (both, send_group, recv_group) in cases.items():
            seconds = _exchange(n, both, send_group, recv_group)
            if r:
                times[name].append(seconds)
    if rank == 0:
        base = statistics.median(times["one way"])
        print(f"{args.mib:g} MiB per message, median of {args.repeats} rounds")
        print("| case | seconds | x one way |\n|---|---|---|")
        for name, values in times.items():
            m = statistics.median(values)
            print(f"| {name} | {m:.3f} | {m / base:.2f} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
