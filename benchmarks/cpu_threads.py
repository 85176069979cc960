"""Does the second core shorten a codec on CPU? Encode and decode of the 25.7 MB tensor on 1 and 2 torch threads.

The compiled kernels run on ``torch.get_num_threads()`` threads (:mod:`dgpipe.compression.kernels.backend`), as
an eager op would; here ``quant`` 8, ``sortquant`` 6+2 and the 2-bit token codebook with Hadamard rotation
(:data:`CODECS`) code the 25.7 MB tensor of ``codec_speed.py`` with 1 and 2 threads, side by side in
interleaved rounds (``codec_speed.timed``: medians), and the table gives the milliseconds and the speedup.

Usage::

    python benchmarks/cpu_threads.py [--reps 9]
"""

from __future__ import annotations

import argparse

import torch

from codec_speed import SHAPE, one_pass_data, timed
from dgpipe.compression import get_codec

CODECS = {
    "quant 8": ("quant", {"bits": 8}),
    "sortquant 6+2": ("sortquant", {"quant_bits": 6, "split_bits": 2}),
    "codebook 2, token, Hadamard": ("codebook", {"bits": 2, "group": "token", "rotate": "hadamard",
                                                 "scale_dtype": "bfloat16"}),
}


def on_threads(k: int, fn):
    """``fn`` run with ``k`` torch intra-op threads."""
    def run():
        torch.set_num_threads(k)
        return fn()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9, help="timed rounds (medians)")
    args = ap.parse_args()
    x = one_pass_data(SHAPE, "relu6")
    fns = {}
    for name, (codec, opts) in CODECS.items():
        c = get_codec(codec, **opts)
        payload = c.encode(x)
        for k in (1, 2):
            fns[(name, "encode", k)] = on_threads(k, lambda c=c: c.encode(x))
            fns[(name, "decode", k)] = on_threads(k, lambda c=c, p=payload: c.decode(p))
    measured = timed(fns, args.reps, inner=1)
    print(f"torch {torch.__version__}, medians of {args.reps} interleaved rounds, the 25.7 MB tensor")
    print("| codec | step | ms, 1 thread | ms, 2 threads | speedup |")
    print("|---|---|---|---|---|")
    for name in CODECS:
        for step in ("encode", "decode"):
            one, two = measured[(name, step, 1)][0], measured[(name, step, 2)][0]
            print(f"| {name} | {step} | {one * 1e3:.2f} | {two * 1e3:.2f} | {one / two:.2f} |")


if __name__ == "__main__":
    main()
