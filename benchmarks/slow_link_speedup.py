"""Slow-link speedup: MobileNetV2 client/server on CIFAR-10 through a real throttled TCP link.

What compression buys in wall-clock time when the link is the bottleneck. One run
builds a real shaped link on this machine (``bandwidth/slow_link.py``: network
namespace, veth pair, ``tc tbf`` at ``--rate`` each way; needs root), starts the client
(rank 0: the first and last ``--client-layers`` layers, reading real CIFAR-10 images)
on the host and the server (rank 1: the middle) inside the namespace, and then:

1. **probes the link** through the same gloo connection (``dgpipe.comm.probe``:
   ping-pong of 4 sizes up to about half a second of traffic, fit ``seconds =
   latency + bytes / bandwidth``);
2. **measures compute**: each rank times its own stages without any communication,
   per micro-batch -- client front forward ``f1``, client back forward + loss ``f2``,
   client back backward ``b2``, client front backward ``b1``, server forward ``s``
   and backward ``sb`` -- and its optimizer step, both ranks at once (as in a step);
3. **times training steps** for each codec (uncompressed, sortquant 16/12/8/4 bits,
   uniform 8 bits), ``--steps`` steps after ``--warmup`` steps, in ``--rounds``
   interleaved rounds (the settings take turns, so load from other processes hits
   them alike); per setting the median samples/s over rounds, the wire bytes of
   every message (``BandwidthMeter``: payloads with headers, plus framing) and the
   seconds spent in ``encode``/``decode`` on both ranks.

The ideal model (printed next to each measurement). A message of ``n`` bytes occupies
its direction of the (full-duplex) link for ``latency + n / bandwidth`` seconds.
GPipe runs all forwards, then all backwards (a flush between them), so a step is
``T = T_fwd + T_bwd + max(optimizer steps)``. Within a phase, the ``M`` micro-batches
flow through a chain of resources -- forward: client ``f1``, uplink (activation),
server ``s``, downlink (server output), client ``f2``; backward: client ``b2``, uplink
(gradient), server ``sb``, downlink (gradient), client ``b1`` -- and asynchronous sends
let micro-batch m's transfer overlap micro-batch m+1's compute. For identical jobs in
such a flow shop the phase takes ``sum(chain) + (M - 1) * max(bottleneck)``: the first
micro-batch passes through everything (fill and drain), each further one adds the
time of the busiest resource, where the client's two tasks share one CPU
(``max(f1 + f2, uplink, s, downlink)``). The *ideal speedup* of a codec is
``T(uncompressed) / T(codec)`` with the same measured compute and each setting's
measured wire bytes; encoding and decoding are left out (compression for free), so
``efficiency = measured speedup / ideal speedup`` charges the codec's time, as well as
anything else the model ignores (load from other processes, TCP dynamics), to the
implementation. ``model`` is measured / predicted samples/s of the setting itself.
Compute is measured again at the start of every round and each round is predicted
with its own measurement; every column is the median over rounds (speedups: of the
per-round ratios to the uncompressed run of the same round), efficiency is
speedup / ideal of those medians. ``codec % step`` is the larger of the two ranks'
encode + decode seconds per second of wall time (each rank is one timeline; their
sum would count two parallel timelines against one).

Targets: sortquant 8-bit >= 3.5x the uncompressed throughput at 100 Mbit/s,
or >= 85% of the ideal speedup at the chosen rate; encode + decode < 10% of step time.
The exit status is 0 when they are met. The script also prints what the model
predicts at 100 Mbit/s with the measured compute.

Default workload, chosen for a 2-core CPU machine shared with other jobs: 32-px images
(native CIFAR-10), batch 64 in 4 micro-batches, the cut after the stem and before the
classifier (``--client-layers 1``: 16 KiB per image up, 5 KiB down in each phase,
uncompressed), one intra-op thread per rank, ``--rate 8mbit``. Compute is about 7 ms
per image here (6-9 ms with the load of the day), so the uncompressed link time (21.5
kB per image each way, 22 ms at the probed 0.98 MB/s) clearly dominates, 8-bit codes
(5.4 kB, 5.5 ms) bring link and compute about level, and 4-bit codes leave compute the
bottleneck: the benchmark spans link-bound and compute-bound settings, and each
setting takes 5-20 s per round. At 100 Mbit/s the link would take 1.8 ms per image
against 7 ms of compute, so no codec can speed this CPU up by much (see the printed
prediction).

Usage (root; about 3-4 minutes with the defaults on this machine)::

    python benchmarks/slow_link_speedup.py [--rate 8mbit] [--image-size 32] [--batch-size 64]
        [--chunk 4] [--client-layers 1] [--steps 6] [--warmup 1] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dgpipe.comm.probe import fit_latency_bandwidth, pingpong_seconds
from dgpipe.comm.slow_link import parse_rate
from dgpipe.data import find_cifar, make_loader
from dgpipe.models import build_mobilenet, client_server_split, mobilenet_layers
from dgpipe.pipeline import Pipeline, client_server_placement, init_distributed
from dgpipe.train.codecs import SETTINGS

ROOT = Path(__file__).resolve().parent.parent
SLOW_LINK = ROOT / "bandwidth" / "slow_link.py"
#: Codecs compared, in table order (labels of :data:`dgpipe.train.codecs.SETTINGS`).
LABELS = ("none", "sortquant16", "sortquant12", "sortquant8", "sortquant4", "quant8")
#: Compute pieces: per micro-batch (forward/backward of each segment), per step (optimizer).
PIECES = ("f1", "f2", "b2", "b1", "s", "sb", "client_opt", "server_opt")
#: (boundary, direction) of each link transfer: uplink is client -> server.
UP_FWD, DOWN_FWD = "stage0->stage1 forward", "stage1->stage2 forward"
UP_BWD, DOWN_BWD = "stage1->stage2 backward", "stage0->stage1 backward"
TARGET_SPEEDUP_100M, TARGET_EFFICIENCY, TARGET_CODEC = 3.5, 0.85, 0.10


# -- the model ------------------------------------------------------------------------------

def phase_seconds(client_a: float, uplink: float, server: float, downlink: float, client_b: float,
                  micro: int) -> float:
    """Seconds of one GPipe phase: ``micro`` identical micro-batches through the chain
    client (``client_a``) -> uplink -> server -> downlink -> client (``client_b``), all in
    seconds per micro-batch; the client's two tasks share one CPU.

    ``sum(chain) + (micro - 1) * max(client_a + client_b, uplink, server, downlink)``.
    """
    chain = client_a + uplink + server + downlink + client_b
    return chain + (micro - 1) * max(client_a + client_b, uplink, server, downlink)


def link_seconds(message_bytes: float, latency_s: float, bandwidth_Bps: float) -> float:
    """Seconds one message occupies its link direction: ``latency + bytes / bandwidth``."""
    return latency_s + message_bytes / bandwidth_Bps


def predict_step_seconds(compute: Mapping[str, float], message_bytes: Mapping[str, float], latency_s: float,
                         bandwidth_Bps: float, micro: int) -> float:
    """Predicted seconds of one training step (see the module docstring).

    Args:
        compute: seconds of each of :data:`PIECES` (per micro-batch; optimizer per step).
        message_bytes: bytes per message of ``UP_FWD``, ``DOWN_FWD``, ``UP_BWD``, ``DOWN_BWD``.
        latency_s, bandwidth_Bps: the link (``bandwidth_Bps = inf``: a free link).
        micro: micro-batches per step.
    """
    link = {k: link_seconds(message_bytes[k], latency_s, bandwidth_Bps) for k in (UP_FWD, DOWN_FWD, UP_BWD, DOWN_BWD)}
    c = compute
    fwd = phase_seconds(c["f1"], link[UP_FWD], c["s"], link[DOWN_FWD], c["f2"], micro)
    bwd = phase_seconds(c["b2"], link[UP_BWD], c["sb"], link[DOWN_BWD], c["b1"], micro)
    return fwd + bwd + max(c["client_opt"], c["server_opt"])


def report(res: Mapping[str, Any]) -> tuple[str, bool]:
    """The printed table and target lines from the ranks' results; and whether targets are met."""
    cfg, link, comps = res["config"], res["link"], res["compute"]
    batch, micro = cfg["batch_size"], cfg["chunk"]
    lat, bw = link["latency_s"], link["bandwidth_Bps"]
    base = res["settings"]["none"]

    def pred(comp, label, bandwidth=bw, latency=lat):
        return predict_step_seconds(comp, res["settings"][label]["message_bytes"], latency, bandwidth, micro)

    rows = []  # per setting: medians over rounds (each round with its own compute measurement)
    for label, s in res["settings"].items():
        rounds = list(zip(s["rounds"], base["rounds"], comps))
        speedups = [b["seconds"] / r["seconds"] for r, b, _ in rounds]
        ideals = [pred(c, "none") / pred(c, label) for _, _, c in rounds]
        speedup, ideal = statistics.median(speedups), statistics.median(ideals)
        rows.append((label, sum(s["message_bytes"].values()) * micro,
                     statistics.median(batch * r["steps"] / r["seconds"] for r, _, _ in rounds),
                     statistics.median(batch / pred(c, label) for _, _, c in rounds), speedup, ideal, speedup / ideal,
                     statistics.median(max(r["codec_seconds"]) / r["seconds"] for r, _, _ in rounds)))
    comp = {k: statistics.median(c[k] for c in comps) for k in PIECES}
    free = batch / pred(comp, "none", math.inf, 0.0)
    lines = [
        f"MobileNetV2 client/server, CIFAR-10 {cfg['image_size']} px, batch {batch} in {micro} micro-batches, "
        f"client layers {cfg['client_layers']}, {cfg['threads']} thread(s)/rank; {cfg['rounds']} rounds x "
        f"{cfg['steps']} steps after {cfg['warmup']} warm-up; {cfg['cores']} cores, load average "
        f"{cfg['load_before']:.1f} before, {cfg['load_after']:.1f} after",
        f"link: tc rate {cfg['rate_bps'] / 1e6:g} Mbit/s each way; probed bandwidth {bw / 1e6:.3f} MB/s "
        f"({bw * 8 / 1e6:.2f} Mbit/s goodput), latency {lat * 1e6:.0f} us, R^2 {link['r2']:.4f}",
        "compute ms per micro-batch (median over rounds): client f1 {f1:.1f} f2 {f2:.1f} b2 {b2:.1f} b1 {b1:.1f}; server s {s:.1f} "
        "sb {sb:.1f}; optimizer client {client_opt:.1f} server {server_opt:.1f}".format(
            **{k: v * 1e3 for k, v in comp.items()}),
        f"compute-only bound (free link): {free:.1f} samples/s",
        "",
        "| setting | wire MB/step | samples/s | predicted | model | speedup | ideal | efficiency | codec % step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, wire, thr, pred_thr, speedup, ideal, eff, codec in rows:
        lines.append(f"| {label} | {wire / 1e6:.3f} | {thr:.1f} | {pred_thr:.1f} | {thr / pred_thr:.2f} | "
                     f"{speedup:.2f}x | {ideal:.2f}x | {eff:.2f} | {codec:.1%} |")
    by = {r[0]: r for r in rows}
    ok = True
    if "sortquant8" in by:
        _, _, _, _, speedup, ideal, eff, _ = by["sortquant8"]
        scale = bw / (cfg["rate_bps"] / 8)  # goodput per wire rate, as probed
        bw100 = scale * 100e6 / 8
        ideal100 = pred(comp, "none", bw100) / pred(comp, "sortquant8", bw100)
        eff_ok = eff >= TARGET_EFFICIENCY
        at_100 = abs(cfg["rate_bps"] - 100e6) < 1
        fast_ok = at_100 and speedup >= TARGET_SPEEDUP_100M
        measured = f"measured {speedup:.2f}x: {'met' if fast_ok else 'MISSED'}" if at_100 else "not this run's rate"
        lines += ["", f"sortquant8 speedup {speedup:.2f}x, ideal {ideal:.2f}x, efficiency {eff:.2f} "
                      f"(target >= {TARGET_EFFICIENCY:.2f} at the chosen rate): {'met' if eff_ok else 'MISSED'}",
                  f"at 100 Mbit/s ({bw100 / 1e6:.2f} MB/s goodput) the model predicts sortquant8 / uncompressed = "
                  f"{ideal100:.2f}x with this compute (target {TARGET_SPEEDUP_100M}x there; {measured})"]
        ok = eff_ok or fast_ok
    worst = max(rows, key=lambda r: r[7])
    codec_ok = worst[7] < TARGET_CODEC
    lines.append(f"encode + decode at most {worst[7]:.1%} of step time (busiest rank, {worst[0]}; target "
                 f"< {TARGET_CODEC:.0%}): {'met' if codec_ok else 'MISSED'}")
    return "\n".join(lines), ok and codec_ok


# -- the ranks ------------------------------------------------------------------------------

def probe_link(rate_bps: int) -> dict[str, Any] | None:
    """Ping-pong 4 sizes (the largest about 0.5 s at ``rate_bps``) and fit; rank 0 gets the fit."""
    top = 4 ** max(5, int(math.log(rate_bps / 8 * 0.5, 4)))
    sizes = [top // 64, top // 16, top // 4, top]
    seconds = pingpong_seconds(sizes, repeats=3, warmup=1)
    if seconds is None:
        return None
    fit = fit_latency_bandwidth(sizes, seconds)
    return {"latency_s": fit.latency_s, "bandwidth_Bps": fit.bandwidth_Bps, "r2": fit.r2, "sizes": sizes,
            "seconds": seconds}


def measure_compute(stages, rank: int, optimizer, batch, args, reps: int = 3) -> dict[str, float]:
    """Each rank times its own stages without communication (median of ``reps`` steps);
    the pieces of both ranks, in seconds (see :data:`PIECES`), on every rank."""
    front, mid, back = stages
    micro = args.batch_size // args.chunk
    clock = time.perf_counter
    times: dict[str, list[float]] = {k: [] for k in PIECES}
    if rank == 0:
        xs, ys = batch[0].tensor_split(args.chunk), batch[1].tensor_split(args.chunk)
        with torch.no_grad():
            h = mid(front(xs[0]))  # a server output to feed the back stage (untimed)
    else:
        with torch.no_grad():
            u = front(torch.randn(micro, 3, args.image_size, args.image_size))
            grad_out = torch.randn_like(mid(u))
    dist.barrier()
    for _ in range(reps):
        t = dict.fromkeys(PIECES, 0.0)
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            outs, losses = [], []
            for m in range(args.chunk):
                t0 = clock()
                outs.append(front(xs[m]))
                t1 = clock()
                losses.append(F.cross_entropy(back(h.clone().requires_grad_()), ys[m]) / args.chunk)
                t["f1"] += t1 - t0
                t["f2"] += clock() - t1
            grad_z = torch.randn_like(outs[0])
            for m in reversed(range(args.chunk)):
                t0 = clock()
                losses[m].backward()
                t1 = clock()
                outs[m].backward(grad_z)
                t["b2"] += t1 - t0
                t["b1"] += clock() - t1
        else:
            outs = []
            for m in range(args.chunk):
                t0 = clock()
                outs.append(mid(u.clone().requires_grad_()))
                t["s"] += clock() - t0
            for m in reversed(range(args.chunk)):
                t0 = clock()
                outs[m].backward(grad_out)
                t["sb"] += clock() - t0
        t0 = clock()
        optimizer.step()
        t["client_opt" if rank == 0 else "server_opt"] += clock() - t0
        for k in PIECES:
            times[k].append(t[k] / (1 if k.endswith("opt") else args.chunk))
    dist.barrier()
    values = torch.tensor([statistics.median(times[k]) for k in PIECES], dtype=torch.float64)
    dist.all_reduce(values)  # each piece was timed by one rank, zero on the other
    return dict(zip(PIECES, values.tolist()))


def time_setting(pipe: Pipeline, optimizer, batches, rank: int, steps: int, warmup: int) -> dict[str, Any]:
    """``warmup`` untimed, then ``steps`` timed training steps between barriers.

    Returns (rank 0; ``{}`` elsewhere): wall seconds, steps, codec seconds per rank, and
    the merged meter's records of the timed steps.
    """
    def step(i: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        x, y = batches[i % len(batches)] if rank == 0 else (None, None)
        pipe.train_step(x, y)
        optimizer.step()

    for i in range(warmup):
        step(i)
    pipe.meter.reset()
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    dist.barrier()
    seconds = time.perf_counter() - start
    mine = pipe.meter.totals()
    codec = torch.tensor([mine["encode_seconds"] + mine["decode_seconds"]], dtype=torch.float64)
    per_rank = [torch.zeros_like(codec) for _ in range(dist.get_world_size())]
    dist.all_gather(per_rank, codec)
    merged = pipe.meter.gather(dst=0)
    if rank != 0:
        return {}
    return {"seconds": seconds, "steps": steps, "codec_seconds": [float(c) for c in per_rank],
            "records": merged.records()}


def message_bytes(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Bytes per message (payloads + framing) of each ``"<boundary> <direction>"``."""
    return {f"{r['name']} {r['direction']}": (r["wire_bytes"] + r["frame_bytes"]) / r["count"]
            for r in records if r["count"]}


def rank_main(args: argparse.Namespace) -> None:
    """One rank under ``bandwidth/slow_link.py`` (torchrun-style variables); rank 0 writes ``--json``."""
    rank, _ = init_distributed("gloo", timeout=args.timeout)
    try:
        torch.set_num_threads(args.threads)
        load_before = os.getloadavg()[0]
        link = probe_link(parse_rate(args.rate))
        if rank == 0:
            print(f"probe: {link['bandwidth_Bps'] / 1e6:.3f} MB/s, latency {link['latency_s'] * 1e6:.0f} us",
                  flush=True)
        torch.manual_seed(0)
        stages = client_server_split(mobilenet_layers(build_mobilenet(10, image_size=args.image_size)),
                                     args.client_layers)
        placement = client_server_placement()
        mine = [p for s, r in zip(stages, placement) if r == rank for p in s.parameters()]
        initial = copy.deepcopy([s.state_dict() for s in stages])

        def fresh_optimizer() -> torch.optim.Optimizer:
            """Initial weights and a new optimizer: every setting trains from the same start
            (and never long enough to diverge into values a codec refuses)."""
            for stage, state in zip(stages, initial):
                stage.load_state_dict(state)
            return torch.optim.SGD(mine, lr=0.01, momentum=0.9)

        batches = None
        if rank == 0:
            n = min(args.warmup + args.steps, 8)
            loader = make_loader("cifar10", args.data_dir, "train", args.batch_size, image_size=args.image_size,
                                 subset=n * args.batch_size, num_workers=0, download=False)
            batches = list(loader)
        for s in stages:
            s.train()
        results: dict[str, dict[str, Any]] = {label: {"rounds": []} for label in args.settings}
        compute = []  # per round, measured just before that round's settings
        for r in range(args.rounds):
            compute.append(measure_compute(stages, rank, fresh_optimizer(), batches[0] if batches else None, args))
            for label in args.settings:
                fwd, bwd = SETTINGS[label].forward, SETTINGS[label].backward
                pipe = Pipeline(stages, placement, chunks=args.chunk, loss_fn=F.cross_entropy,
                                act_codec=(fwd.name, dict(fwd.options)), grad_codec=(bwd.name, dict(bwd.options)),
                                timeout=args.timeout)
                out = time_setting(pipe, fresh_optimizer(), batches, rank, args.steps, args.warmup)
                if rank == 0:
                    results[label]["rounds"].append({k: out[k] for k in ("seconds", "steps", "codec_seconds")})
                    results[label]["message_bytes"] = message_bytes(out["records"])
                    print(f"[round {r + 1}/{args.rounds}] {label}: {args.steps} steps in {out['seconds']:.2f} s = "
                          f"{args.steps * args.batch_size / out['seconds']:.1f} samples/s", flush=True)
        if rank == 0:
            config = {k: getattr(args, k) for k in ("rate", "image_size", "batch_size", "chunk", "client_layers",
                                                    "steps", "warmup", "rounds", "threads")}
            config.update(rate_bps=parse_rate(args.rate), cores=os.cpu_count(), load_before=load_before,
                          load_after=os.getloadavg()[0])
            with open(args.json, "w") as f:
                json.dump({"config": config, "link": link, "compute": compute, "settings": results}, f, indent=1)
    finally:
        dist.destroy_process_group()


# -- the launcher ---------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="8mbit", help="link rate each way, tc syntax (e.g. 8mbit, 100mbit)")
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "cifar10-images"),
                   help="CIFAR-10 (image folder, tarball or its folder)")
    p.add_argument("--image-size", type=int, default=32, help="image side in pixels")
    p.add_argument("--batch-size", type=int, default=64, help="images per step")
    p.add_argument("--chunk", type=int, default=4, help="micro-batches per step (M)")
    p.add_argument("--client-layers", type=int, default=1, help="layers the client holds at each end")
    p.add_argument("--steps", type=int, default=6, help="timed steps per setting and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--settings", default=",".join(LABELS), help=f"codecs to compare (first: the baseline "
                                                                  f"'none'); out of {', '.join(SETTINGS)}")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a stalled peer may block")
    p.add_argument("--json", help="also write the raw results here")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    try:
        parse_rate(args.rate)
    except ValueError as e:
        parser.error(str(e))
    if args.settings[:1] != ["none"] or any(s not in SETTINGS for s in args.settings):
        parser.error(f"--settings must start with none (the baseline) and name settings out of {', '.join(SETTINGS)}")
    if min(args.image_size, args.batch_size, args.chunk, args.steps, args.rounds, args.threads) < 1 \
            or args.warmup < 0 or args.client_layers < 1 or args.batch_size % args.chunk:
        parser.error("need positive sizes, --warmup >= 0, --client-layers >= 1 and --batch-size divisible by --chunk")
    if "RANK" in os.environ:  # a rank started by bandwidth/slow_link.py
        rank_main(args)
        return 0
    try:
        find_cifar("cifar10", args.data_dir)
    except FileNotFoundError as e:
        parser.error(f"--data-dir: {e}")
    if os.geteuid() != 0:
        parser.error("the slow link needs root (network namespaces and tc); run as root, e.g. sudo python ...")
    with tempfile.TemporaryDirectory(prefix="dgpipe-slowlink-") as tmp:
        out = args.json or os.path.join(tmp, "results.json")
        command = [sys.executable, str(Path(__file__).resolve()), *argv, "--json", os.path.abspath(out)]
        status = subprocess.call([sys.executable, str(SLOW_LINK), "--rate", args.rate, "--", *command])
        if status != 0:
            print(f"slow_link_speedup: the run failed (status {status})", file=sys.stderr)
            return status
        with open(out) as f:
            text, ok = report(json.load(f))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
