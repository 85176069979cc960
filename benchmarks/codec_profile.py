"""Where a codec's GPU time goes: kernel launches, host syncs and kernel time per encode + decode.

For each codec on a CUDA tensor (the 64x32x56x56 float32 randn of ``codec_speed.py``,
25.7 MB, a MiniLM-sized hidden state, 32x64x384, and a decoder's, 8x128x576 as SmolLM2's), one
warm-up round trip, then one round trip under ``torch.profiler``; printed per codec and direction:

- kernels: CUDA kernel launches (Triton and torch's own);
- syncs: calls that can make the host wait for the GPU (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaMemcpy``, ``cudaMemcpyAsync``: a ``.item()``, ``.tolist()``,
  a tensor shaped by data, or a small host-to-device copy);
- waits: the host syncs torch itself reports (``torch.cuda.set_sync_debug_mode("warn")``: a
  ``.item()``, a ``bool()`` of a tensor, a copy to the host) -- the ones that make the host wait;
- kernel us: the sum of the kernels' device time; wall us: the round trip's wall time
  (with its syncs), median of 20 after the profiled one;
- copy us: a clone of the same tensor; ``% copy``: the codec's share of a device copy's bandwidth,
  input bytes per second of encode + decode against the copy's bytes read + written
  (``copy us / (2 * (encode us + decode us))``);
- the kernels that take most of the time, by name.

The targets for a message: one or two kernel launches per encode, no host sync in
the encode path, within 3x of a device copy of the same tensor.

Usage: ``python benchmarks/codec_profile.py [--top 4]`` (needs a CUDA device).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from dgpipe.compression import get_codec

GROUPED = {"group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}
CODECS = {
    "quant 8": ("quant", {"bits": 8}),
    "quant 4": ("quant", {"bits": 4}),
    "sortquant 6+2": ("sortquant", {"quant_bits": 6, "split_bits": 2}),
    "sortquant 3+1": ("sortquant", {"quant_bits": 3, "split_bits": 1}),
    "quant 4 grouped": ("quant", {"bits": 4, **GROUPED}),
    "codebook 4 grouped": ("codebook", {"bits": 4, **GROUPED}),
    "codebook 2 grouped": ("codebook", {"bits": 2, **GROUPED}),
}
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def _count(events) -> tuple[int, int, float, dict[str, float]]:
    """Kernel launches, host syncs, summed kernel microseconds and microseconds per kernel name."""
    kernels, syncs, per_name = 0, 0, {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            per_name[e.name] = per_name.get(e.name, 0.0) + e.device_time
        elif e.name in SYNCS:
            syncs += 1
    return kernels, syncs, sum(per_name.values()), per_name


def _profiled(fn) -> tuple[int, int, float, dict[str, float]]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return _count(prof.events())


def _waits(fn) -> int:
    """The host syncs torch reports while ``fn()`` runs (its sync debug mode, one warning each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)  # not the mode's notice


def _wall_us(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=4, help="kernels named per codec and direction")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("codec_profile.py needs a CUDA device")
    torch.manual_seed(0)
    tensors = {"large 64x32x56x56": torch.randn(64, 32, 56, 56, device="cuda"),
               "minilm 32x64x384": torch.randn(32, 64, 384, device="cuda"),
               "decoder 8x128x576": torch.randn(8, 128, 576, device="cuda")}
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| tensor | codec | step | kernels | syncs | waits | kernel us | wall us | copy us | % copy | top kernels (us) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for tname, x in tensors.items():
        copy_us = _wall_us(lambda: x.clone())
        for label, (name, options) in CODECS.items():
            codec = get_codec(name, **options)
            payload = codec.encode(x)
            walls = {}
            for step, fn in (("encode", lambda: codec.encode(x)), ("decode", lambda: codec.decode(payload))):
                kernels, syncs, kernel_us, per_name = _profiled(fn)
                waits, walls[step] = _waits(fn), _wall_us(fn)
                top = sorted(per_name.items(), key=lambda kv: -kv[1])[: args.top]
                names = "; ".join(f"{n[:40]} {t:.0f}" for n, t in top)
                share = f"{100 * copy_us / (2 * sum(walls.values())):.0f}%" if step == "decode" else ""
                print(f"| {tname} | {label} | {step} | {kernels} | {syncs} | {waits} | {kernel_us:.0f} "
                      f"| {walls[step]:.0f} | {copy_us:.0f} | {share} | {names} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
