"""Split generation on shaped links: time to first token and tokens/s of SmolLM2-135M, client and server
in two processes, against the ideal from the measured compute, the bytes and the latency per message.

For every link -- loopback (the compute alone), 100 Mbit/s + 10 ms and 10 Mbit/s + 50 ms (the rate shaped
by ``tc tbf`` through ``bandwidth/slow_link.py``, root; the one-way latency added by holding every
message back, ``--link-delay``, as this kernel has no ``netem``) -- one pair of processes loads the model
once and generates, for each codec setting (uncompressed float32, 8-bit per-token ``quant``, 4-bit
``codebook`` with Hadamard rotation) and each batch x prompt length (1 x 32, 1 x 512, 16 x 32, 16 x 512
tokens of wiki-excerpt's test split), ``--new-tokens`` tokens greedily (no stop token: every step runs).
Each is run ``--repeats`` times after an untimed warm-up per codec (its first call compiles); medians
are reported. Rank 0 writes one JSON line per setting (``<link>.jsonl``); the table (``table.md``) puts each beside
its ideal::

    ideal TTFT  = loopback TTFT + (prefill message bytes both ways) x TCP_FRAMING / rate + 2 x latency
    ideal step  = loopback step + (one-token message bytes both ways) x TCP_FRAMING / rate + 2 x latency

with the message bytes as the transport frames them (payloads, headers, meta; the prompt mask at
prefill). It also lists the per-message overhead: the bytes of a one-token message that are not codes
(payload header and framing), and the client's codec milliseconds per step (encoding its message and
decoding the answer, averaged over the steps, prefill included; the server spends about as much).
Resumable: a link whose log is complete is not run again.

    sudo python benchmarks/lm_generate_latency.py --out benchmarks/results/lm_generate_latency/DATE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "text" / "wiki-excerpt" / "test.txt"
#: (name, rate in bit/s or None for loopback, one-way latency in s)
LINKS = (("loopback", None, 0.0), ("100mbit_10ms", 100e6, 0.010), ("10mbit_50ms", 10e6, 0.050))
#: label -> codec spec (name, options), the same both ways
CODECS = {
    "none": ("none", {}),
    "quant8": ("quant", {"bits": 8, "group": "token"}),
    "codebook4": ("codebook", {"bits": 4, "group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}),
}
SHAPES = ((1, 32), (1, 512), (16, 32), (16, 512))
MODEL = "smollm2-135m-instruct"
HIDDEN = 576  # the model's hidden size: the width of every message


def prompts(text_ids, batch: int, length: int) -> tuple:
    """``(input_ids, attention_mask)``: ``batch`` consecutive windows of ``length`` tokens of ``text_ids`` (int64
    ``(n,)``, the tokenized test text)."""
    import torch

    windows = text_ids[: batch * length].view(batch, length)
    return windows.clone(), torch.ones_like(windows)


def message_bytes(spec: tuple[str, dict], shape: tuple[int, ...], prefill: bool) -> tuple[int, int]:
    """``(bytes on the wire, bytes of codes)`` of one message of hidden states ``shape`` (the prompt mask at
    prefill), as the transport frames it."""
    import torch

    from dgpipe.comm.framing import pack_message
    from dgpipe.compression import get_codec

    payloads = [get_codec(spec[0], **spec[1]).encode(torch.zeros(shape))]
    if prefill:
        payloads.append(get_codec("intpack").encode(torch.ones(shape[:2], dtype=torch.long)))
    codes = sum(t.numel() * t.element_size() for t in payloads[0].tensors)
    return pack_message(payloads, [0, 0, 0, 0])[1], codes


def worker(out: Path, delay_ms: float, new_tokens: int, shapes: list[tuple[int, int]], repeats: int) -> None:
    """One rank (torchrun-style environment): load the model, then every codec x shape in order."""
    import torch

    from dgpipe.cli.generate import _load
    from dgpipe.comm import BandwidthMeter
    from dgpipe.comm.delay import DelayLine
    from dgpipe.generation import ClientStages, RemoteServer, StageBlocks, generate, serve
    from dgpipe.models import client_server_split
    from dgpipe.models.causal_lm import causal_lm_layers
    from dgpipe.pipeline import init_distributed

    torch.set_num_threads(1)  # each side its own core, as on two machines
    rank, _ = init_distributed("gloo", 600)
    args = argparse.Namespace(model=MODEL, tokenizer=None, model_config=None)
    model, tokenizer = _load(args)
    front, middle, last = client_server_split(causal_lm_layers(model), 1, (1, 1))
    delay = DelayLine(delay_ms / 1000) if delay_ms else None
    client = ClientStages(front, last, model.config)
    text_ids = tokenizer(TEXT.read_text(encoding="utf-8")[:400_000], return_tensors="pt")["input_ids"][0]  # once

    def session(spec, batch: int, length: int, tokens: int, meter: BandwidthMeter) -> list[float]:
        """One generation (client) or its service (server); the client's step seconds."""
        if rank == 1:
            serve(StageBlocks(middle, model.config), 0, spec, meter=meter, timeout=600, delay=delay)
            return []
        ids, mask = prompts(text_ids, batch, length)
        server = RemoteServer(1, spec, meter=meter, timeout=600, delay=delay)
        steps: list[float] = []
        try:
            generate(client, server, ids, mask, tokens, timings=steps)
        finally:
            server.close()
        return steps

    records = []
    for label, spec in CODECS.items():
        session(spec, 1, 64, 2, BandwidthMeter())  # warm-up: the compiled kernels' first calls (JIT), untimed
        for batch, length in shapes:
            runs, meter = [], BandwidthMeter()
            for _ in range(repeats):
                runs.append(session(spec, batch, length, new_tokens, meter))
            if rank == 0:
                records.append({"codec": label, "batch": batch, "length": length, "delay_ms": delay_ms,
                                "runs": runs, "meter": meter.records()})
                ttft, step = _medians(runs)
                print(f"{label} {batch}x{length}: TTFT {ttft:.3f} s, step {step:.4f} s", flush=True)
    if rank == 0:
        out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _medians(runs: list[list[float]]) -> tuple[float, float]:
    """Median over the runs of the time to first token and of the mean one-token step (s)."""
    return (statistics.median(r[0] for r in runs),
            statistics.median(sum(r[1:]) / (len(r) - 1) for r in runs))


