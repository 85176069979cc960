"""The C kernels (``dgpipe/compression/kernels/rows.c`` and ``codes.c``) built by each C compiler found here, and on
x86-64 for one instruction set at a time, timed side by side in one run against the installed build, with the
bytes checked against it.

Each compiler of :data:`COMPILERS` that is on ``PATH`` builds the extension with ``setup.py``'s own flags
(:func:`build_kernels`: ``python setup.py build_ext`` with ``CC`` set, into a temporary folder); every build
then runs the codebook codec's one-pass encode + decode (token groups, Hadamard rotation, bfloat16 scales; 2
and 4 bits: ``rows.c``), ``quant`` 8 and ``sortquant`` 6+2 (``codes.c``) on a MiniLM micro-batch (16x64x384)
and the 25.7 MB tensor, interleaved with the installed build and a clone of the tensor (``codec_speed.timed``:
medians). On x86-64 the default compiler (``cc``) also
builds the library for one level of the architecture alone (``-march=x86-64-v4``: AVX-512; ``-v3``: AVX2 and
FMA; ``-v2``: SSE4.2), with ``-DDGPIPE_ROWS_ONE_TARGET`` instead of the variants picked at load time, so that
a CPU without AVX-512 can be measured on one with it (:data:`ISA_LEVELS`). Prints a markdown table: ms per
round trip, the ratio to the installed build and to the AVX-512 build, and whether the payload and the decoded
tensor are bit-identical to the installed build's.

    python benchmarks/rows_compilers.py [--reps 15]     (Debian: apt-get install gcc-11 clang-14)
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from codec_speed import ONE_PASS_TENSORS, one_pass_data, roundtrip, same_payload, timed
from dgpipe.compression import get_codec
from dgpipe.compression.kernels import backend, compiled, rows

ROOT = Path(__file__).resolve().parents[1]
#: The compilers tried, oldest supported first (GCC 11+ and clang 14+ are the project's floor).
COMPILERS = ("gcc-11", "gcc-12", "gcc-13", "gcc-14", "clang-14", "clang-15", "clang-16", "clang-17", "clang-18",
             "clang-19")
#: x86-64 levels built alone (label -> -march), the first the reference of the "x AVX-512" column.
ISA_LEVELS = {"x86-64-v4 (AVX-512)": "x86-64-v4", "x86-64-v3 (AVX2)": "x86-64-v3", "x86-64-v2 (SSE4.2)": "x86-64-v2"}


def build_kernels(cc: str, out: Path, cflags: str = "") -> dict[str, Path]:
    """Build the C kernels (``codes.c``, ``rows.c``) with compiler ``cc`` and ``setup.py``'s flags (plus
    ``cflags``) into ``out``; the libraries' paths by extension name (``_codes``, ``_rows``).

    Raises:
        RuntimeError: the build failed or wrote no library (the message ends with the compiler's output).
    """
    env = {**os.environ, "CC": cc, "CFLAGS": f"{os.environ.get('CFLAGS', '')} {cflags}".strip()}
    env.pop("LDSHARED", None)  # linked by the same compiler
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out / "lib"),
                           "--build-temp", str(out / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True)
    found = {name: sorted((out / "lib").rglob(name + "*")) for name in ("_codes", "_rows")}
    if proc.returncode or not all(found.values()):
        raise RuntimeError(f"{cc} did not build the kernels:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return {name: paths[0] for name, paths in found.items()}


CODECS = {
    **{f"codebook {b}, token, Hadamard, bf16 scales": ("codebook", {"bits": b, "group": "token", "rotate": "hadamard",
                                                                  "scale_dtype": "bfloat16"}) for b in (2, 4)},
    "quant 8": ("quant", {"bits": 8}),
    "sortquant 6+2": ("sortquant", {"quant_bits": 6, "split_bits": 2}),
}
"""The codecs timed: the token codebook runs ``rows.c``, the others ``codes.c``."""


def open_libraries(paths: dict[str, Path]) -> dict:
    """The two libraries of one build, loaded with their ctypes signatures (by extension name)."""
    return {"_codes": compiled.open_library(str(paths["_codes"])), "_rows": rows.open_library(str(paths["_rows"]))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="timed rounds (medians)")
    args = parser.parse_args()
    if not (rows.available() and compiled.available()):
        print(backend.MISSING)
        return 1
    installed = {name: backend._libraries[name] for name in ("_codes", "_rows")}
    libs = {"installed": installed}
    with tempfile.TemporaryDirectory() as tmp:
        for cc in COMPILERS:
            if shutil.which(cc):
                print(f"building with {cc} ...", flush=True)
                libs[cc] = open_libraries(build_kernels(cc, Path(tmp) / cc))
        if platform.machine() in ("x86_64", "AMD64"):
            for label, march in ISA_LEVELS.items():
                print(f"building for {march} alone ...", flush=True)
                libs[label] = open_libraries(build_kernels("cc", Path(tmp) / march,
                                                           f"-march={march} -DDGPIPE_ROWS_ONE_TARGET"))
    kernels = {name: {} for name in libs}  # each build's own kernel cache (a cached kernel holds its library)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; builds: {', '.join(list(libs)[1:])}")
    print("| tensor | codec | library | ms, encode + decode | x installed | x AVX-512 | x a clone | same bytes |")
    print("|---|---|---|---|---|---|---|---|")
    wide = next(iter(ISA_LEVELS))
    tensors = {k: v for k, v in ONE_PASS_TENSORS.items() if "MobileNet" not in k}
    for label, (shape, kind) in tensors.items():
        x = one_pass_data(shape, kind)
        for codec_label, (name, opts) in CODECS.items():
            codec = get_codec(name, **opts)

            def run(build, c=codec):
                backend._libraries.update(libs[build])
                backend._kernels = kernels[build]
                try:
                    return roundtrip(c, x)
                finally:
                    backend._libraries.update(installed)

            fns = {"clone": x.clone, **{build: (lambda build=build: run(build)) for build in libs}}
            measured = timed(fns, args.reps, inner=1)
            clone, (base, (p0, y0)) = measured["clone"][0], measured["installed"]
            for build in libs:
                t, (p, y) = measured[build]
                same = same_payload(p, p0) and torch.equal(y, y0)
                isa = f"{t / measured[wide][0]:.2f}" if wide in measured else ""
                print(f"| {label} | {codec_label} | {build} | {t * 1e3:.3f} | {t / base:.2f} | {isa} "
                      f"| {t / clone:.1f} | {'yes' if same else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
