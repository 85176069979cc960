"""Training throughput: dgpipe's GPipe vs torch.distributed.pipelining, uncompressed, gloo loopback.

Same model (an MLP), same stages, same micro-batches, one machine, measured side by
side in one run (rounds interleave the contenders so that load from other processes
hits them alike; medians over rounds are reported, ratios as the median of the
per-round ratios):

- ``unsplit``: the whole model in one process, micro-batch by micro-batch with
  gradient accumulation (what a pipeline of S stages can at best make S times faster);
- linear placement, 2 ranks: dgpipe ``Pipeline`` vs PyTorch's ``ScheduleGPipe``;
- client/server, 2 ranks: dgpipe's ``[0, 1, 0]`` (3 stages; rank 0 holds the first and
  last quarter of the layers, rank 1 the middle half) vs PyTorch's V-shaped
  ``ScheduleZBVZeroBubble`` with 4 stages, rank 0 holding the first and last, its
  nearest equivalent (PyTorch has no GPipe schedule for a rank holding two stages).

Printed: samples/s, the ratio dgpipe / PyTorch (target >= 0.95 against ScheduleGPipe),
and the bubble fraction predicted by (S-1)/(M+S-1) (S = segments in the chain) next
to the one measured, ``1 - t_unsplit / (R * t_pipeline)`` with R ranks (idle time,
communication and imbalance together).

Usage: ``python benchmarks/pipeline_throughput.py [--width 1024 --layers 8 --batch 256 --chunks 8]``
(a few minutes on 2 cores; each rank uses ``--threads`` intra-op threads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleZBVZeroBubble

from dgpipe.pipeline import Pipeline, bubble_fraction, client_server_placement, spawn, split_layers


def make_layers(args) -> nn.Sequential:
    """``layers`` blocks Linear(width, width)+ReLU, then a Linear head to 10 classes; seeded."""
    torch.manual_seed(0)
    blocks = []
    for _ in range(args.layers):
        blocks += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(args.width, 10))


def make_batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)


def balances(args) -> tuple[list[int], list[int], list[int]]:
    """Layer counts: 2 halves (linear), quarters/half/quarter (client/server), 4 quarters (V)."""
    n = 2 * args.layers + 1
    q = args.layers // 4 * 2  # whole blocks per quarter
    return [n // 2, n - n // 2], [q, n - 2 * q, q], [q, n // 2 - q, n - n // 2 - q, q]


def time_steps(step, steps: int) -> float:
    """Seconds for ``steps`` calls of ``step`` after one warm-up, between barriers."""
    step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, world_size: int, args, out_path: str) -> None:
    torch.set_num_threads(args.threads)
    x, y = make_batch(args)
    lin_bal, cs_bal, v_bal = balances(args)
    dev = torch.device("cpu")

    # dgpipe, linear and client/server
    dg_lin = Pipeline(split_layers(make_layers(args), lin_bal), [0, 1], chunks=args.chunks, loss_fn=F.cross_entropy)
    dg_cs = Pipeline(split_layers(make_layers(args), cs_bal), client_server_placement(), chunks=args.chunks,
                     loss_fn=F.cross_entropy)

    # torch.distributed.pipelining, GPipe and V-shaped
    lin_stages = split_layers(make_layers(args), lin_bal)
    pt_gpipe = ScheduleGPipe(PipelineStage(lin_stages[rank], rank, 2, dev), args.chunks, loss_fn=F.cross_entropy)
    v_stages = split_layers(make_layers(args), v_bal)
    mine = [0, 3] if rank == 0 else [1, 2]
    pt_v = ScheduleZBVZeroBubble([PipelineStage(v_stages[i], i, 4, dev) for i in mine], args.chunks,
                                 loss_fn=F.cross_entropy)

    def zero(mods):
        for m in mods:
            m.zero_grad(set_to_none=True)

    def step_dg(pipe):
        def step():
            zero(pipe.stages.values())
            pipe.train_step(x, y)
        return step

    def step_pt_gpipe():
        zero([lin_stages[rank]])
        if rank == 0:
            pt_gpipe.step(x)
        else:
            pt_gpipe.step(target=y)

    def step_pt_v():
        zero([v_stages[i] for i in mine])
        if rank == 0:
            pt_v.step(x, target=y)
        else:
            pt_v.step()

    contenders = {
        "dgpipe linear": step_dg(dg_lin),
        "torch ScheduleGPipe": step_pt_gpipe,
        "dgpipe client/server": step_dg(dg_cs),
        "torch ScheduleZBVZeroBubble": step_pt_v,
    }
    seconds: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, step in contenders.items():
            seconds[name].append(time_steps(step, args.steps))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(seconds, f)


def unsplit_seconds(args) -> list[float]:
    """Seconds per ``steps`` steps of the unsplit model, micro-batched, in this process."""
    torch.set_num_threads(args.threads)
    model = make_layers(args)
    x, y = make_batch(args)

    def step():
        model.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(args.chunks), y.chunk(args.chunks)):
            (F.cross_entropy(model(xm), ym) / args.chunks).backward()

    out = []
    for _ in range(args.rounds):
        step()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        out.append(time.perf_counter() - start)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks (multiple of 4)")
    p.add_argument("--batch", type=int, default=256, help="mini-batch size")
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per mini-batch (M)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds; medians are reported")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    args = p.parse_args(argv)
    if args.layers % 4 or args.layers < 4:
        p.error("--layers must be a positive multiple of 4")
    if args.batch % args.chunks:
        p.error("--batch must be a multiple of --chunks")

    samples = args.batch * args.steps
    load_before = os.getloadavg()[0]
    t_unsplit = statistics.median(unsplit_seconds(args))
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "seconds.json")
        spawn(worker, 2, args=(args, out_path), timeout=600)
        with open(out_path) as f:
            rounds = json.load(f)
    seconds = {k: statistics.median(v) for k, v in rounds.items()}

    def paired(ours: str, theirs: str) -> float:
        """Median over rounds of theirs/ours time: both ran back to back in each round."""
        return statistics.median(t / o for o, t in zip(rounds[ours], rounds[theirs]))

    print(f"MLP {args.layers}x{args.width}, batch {args.batch}, M={args.chunks} micro-batches, "
          f"{args.threads} thread(s)/process, gloo loopback, {args.rounds} rounds x {args.steps} steps; "
          f"{os.cpu_count()} cores, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'contender':30s} {'samples/s':>10s} {'ranks':>6s} {'bubble pred':>12s} {'bubble meas':>12s}")
    print(f"{'unsplit (1 process)':30s} {samples / t_unsplit:10.1f} {1:6d} {'':>12s} {'':>12s}")
    chain = {"dgpipe linear": 2, "torch ScheduleGPipe": 2, "dgpipe client/server": 3, "torch ScheduleZBVZeroBubble": 4}
    for name, t in seconds.items():
        pred = bubble_fraction(chain[name], args.chunks)
        meas = 1 - t_unsplit / (2 * t)
        print(f"{name:30s} {samples / t:10.1f} {2:6d} {pred:12.3f} {meas:12.3f}")
    gpipe_ratio = paired("dgpipe linear", "torch ScheduleGPipe")
    v_ratio = paired("dgpipe client/server", "torch ScheduleZBVZeroBubble")
    print("throughput ratios, median over rounds of the paired ratio:")
    print(f"dgpipe linear / torch ScheduleGPipe:             {gpipe_ratio:.3f}x (target >= 0.95x)")
    print(f"dgpipe client/server / torch ScheduleZBVZeroBubble: {v_ratio:.3f}x")
    print(f"dgpipe linear / unsplit:                         {t_unsplit / seconds['dgpipe linear']:.3f}x")
    return 0 if gpipe_ratio >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
