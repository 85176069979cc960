"""Which compiled CPU implementation should run dgpipe's codec steps: the candidates side by side in one run.

Each codec step (the kernels of :mod:`dgpipe.compression.kernels`) is timed on the same inputs, in
interleaved rounds (``codec_speed.timed``: medians), by every candidate:

- ``eager``: the reference torch steps (kernels switched off);
- ``torch.compile``: inductor's vectorised C++/OpenMP code of the same arithmetic, written as one torch
  function per step and compiled for the shape (``dynamic=False``; the compile seconds are printed --
  every new shape pays them again, and inductor needs a C++ compiler at run time);
- ``C``: :mod:`dgpipe.compression.kernels.compiled` (``codes.c``, built at install time).

The log of 2026-11-27 (``benchmarks/results/cpu_paths/``) also has a ``Numba`` column: the JIT-compiled
loops the C kernels replaced, timed by this script at the last commit that held them.

Per step: milliseconds, each candidate against the C kernel, and whether its bytes (or decoded values,
bit for bit) equal the eager reference's. Then whole codecs, encode + decode, with the C kernels and
without, beside a clone of the same tensor, and the speed bars: ``quant 8`` within 1.5x and
``sortquant 6+2`` within 2.5x a clone of the 25.7 MB tensor, the Hadamard/token codebook at 2 and 4
bits within 2x ``quant 8`` on that tensor and on a MiniLM micro-batch.

Usage::

    python benchmarks/cpu_paths.py [--threads 2] [--reps 9] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from codec_speed import SHAPE, clone_and_roundtrips, one_pass_data, same_payload, timed
from dgpipe.compression import get_codec
from dgpipe.compression.kernels import backend, buckets, compiled, compiled_grid, levels, uniform
from dgpipe.compression.kernels.fwht import fwht
from dgpipe.compression.kernels.bitpack import CHUNK, packed_nbytes

TENSORS = {"25.7 MB (64x32x56x56)": (SHAPE, "relu6"), "MiniLM micro-batch (16x64x384)": ((16, 64, 384), "outliers")}

CODECS = {
    "quant 8": ("quant", {"bits": 8}),
    "quant 4": ("quant", {"bits": 4}),
    "sortquant 6+2": ("sortquant", {"quant_bits": 6, "split_bits": 2}),
    **{f"codebook {b}, token, Hadamard": ("codebook", {"bits": b, "group": "token", "rotate": "hadamard",
                                                       "scale_dtype": "bfloat16"}) for b in (2, 4)},
}


def eager(fn):
    """``fn`` run with the compiled kernels switched off (the reference steps)."""
    def run():
        previous = backend.set_enabled(False)
        try:
            return fn()
        finally:
            backend.set_enabled(previous)
    return run


# --- the steps' arithmetic as single torch functions, for torch.compile (whole chunks, one group) ------------

def tc_uniform_codes(x, lo, div, bits: int):
    q = torch.clamp(torch.round((x - lo) / div), 0, (1 << bits) - 1).to(torch.uint8)
    if bits == 8:
        return q
    lanes = q.view(-1, 8 // bits, CHUNK * bits // 8)  # bitpack's layout: lanes of one chunk share a byte
    out = lanes[:, 0]
    for lane in range(1, 8 // bits):
        out = out | (lanes[:, lane] << (lane * bits))
    return out.reshape(-1)


def tc_uniform_values(packed, lo, step, bits: int):
    if bits == 8:
        codes = packed
    else:
        b = packed.view(-1, 1, CHUNK * bits // 8)
        codes = (b >> (torch.arange(0, 8, bits, dtype=torch.uint8).view(1, -1, 1))) & ((1 << bits) - 1)
    return lo + codes.reshape(-1).to(torch.float32) * step


def tc_bucket_codes(x, bounds, mins, div, q: int):
    b = torch.bucketize(x, bounds, right=True)
    v = torch.clamp(torch.round((x - mins[b]) / div[b]), 0, (1 << q) - 1)
    return (v.to(torch.int32) + (b.to(torch.int32) << q)).to(torch.uint8)


def tc_bucket_values(packed, mins, step, q: int):
    c = packed.to(torch.int64)
    b = c >> q
    return mins[b] + (c & ((1 << q) - 1)).to(torch.float32) * step[b]


def tc_level_codes(v, mids):
    k = torch.bucketize(v, mids).to(torch.uint8).view(-1, 4, CHUNK // 4)
    return (k[:, 0] | (k[:, 1] << 2) | (k[:, 2] << 4) | (k[:, 3] << 6)).reshape(-1)


def tc_level_values(packed, table, scale):
    b = packed.view(-1, 1, CHUNK // 4)
    codes = (b >> torch.arange(0, 8, 2, dtype=torch.uint8).view(1, -1, 1)) & 3
    return table[codes.reshape(-1).to(torch.int64)] * scale


def tc_fwht(x):
    b = x.shape[-1]
    y, h = x, 1
    while h < b:
        pairs = y.view(-1, b // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2).view(-1, b)
        h *= 2
    return y * (1.0 / b ** 0.5)


def compile_timed(fn, *args):
    """``(compiled fn, seconds to compile it)``: torch.compile for these shapes, first call included (in this
    process: a pool of compile workers would stay behind and slow every later measurement)."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    t0 = time.perf_counter()
    cfn = torch.compile(fn, dynamic=False)
    cfn(*args)
    return cfn, time.perf_counter() - t0


