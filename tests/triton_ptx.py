"""Compile every Triton codec kernel ahead of time for NVIDIA GPUs -- no GPU needed -- and print
what its PTX does with floats, one JSON object per kernel and configuration.

Run without ``TRITON_INTERPRET`` (the interpreter builds no PTX); ``tests/test_fused_triton.py``
runs it in a subprocess and checks the output. Each configuration is compiled with the
launch's own options (:data:`dgpipe.compression.kernels.triton_codes.COMPILE_OPTIONS`) through
ptxas (Triton's wheel ships it), so a kernel that would not compile on a GPU fails here.

Usage::

    python tests/triton_ptx.py    # JSON lines: kernel, target, config, PTX float-op counts
"""

from __future__ import annotations

import json
import re
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dgpipe.compression.kernels import triton_buckets as tb
from dgpipe.compression.kernels import triton_codes as ft
from dgpipe.compression.kernels import triton_rows as tr
from test_fused import SORTQUANT as CPU_SORTQUANT  # this script's folder is on sys.path

BYTE_POINTERS = {"out_ptr", "packed_ptr"}
HALF_POINTERS = {"meta_ptr": "*bf16"}
SORTQUANT = [(q, s) for q, s in CPU_SORTQUANT if s] + [(2, 6)]  # the widths the tests run, and 64 buckets
FLOAT_OP = re.compile(r"\b((?:fma|div|add|sub|mul|cvt|sqrt)\.[a-z0-9.]*f(?:32|64))\b")


def configs():
    """``(kernel, constexprs)`` of the widths, bucket counts and groupings the codecs launch."""
    for bits in range(1, 17):
        grouped = bits % 2 == 0  # both kinds, across the widths
        yield ft._encode_uniform_kernel, {"GROUPED": grouped, "TOP": float((1 << bits) - 1), **ft._layout(bits)}
        yield ft._decode_uniform_kernel, {"GROUPED": not grouped, **ft._layout(bits)}
        yield ft._encode_message_kernel, {"TOP": float((1 << bits) - 1), "PB": ft.MAX_PARTS, **ft._layout(bits)}
    for rounds in (1, 4):
        yield ft._extrema_kernel, {"EB": ft.EXTREMA_BLOCK, "ROUNDS": rounds}
    for q, s in SORTQUANT:
        yield tb._encode_buckets_kernel, {"NB": (1 << s) - 1, "Q": q, **ft._layout(q + s)}
        yield tb._decode_buckets_kernel, {"Q": q, **ft._layout(q + s)}
        yield tb._bucket_maxima_kernel, {"NB": (1 << s) - 1}
        block, parts = tb.tiles(1 << s)
        yield tb._sampled_parts_kernel, {"NB": (1 << s) - 1, "NBP": 1 << s, "EB": block, "ROUNDS": 8}
        yield tb._encode_sampled_kernel, {"NB": (1 << s) - 1, "NBP": 1 << s, "PB": parts, "Q": q, **ft._layout(q + s)}
    for width, block, meta in ((64, 64, 1), (576, 64, 1), (384, 128, 2), (960, 64, 0), (4096, 4096, 0)):
        shape = tr._shape(width, block, True)
        for bits in range(1, 5):
            r, g, w = ft._layout(bits)["R"], ft._layout(bits)["G"], ft._layout(bits)["W"]
            yield tr._encode_kernel, {"WIDTH": width, "INV": 1.0 / block**0.5, "ROTATE": True, "META": meta,
                                      **tr._encode_shape(shape, width), "NM": (1 << bits) - 1, "R": r, "G": g, "W": w}
            yield tr._decode_kernel, {"WIDTH": width, "INV": 1.0 / block**0.5, "ROTATE": True, "R": r, "G": g, "W": w,
                                      **{k: shape[k] for k in ("RB", "NBP", "BLOCK", "LOG")}}
    for bits in range(1, 5):
        yield ft._encode_levels_kernel, {"NM": (1 << bits) - 1, **ft._layout(bits)}
        yield ft._decode_levels_kernel, {"GROUPED": bits % 2 == 0, **ft._layout(bits)}


def signature(kernel, constexprs: dict) -> dict[str, str]:
    return {name: "constexpr" if name in constexprs else "*u8" if name in BYTE_POINTERS else HALF_POINTERS[name]
            if name in HALF_POINTERS else "*fp32" if name.endswith("_ptr") else "i32" for name in kernel.arg_names}


def main() -> None:
    for kernel, constexprs in configs():
        for capability in (80, 90):
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature(kernel, constexprs), constexprs=constexprs),
                                      target=GPUTarget("cuda", capability, 32), options=dict(ft.COMPILE_OPTIONS))
            print(json.dumps({"kernel": kernel.fn.__name__, "sm": capability, "config": constexprs,
                              "float_ops": Counter(FLOAT_OP.findall(compiled.asm["ptx"])),
                              "cubin_bytes": len(compiled.asm["cubin"])}), flush=True)


if __name__ == "__main__":
    main()
