"""Whole codecs, encode + decode, timed by the dgpipe found on ``sys.path``: one side of a before/after comparison.

Run it alternately with two checkouts (``PYTHONPATH=<checkout> python benchmarks/cpu_before_after.py``), so that
both meet the machine's load alike; each run prints one JSON line: median milliseconds per codec and tensor
(``--reps`` interleaved rounds, ``codec_speed.timed``), and a clone of the same tensor.

Usage::

    for i in 1 2 3; do for tree in OLD NEW; do
        PYTHONPATH=$tree python benchmarks/cpu_before_after.py --label $tree >> out.jsonl; done; done
"""

from __future__ import annotations

import argparse
import json

import torch

from codec_speed import SHAPE, one_pass_data, roundtrip, timed
import dgpipe
from dgpipe.compression import get_codec

TENSORS = {"25.7 MB": (SHAPE, "relu6"), "MiniLM micro-batch": ((16, 64, 384), "outliers"),
           "stem message 16x16x16x16": ((16, 16, 16, 16), "relu6")}
TOKEN = {"group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}
CODECS = {
    "quant 8": ("quant", {"bits": 8}), "quant 4": ("quant", {"bits": 4}),
    "quant 4 token Hadamard": ("quant", {"bits": 4, **TOKEN}),
    "sortquant 6+2": ("sortquant", {"quant_bits": 6, "split_bits": 2}),
    "sortquant 3+1": ("sortquant", {"quant_bits": 3, "split_bits": 1}),
    "codebook 2 token Hadamard": ("codebook", {"bits": 2, **TOKEN}),
    "codebook 4 token Hadamard": ("codebook", {"bits": 4, **TOKEN}),
    "codebook 4 fit, tiles of 100": ("codebook", {"bits": 4, "levels": "fit", "group": "tile", "group_size": 100}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"label": args.label, "dgpipe": dgpipe.__file__, "ms": {}}
    for label, (shape, kind) in TENSORS.items():
        x = one_pass_data(shape, kind)
        fns = {"clone": x.clone}
        for name, (codec, opts) in CODECS.items():
            fns[name] = lambda c=get_codec(codec, **opts): roundtrip(c, x, True)
        for name, (t, _) in timed(fns, args.reps, inner=1).items():
            result["ms"][f"{label} | {name}"] = round(t * 1e3, 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