def table(out: Path) -> str:
    """The markdown table of all links' logs in ``out``."""
    from dgpipe.train.compare import TCP_FRAMING

    logs = {name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
            for name, _, _ in LINKS}
    base = {(r["codec"], r["batch"], r["length"]): r for r in logs["loopback"]}
    rows = ["| link | codec | batch x prompt | TTFT s (ideal) | tokens/s (ideal) | bytes/step each way | "
            "overhead B/msg | client codec ms/step |", "|---|---|---|---|---|---|---|---|"]
    for name, rate, latency in LINKS:
        for r in logs[name]:
            key = (r["codec"], r["batch"], r["length"])
            spec, b, n = CODECS[r["codec"]], r["batch"], r["length"]
            # the prefill both ways (the prompt mask goes to the server only), then one token's message
            pre = message_bytes(spec, (b, n, HIDDEN), True)[0] + message_bytes(spec, (b, n, HIDDEN), False)[0]
            one, codes = message_bytes(spec, (b, 1, HIDDEN), False)
            loop_ttft, loop_step = _medians(base[key]["runs"])
            ttft, step = _medians(r["runs"])
            wire = (lambda x: 8 * x * TCP_FRAMING / rate) if rate else (lambda x: 0.0)  # line rate, TCP/IP headers
            ideal_ttft = loop_ttft + wire(pre) + 2 * latency
            ideal_step = loop_step + wire(2 * one) + 2 * latency
            sent = next(m for m in r["meter"] if m["name"] == "client->server")
            received = next(m for m in r["meter"] if m["name"] == "server->client")
            codec_ms = 1e3 * (sent["encode_seconds"] + received["decode_seconds"]) / sent["count"]
            rows.append(f"| {name} | {r['codec']} | {b} x {n} | {ttft:.3f} ({ideal_ttft:.3f}) | "
                        f"{b / step:.1f} ({b / ideal_step:.1f}) | {one} | {one - codes} | {codec_ms:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="generations per setting (medians reported)")
    p.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES),
                   help="batch x prompt tokens, comma-separated (default: %(default)s)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a rank: write its log here
    p.add_argument("--delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.worker is not None:
        worker(args.worker, args.delay_ms, args.new_tokens, shapes, args.repeats)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rate, latency in LINKS:
        log = args.out / f"{name}.jsonl"
        if log.is_file() and len(log.read_text().splitlines()) == len(CODECS) * len(shapes):
            print(f"[{name}] already done", flush=True)
            continue
        rank = [__file__, "--out", str(args.out), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                "--shapes",
                args.shapes,
                "--worker", str(log), "--delay-ms", f"{1000 * latency:g}"]
        if rate:
            cmd = [sys.executable, str(ROOT / "bandwidth" / "slow_link.py"), "--rate", f"{int(rate / 1e6)}mbit", "--",
                   sys.executable]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        print(f"[{name}] {' '.join(cmd + rank)}", flush=True)
        start = time.perf_counter()
        with open(args.out / f"{name}.out", "w") as stdout:
            subprocess.run(cmd + rank, cwd=ROOT, stdout=stdout, stderr=subprocess.STDOUT, check=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        print(f"[{name}] {time.perf_counter() - start:.0f} s", flush=True)
    text = table(args.out)
    (args.out / "table.md").write_text(f"Command: {' '.join([sys.executable, *sys.argv])}\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