def same(a, b) -> bool:
    """Equal bits (float tensors as int32, -0.0 and NaN included) or equal bytes."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and torch.equal(a, b)


def step_rows(x: torch.Tensor, reps: int) -> list[str]:
    """Markdown rows of the per-step table on the whole chunks of ``x`` (flattened)."""
    n = x.numel() // CHUNK * CHUNK
    flat = x.reshape(-1)[:n].contiguous()
    rows = []

    def add(step: str, candidates: dict, reference):
        """Time the candidates (name -> (fn, compile seconds or None)) and one row each."""
        measured = timed({name: fn for name, (fn, _) in candidates.items()}, reps, inner=1)
        t_c = measured["C"][0]
        for name, (_, compile_s) in candidates.items():
            t, result = measured[name]
            note = f" (compile {compile_s:.1f} s)" if compile_s is not None else ""
            rows.append(f"| {step} | {name}{note} | {t * 1e3:.3f} | {t / t_c:.2f} | "
                        f"{'yes' if same(result, reference) else 'NO'} |")

    lo, hi = flat.min().view(1), flat.max().view(1)
    for bits in (8, 4):
        step = uniform.grid_step(lo, hi, 1 << bits)
        div = uniform.grid_divisor(step)
        ref = eager(lambda: uniform.uniform_codes(flat, lo, div, bits, n))()
        out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8)

        def kernel(mod, out=out, bits=bits, div=div):
            return lambda: (mod.encode_uniform(flat, lo, div, bits, n, out), out)[1]

        cands = {"eager": (eager(lambda bits=bits, div=div: uniform.uniform_codes(flat, lo, div, bits, n)), None),
                 "torch.compile": compile_timed(tc_uniform_codes, flat, lo, div, bits), "C": (kernel(compiled), None)}
        cfn, cs = cands["torch.compile"]
        cands["torch.compile"] = (lambda cfn=cfn, div=div, bits=bits: cfn(flat, lo, div, bits), cs)
        add(f"uniform codes, {bits} bits", cands, ref)

        vref = eager(lambda bits=bits, step=step: uniform.uniform_values(ref, bits, n, torch.cat((lo, step)), 1, n))()
        y = torch.empty(n)

        def dkernel(mod, bits=bits, step=step, ref=ref):
            return lambda: (mod.decode_uniform(ref, bits, lo, step, n, y), y)[1]

        cfn, cs = compile_timed(tc_uniform_values, ref, lo, step, bits)
        cands = {"eager": (eager(lambda bits=bits, step=step, ref=ref: uniform.uniform_values(
                     ref, bits, n, torch.cat((lo, step)), 1, n)), None),
                 "torch.compile": (lambda cfn=cfn, ref=ref, step=step, bits=bits: cfn(ref, lo, step, bits), cs),
                 "C": (dkernel(compiled), None)}
        add(f"uniform values, {bits} bits", cands, vref)

    # sort quantization 6+2 on its grid
    grid = eager(lambda: buckets.bucket_grid(flat, 2, 6, "bench"))()
    bounds, mins, div = grid.bounds.contiguous(), grid.mins.contiguous(), grid.div.contiguous()
    step = grid.meta[4:].contiguous()
    sgrid = buckets.BucketGrid(bounds, mins, div, grid.meta)
    ref = eager(lambda: buckets.bucket_codes(flat, sgrid, 6, 2))()
    out = torch.empty(n, dtype=torch.uint8)
    cfn, cs = compile_timed(tc_bucket_codes, flat, bounds, mins, div, 6)
    cands = {"eager": (eager(lambda: buckets.bucket_codes(flat, sgrid, 6, 2)), None),
             "torch.compile": (lambda: cfn(flat, bounds, mins, div, 6), cs),
             "C": (lambda: (compiled.encode_buckets(flat, bounds, mins, div, 6, out), out)[1], None)}
    add("bucket codes, 6+2", cands, ref)
    vref = eager(lambda: buckets.bucket_values(ref, 6, 2, n, grid.meta))()
    y = torch.empty(n)
    cfn, cs = compile_timed(tc_bucket_values, ref, mins, step, 6)
    cands = {"eager": (eager(lambda: buckets.bucket_values(ref, 6, 2, n, grid.meta)), None),
             "torch.compile": (lambda: cfn(ref, mins, step, 6), cs),
             "C": (lambda: (compiled.decode_buckets(ref, 6, mins, step, y), y)[1], None)}
    add("bucket values, 6+2", cands, vref)

    # codebook levels, 2 bits, one scale
    table = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    mids = ((table[1:] + table[:-1]) / 2).contiguous()
    v = (flat - flat.mean()) / flat.std()
    ref = eager(lambda: levels.level_codes(v, table, 2))()
    out = torch.empty(n // 4, dtype=torch.uint8)
    cfn, cs = compile_timed(tc_level_codes, v, mids)
    cands = {"eager": (eager(lambda: levels.level_codes(v, table, 2)), None),
             "torch.compile": (lambda: cfn(v, mids), cs),
             "C": (lambda: (compiled.encode_levels(v, mids, 2, out), out)[1], None)}
    add("level codes, 2 bits", cands, ref)
    scale = torch.tensor([0.75])
    vref = eager(lambda: levels.level_values(ref, 2, n, table, scale, n))()
    y = torch.empty(n)
    cfn, cs = compile_timed(tc_level_values, ref, table, scale)
    cands = {"eager": (eager(lambda: levels.level_values(ref, 2, n, table, scale, n)), None),
             "torch.compile": (lambda: cfn(ref, table, scale), cs),
             "C": (lambda: (compiled.decode_levels(ref, 2, table, scale, n, y), y)[1], None)}
    add("level values, 2 bits", cands, vref)

    # Hadamard butterflies of 512-wide rows
    rows512 = flat.view(-1, 512)
    ref = eager(lambda: fwht(rows512))()
    cfn, cs = compile_timed(tc_fwht, rows512)
    cands = {"eager": (eager(lambda: fwht(rows512)), None), "torch.compile": (lambda: cfn(rows512), cs),
             "C": (lambda: compiled.fwht(rows512), None)}
    add("Hadamard butterflies, rows of 512", cands, ref)

    # sort quantization's sample sort and its extrema pass
    xs = flat.numpy()
    positions = buckets._cpu_sample_positions(n, 16384)
    ref = np.sort(xs[positions])
    cands = {"eager": (lambda: np.sort(xs[positions]), None), "C": (lambda: compiled_grid.sort_sample(xs, positions), None)}
    add("sort of a 16k sample (eager: numpy)", cands, torch.from_numpy(ref))
    bnd = ref[[4096, 8192, 12288]] + np.float32(0)
    cands = {"C": (lambda: torch.from_numpy(compiled_grid.bucket_extrema(xs, bnd)[1]), None)}
    add("min and bucket maxima, 4 buckets (against C's)", cands, cands["C"][0]())
    return rows


def codec_rows(reps: int) -> tuple[list[str], list[str]]:
    """Markdown rows of the whole-codec table and the missed speed bars."""
    rows, fails = [], []
    for label, (shape, kind) in TENSORS.items():
        x = one_pass_data(shape, kind)
        codecs = {name: get_codec(c, **opts) for name, (c, opts) in CODECS.items()}
        measured = timed(clone_and_roundtrips(x, codecs), reps, inner=1)
        clone, q8 = measured["clone"][0], measured[("quant 8", True)][0]
        rows.append(f"| {label} | clone | {clone * 1e3:.3f} | | 1.00 | | |")
        for name in codecs:
            (t, (p, y)), (te, (pe, ye)) = measured[(name, True)], measured[(name, False)]
            ok = same_payload(p, pe) and torch.equal(y, ye)
            rows.append(f"| {label} | {name} | {t * 1e3:.3f} | {te * 1e3:.3f} | {t / clone:.2f} | {t / q8:.2f} "
                        f"| {'yes' if ok else 'NO'} |")
            if not ok:
                fails.append(f"{label}, {name}: the C kernels' bytes differ from the reference's")
            bar = {"quant 8": ("clone", 1.5, clone), "sortquant 6+2": ("clone", 2.5, clone)}.get(name)
            if name.startswith("codebook"):
                bar = ("quant 8", 2.0, q8)
            if bar and not ("MiniLM" in label and bar[0] == "clone") and t / bar[2] > bar[1]:
                fails.append(f"{label}, {name}: {t / bar[2]:.2f}x {bar[0]} > {bar[1]}x")
    return rows, fails


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the kernels use as many)")
    ap.add_argument("--reps", type=int, default=9, help="timed rounds per measurement (median)")
    ap.add_argument("--out", help="also write the tables to this markdown file")
    args = ap.parse_args()
    if not compiled.available():
        sys.exit(backend.MISSING)
    torch.set_num_threads(args.threads)
    lines = [f"torch {torch.__version__}, {args.threads} thread(s), medians of {args.reps} interleaved rounds", ""]
    rows, fails = codec_rows(args.reps)  # first: before torch.compile has run in this process
    lines += ["### Whole codecs, encode + decode", "",
              "| tensor | codec | ms, C | ms, eager | x clone | x quant 8 | same bytes |",
              "|---|---|---|---|---|---|---|",
              *rows, "", "Speed bars: " + ("all met" if not fails else "missed: " + "; ".join(fails)),
              ""]
    for label, (shape, kind) in TENSORS.items():
        lines += [f"### Steps on {label}", "", "| step | candidate | ms | x C | same bits as eager |",
                  "|---|---|---|---|---|", *step_rows(one_pass_data(shape, kind), args.reps), ""]
    text = "\n".join(lines).rstrip()
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
