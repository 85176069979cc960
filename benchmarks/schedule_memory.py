"""Peak activation memory and samples/s per rank: dgpipe's GPipe runtime vs torch's GPipe and 1F1B
schedules, uncompressed and with 8-bit and 4-bit boundary codecs, on gloo ranks of one machine.

Same model (an MLP of ``--layers`` Linear+ReLU blocks and a head), cut into as many equal
stages as ranks, stage i on rank i, ``--chunks`` micro-batches; measured side by side in one
run (rounds interleave the contenders; medians over rounds):

- ``dgpipe GPipe``: :class:`dgpipe.pipeline.Pipeline` with ``act_codec``/``grad_codec``;
- ``torch GPipe`` and ``torch 1F1B``: ``ScheduleGPipe`` / ``Schedule1F1B`` over torch's
  ``PipelineStage`` (uncompressed) or :class:`dgpipe.pipelining.CompressedPipelineStage`.

**Peak activation memory** is the largest sum, during a step, of the bytes of the tensors
autograd saved for backward and has not yet freed (counted through
``torch.autograd.graph.saved_tensors_hooks``; parameters left out): what a schedule makes
a rank hold. GPipe holds all ``M`` micro-batches' activations before the first backward;
1F1B holds at most ``min(M, S - r)`` on rank ``r`` of ``S`` stages (Narayanan et al.,
"Memory-Efficient Pipeline-Parallel DNN Training", 2021). Printed per rank: peak MiB, the
1F1B/GPipe ratio and the ratio that rule predicts.

With ``--rate 100mbit`` (root: network namespaces and ``tc``, ``bandwidth/slow_link.py``) it
measures instead what compression buys torch's 1F1B on a real shaped link: 2 ranks, torch
1F1B uncompressed and with each codec, first on loopback and then across the link, in one
run. Printed: samples/s on each, the speedup over uncompressed 1F1B on the link, and the
ideal speedup of a model that gives compression for free and no overlap: a step takes the
uncompressed loopback step plus, per micro-batch, one activation and one gradient message
at the one-way time measured for that size on the link (ping-pong after the timed steps),
``ideal = T(uncompressed) / T(codec)``; ``model`` is the measured uncompressed link step
over that prediction.

Usage: ``python benchmarks/schedule_memory.py [--world 2 4] [--width 512 --layers 8 --batch 256 --chunks 8]``
(a few minutes on 2 cores); ``python benchmarks/schedule_memory.py --rate 100mbit --width 256 --batch 1024``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from dgpipe.comm.probe import pingpong_seconds
from dgpipe.comm.slow_link import parse_rate
from dgpipe.pipeline import Pipeline, init_distributed, spawn, split_layers
from dgpipe.pipelining import CompressedPipelineStage
from pipeline_throughput import make_layers  # the same MLP as the throughput benchmark (this folder)

SLOW_LINK = Path(__file__).resolve().parents[1] / "bandwidth" / "slow_link.py"
CODECS = {"uncompressed": None, "quant 8": ("quant", {"bits": 8}), "quant 4": ("quant", {"bits": 4})}


class SavedBytes:
    """Live and peak bytes of the tensors autograd saves for backward (parameters left out)."""

    def __init__(self, params) -> None:
        self.params = {p.data_ptr() for p in params}
        self.live = self.peak = 0

    class _Held:
        def __init__(self, tensor: torch.Tensor, owner: "SavedBytes") -> None:
            self.tensor, self.owner = tensor, owner
            self.nbytes = tensor.numel() * tensor.element_size()
            owner.live += self.nbytes
            owner.peak = max(owner.peak, owner.live)

        def __del__(self) -> None:
            self.owner.live -= self.nbytes

    def pack(self, t: torch.Tensor):
        return t if t.data_ptr() in self.params else SavedBytes._Held(t, self)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, SavedBytes._Held) else held

    def hooks(self):
        self.live = self.peak = 0
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def worker(rank: int, world_size: int, args, out_path: str) -> None:
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    n = 2 * args.layers + 1
    balance = [n // world_size + (i < n % world_size) for i in range(world_size)]
    dev = torch.device("cpu")
    steps, step_bytes = {}, {}
    for label, codec in CODECS.items():
        stages = split_layers(make_layers(args), balance)
        if not args.rate:
            pipe = Pipeline(stages, list(range(world_size)), chunks=args.chunks, loss_fn=F.cross_entropy,
                            act_codec=codec or "none", grad_codec=codec or "none")
            steps[f"dgpipe GPipe, {label}"] = (lambda p=pipe: p.train_step(x, y), list(pipe.parameters()))
        schedules = (("torch 1F1B", Schedule1F1B),) if args.rate else (("torch GPipe", ScheduleGPipe),
                                                                      ("torch 1F1B", Schedule1F1B))
        for name, schedule in schedules:
            part = split_layers(make_layers(args), balance)[rank]
            stage = (PipelineStage(part, rank, world_size, dev) if codec is None else
                     CompressedPipelineStage(part, rank, world_size, dev, act_codec=codec, grad_codec=codec))
            sched = schedule(stage, args.chunks, loss_fn=F.cross_entropy)

            def step(s=sched) -> None:
                if rank == 0:
                    s.step(x)
                elif rank == world_size - 1:
                    s.step(target=y)
                else:
                    s.step()
            steps[f"{name}, {label}"] = (step, list(part.parameters()))
            shape = (args.batch // args.chunks, args.width)
            step_bytes[f"{name}, {label}"] = (shape[0] * shape[1] * 4 if codec is None else
                                              stage.message_nbytes("forward", shape, torch.float32))
    results = {k: {"seconds": [], "peak": 0, "message_bytes": step_bytes.get(k, 0)} for k in steps}
    for _ in range(args.rounds):
        for key, (step, params) in steps.items():
            meter = SavedBytes(params)
            with meter.hooks():
                step()  # warm-up (and the first step's shape inference)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                for p in params:
                    p.grad = None
                with meter.hooks():
                    step()
                results[key]["peak"] = max(results[key]["peak"], meter.peak)
            dist.barrier()
            results[key]["seconds"].append((time.perf_counter() - start) / args.steps)
    if args.rate:  # one-way seconds of each message size on this link (or loopback)
        sizes = sorted({r["message_bytes"] for r in results.values()})
        seconds = pingpong_seconds(sizes, repeats=5, warmup=1)
        if rank == 0:
            for r in results.values():
                r["message_seconds"] = seconds[sizes.index(r["message_bytes"])]
    Path(f"{out_path}.{rank}").write_text(json.dumps(results))


def report(world: int, args, out_path: str) -> None:
    ranks = [json.loads(Path(f"{out_path}.{r}").read_text()) for r in range(world)]
    print(f"\n{world} ranks, {args.layers} blocks of width {args.width}, batch {args.batch} in {args.chunks} "
          f"micro-batches; peak saved-activation MiB per rank; samples/s (rank 0's median step)")
    print("| contender | " + " | ".join(f"rank {r} MiB" for r in range(world)) + " | samples/s |")
    print("|---|" + "---|" * (world + 1))
    for key in ranks[0]:
        peaks = " | ".join(f"{ranks[r][key]['peak'] / 2**20:.1f}" for r in range(world))
        print(f"| {key} | {peaks} | {args.batch / statistics.median(ranks[0][key]['seconds']):.0f} |")
    for label in CODECS:
        ratios = [ranks[r][f"torch 1F1B, {label}"]["peak"] / ranks[r][f"torch GPipe, {label}"]["peak"]
                  for r in range(world)]
        predicted = [min(args.chunks, world - r) / args.chunks for r in range(world)]
        print(f"1F1B / GPipe peak, {label}: " + ", ".join(f"rank {r} {m:.2f} (predicted {p:.2f})"
                                                          for r, (m, p) in enumerate(zip(ratios, predicted))))


def report_link(args, loopback: str, link: str) -> None:
    """samples/s on loopback and on the link, speedups over uncompressed 1F1B, and the ideal."""
    loop, shaped = json.loads(Path(f"{loopback}.0").read_text()), json.loads(Path(f"{link}.0").read_text())
    base = "torch 1F1B, uncompressed"

    def seconds(res, key):
        return statistics.median(res[key]["seconds"])

    def predicted(key):  # compression for free, no overlap of messages and compute
        return seconds(loop, base) + 2 * args.chunks * shaped[key]["message_seconds"]

    print(f"\ntorch 1F1B on 2 ranks across a {args.rate} link ({args.layers} blocks of width {args.width}, batch "
          f"{args.batch} in {args.chunks} micro-batches); medians of {args.rounds} rounds")
    print("| codec | message bytes | link ms/message | loopback samples/s | link samples/s | speedup | ideal |")
    print("|---|---|---|---|---|---|---|")
    for key in loop:
        print(f"| {key.split(', ')[1]} | {shaped[key]['message_bytes']} | {1e3 * shaped[key]['message_seconds']:.2f} "
              f"| {args.batch / seconds(loop, key):.0f} | {args.batch / seconds(shaped, key):.0f} "
              f"| {seconds(shaped, base) / seconds(shaped, key):.2f} | {predicted(base) / predicted(key):.2f} |")
    print(f"model: the uncompressed step took {seconds(shaped, base) / predicted(base):.2f}x its prediction")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4], help="rank counts to run")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8, help="micro-batches")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--rate", help="torch 1F1B across a shaped link of this rate, tc syntax (e.g. 100mbit; root)")
    ap.add_argument("--out", help=argparse.SUPPRESS)  # results path of the ranks the link runner starts
    args = ap.parse_args(argv)
    if "RANK" in os.environ:  # a rank started by bandwidth/slow_link.py
        rank, world = init_distributed("gloo", timeout=600)
        try:
            worker(rank, world, args, args.out)
        finally:
            dist.destroy_process_group()
        return 0
    if args.rate:
        parse_rate(args.rate)
        if os.geteuid() != 0:
            ap.error("--rate needs root (network namespaces and tc)")
    print(f"torch {torch.__version__}; {' '.join([Path(sys.argv[0]).name, *argv])}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.rate:
            loopback, link = str(Path(tmp) / "loopback"), str(Path(tmp) / "link")
            spawn(worker, 2, args=(args, loopback), timeout=600)
            command = [sys.executable, str(Path(__file__).resolve()), *argv, "--out", link]
            status = subprocess.call([sys.executable, str(SLOW_LINK), "--rate", args.rate, "--", *command])
            if status:
                print(f"schedule_memory: the run across the link failed (status {status})", file=sys.stderr)
                return status
            report_link(args, loopback, link)
            return 0
        for world in args.world:
            out = str(Path(tmp) / f"w{world}")
            spawn(worker, world, args=(args, out), timeout=600)
            report(world, args, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
