"""Fused GPU kernels (Triton) for the hot quantizers: values read once, packed codes written once.

The GPU twin of :mod:`.compiled` (whose kernels are CPU loops compiled from C). One
Triton program codes one chunk of :data:`.bitpack.CHUNK` values: it loads them as a
``(g, CHUNK / g)`` block -- lane ``l`` of the :mod:`.bitpack` layout is row ``l`` --
computes their codes, ORs the lanes into words (a sum over the lane axis: the bit
fields are disjoint) and stores the words' bytes, plane by plane; decoding reverses
it. The reference torch steps do the same in a chain of whole-tensor kernels, each a
pass over memory.

- :func:`encode_uniform` / :func:`decode_uniform`: ``quant`` per tensor or per group
  (:mod:`.uniform`), and sort quantization with one bucket (more buckets: :mod:`.triton_buckets`);
- :func:`encode_message`: ``quant`` with one grid, its range included, in two launches and without
  reading anything back to the host (a message's encode never waits for the GPU);
- :func:`encode_levels` / :func:`decode_levels`: the codebook codec's nearest level and
  ``level * scale`` (:mod:`.levels`).

Same float32 operations as the reference torch steps, in the same order, so the bytes are
meant to be identical to it: division with IEEE rounding (``tl.math.div_rn``; Triton's
``/`` on NVIDIA GPUs is an approximate division), rounding half to even like
``torch.round`` (adding and subtracting ``1.5 * 2**23``, exact below ``2**22``, and
codes are clamped far below that), and no fused multiply-add (``enable_fp_fusion=False``:
``lo + code * step`` rounds twice, as torch's two kernels do). Under Triton's own
interpreter (``TRITON_INTERPRET=1`` before Triton is imported, then :func:`run_on_cpu`)
the kernels run on CPU tensors with numpy's IEEE float32 arithmetic: that is how
``tests/test_fused_triton.py`` checks them against the reference, byte for byte,
without a GPU; with one it checks the compiled kernels on it. ``tests/triton_ptx.py``
compiles every kernel ahead of time for sm_80/sm_90 (no GPU needed) and the tests check
that the PTX does only IEEE-rounded float operations (``/`` would compile to the
approximate ``div.full.f32``).

Compilation: once per kernel and code width (and grouped or not), on first use; the
lengths are not specialised on (``do_not_specialize``), so a last partial batch or
another sequence length reuses the compiled kernel.

Scope: float32 values in wire order with at least :data:`.backend.MIN_VALUES` of them,
rounding to nearest; codes of 1..16 bits (codebooks up to :data:`.compiled.MAX_LEVEL_BITS`).
The whole chunks come from here, the ``n % CHUNK`` tail from the reference (the
calling steps). Each function returns False where it does not apply
(Triton missing, or a compilation or launch of that kernel that failed: one
``RuntimeWarning``, then that kernel stays off, :func:`.backend.failure`), and the calling
step runs the reference.

Reference: Tillet et al., "Triton: an intermediate language and compiler for tiled
neural network computations", MAPL 2019; the layout is :mod:`.bitpack`'s and the
arithmetic that of :mod:`.uniform`, :mod:`.buckets` and :mod:`.levels`.
"""

from __future__ import annotations

import functools
import os

import torch

from .backend import failure, failed_kernels
from .bitpack import CHUNK, layout_planes, layout_word, packed_nbytes

__all__ = [
    "COMPILE_OPTIONS", "EXTREMA_BLOCK", "MAX_PARTS", "available", "interpreting", "run_on_cpu", "launch",
    "encode_message",
    "encode_uniform", "decode_uniform", "encode_levels", "decode_levels",
]

try:  # a CUDA build of torch brings Triton; a CPU build needs it only to run the interpreter
    import triton
    import triton.language as tl
except Exception:  # absent, or broken (e.g. a mismatched CUDA toolkit): the reference
    triton = None

_state = {"cpu": False}


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1`` when Triton was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0", "false", "no", "off")


def run_on_cpu(flag: bool) -> bool:
    """Also take CPU tensors (instead of :mod:`.compiled`'s C kernels), run by Triton's interpreter:
    how the GPU kernels are tested without a GPU. Returns the previous setting.

    Raises:
        RuntimeError: turning it on without Triton, or with the interpreter off (``TRITON_INTERPRET=1``
            must be set before Triton is imported: its own library functions are built at import).
    """
    if flag and (triton is None or not interpreting()):
        raise RuntimeError("running the Triton kernels on CPU needs Triton and TRITON_INTERPRET=1 "
                           "set before Triton is imported")
    previous, _state["cpu"] = _state["cpu"], bool(flag)
    return previous


def available(t: torch.Tensor) -> bool:
    """Whether these kernels take tensors on ``t``'s device: Triton imported and a CUDA
    tensor (or a CPU one after :func:`run_on_cpu`)."""
    if triton is None:
        return False
    return t.device.type == "cuda" or (t.device.type == "cpu" and _state["cpu"])


COMPILE_OPTIONS = {"enable_fp_fusion": False}
"""Triton compile options of every launch: no fused multiply-add (``lo + code * step`` rounds twice, as the
reference's separate kernels do)."""


def launch(name: str, kernel, grid: tuple[int, ...], *args, **constexprs) -> bool:
    """Run ``kernel[grid](*args, **constexprs)`` with :data:`COMPILE_OPTIONS`; False if kernel ``name`` cannot
    run (:func:`.backend.failure`: one warning, then the reference for this kernel from then on)."""
    key = ("triton_" + name,)
    if key in failed_kernels():
        return False
    try:
        kernel[grid](*args, **COMPILE_OPTIONS, **constexprs)
        return True
    except Exception as e:  # a compilation or launch error
        return failure(key, e, "Triton codec kernel")


def _run(name: str, kernel, t: torch.Tensor, *args, **constexprs) -> bool:
    """:func:`launch` ``kernel`` with one program per whole chunk of ``t`` (the tensor read or written
    chunk by chunk); False where the kernels do not apply to ``t`` (device, no whole chunk, not contiguous)."""
    chunks = t.numel() // CHUNK
    if not (available(t) and chunks and t.is_contiguous()):
        return False
    return launch(name, kernel, (chunks,), *args, **constexprs)


@functools.lru_cache(maxsize=64)
def _layout(bits: int) -> dict[str, int]:
    """The constexprs of the :mod:`.bitpack` layout of ``bits``-bit codes (K low-byte planes, R top bits
    in words of G lanes, W bytes each); one dict per width (do not modify it)."""
    k, r = layout_planes(bits)
    g, w = layout_word(r)[:2]
    return {"K": k, "R": r, "G": g, "W": w}


if triton is not None:
    _ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: (v + _ROUND) - _ROUND rounds v half to even for |v| < 2**22
    _CHUNK = tl.constexpr(CHUNK)

    @triton.jit
    def _lanes(c, G: tl.constexpr):
        """Indices ``(G, CHUNK / G)`` of chunk ``c``'s values: lane ``l`` is row ``l``."""
        return c * _CHUNK + tl.arange(0, G)[:, None] * (_CHUNK // G) + tl.arange(0, _CHUNK // G)[None, :]

    @triton.jit
    def _pack(out_ptr, codes, c, n, K: tl.constexpr, R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
        """Store chunk ``c``'s int32 codes ``(G, CHUNK / G)`` into the uint8 stream of ``n`` codes."""
        CG: tl.constexpr = _CHUNK // G
        lane = tl.arange(0, G)[:, None]
        if K:  # bits > 8: byte 0 of every code goes to the plane before the chunks
            tl.store(out_ptr + c * _CHUNK + lane * CG + tl.arange(0, CG)[None, :], (codes & 255).to(tl.uint8))
            codes = codes >> 8
        if W > 4:
            word = tl.sum(codes.to(tl.int64) << (lane * R).to(tl.int64), axis=0)
        else:
            word = tl.sum(codes << (lane * R), axis=0)
        base = K * n + c * (_CHUNK * R // 8)
        j = tl.arange(0, CG)
        for q in tl.static_range(W):
            tl.store(out_ptr + base + q * CG + j, ((word >> (8 * q)) & 255).to(tl.uint8))

    @triton.jit
    def _unpack(packed_ptr, c, n, K: tl.constexpr, R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
        """Chunk ``c``'s codes ``(G, CHUNK / G)``, int32, from the uint8 stream of ``n`` codes."""
        CG: tl.constexpr = _CHUNK // G
        lane = tl.arange(0, G)[:, None]
        j = tl.arange(0, CG)
        base = K * n + c * (_CHUNK * R // 8)
        if W > 4:
            word = tl.zeros((CG,), tl.int64)
            for q in tl.static_range(W):
                word |= tl.load(packed_ptr + base + q * CG + j).to(tl.int64) << (8 * q)
            codes = ((word[None, :] >> (lane * R).to(tl.int64)) & ((1 << R) - 1)).to(tl.int32)
        else:
            word = tl.zeros((CG,), tl.int32)
            for q in tl.static_range(W):
                word |= tl.load(packed_ptr + base + q * CG + j).to(tl.int32) << (8 * q)
            codes = (word[None, :] >> (lane * R)) & ((1 << R) - 1)
        if K:
            codes = (codes << 8) | tl.load(packed_ptr + c * _CHUNK + lane * CG + j[None, :]).to(tl.int32)
        return codes

    @triton.jit
    def _group(i, group_len, GROUPED: tl.constexpr):
        """The group of each value index (0 for one group: no integer division)."""
        if GROUPED:
            grp = i // group_len
        else:
            grp = tl.zeros(i.shape, tl.int64)
        return grp

    @triton.jit(do_not_specialize=["n", "group_len"])
    def _encode_uniform_kernel(x_ptr, lo_ptr, div_ptr, out_ptr, n, group_len, GROUPED: tl.constexpr,
                               TOP: tl.constexpr, K: tl.constexpr, R: tl.constexpr, G: tl.constexpr,
                               W: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        i = _lanes(c, G)
        grp = _group(i, group_len, GROUPED)
        v = tl.math.div_rn(tl.load(x_ptr + i) - tl.load(lo_ptr + grp), tl.load(div_ptr + grp))
        v = (v + _ROUND) - _ROUND
        v = tl.minimum(tl.maximum(v, 0.0), TOP)
        _pack(out_ptr, v.to(tl.int32), c, n, K, R, G, W)

    @triton.jit(do_not_specialize=["n", "group_len"])
    def _decode_uniform_kernel(packed_ptr, lo_ptr, step_ptr, y_ptr, n, group_len, GROUPED: tl.constexpr,
                               K: tl.constexpr, R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        i = _lanes(c, G)
        grp = _group(i, group_len, GROUPED)
        codes = _unpack(packed_ptr, c, n, K, R, G, W).to(tl.float32)
        tl.store(y_ptr + i, tl.load(lo_ptr + grp) + codes * tl.load(step_ptr + grp))

    @triton.jit(do_not_specialize=["n", "parts"])
    def _extrema_kernel(x_ptr, part_ptr, n, parts, EB: tl.constexpr, ROUNDS: tl.constexpr):
        """Program ``p``'s min, max and NaN flag (1.0 if it saw a NaN) of blocks ``p, p + parts, ...`` of
        ``EB`` values (``ROUNDS`` of them, a constant: a loop bound read from an argument fails under the
        interpreter with numpy 2): ``part[p]``, ``part[parts + p]``, ``part[2 * parts + p]``."""
        p = tl.program_id(0)
        lo = tl.full((EB,), float("inf"), tl.float32)
        hi = tl.full((EB,), float("-inf"), tl.float32)
        nan = tl.zeros((EB,), tl.int32)
        for r in range(ROUNDS):
            i = (r * parts + p) * EB + tl.arange(0, EB)
            m = i < n
            v = tl.load(x_ptr + i, mask=m, other=0.0)
            lo = tl.where(m, tl.minimum(lo, v), lo)
            hi = tl.where(m, tl.maximum(hi, v), hi)
            nan = tl.maximum(nan, (m & (v != v)).to(tl.int32))
        tl.store(part_ptr + p, tl.min(lo, axis=0))
        tl.store(part_ptr + parts + p, tl.max(hi, axis=0))
        tl.store(part_ptr + 2 * parts + p, tl.max(nan, axis=0).to(tl.float32))

    @triton.jit(do_not_specialize=["n", "parts"])
    def _encode_message_kernel(x_ptr, part_ptr, grid_ptr, out_ptr, n, parts, TOP: tl.constexpr,
                               PB: tl.constexpr, K: tl.constexpr, R: tl.constexpr, G: tl.constexpr,
                               W: tl.constexpr):
        """The grid of the whole tensor from the partial extrema (every program reduces them itself: no
        second pass, no read back), written by program 0 as ``grid = [lo, step, div]``; then chunk
        ``c``'s codes, as :func:`_encode_uniform_kernel`. A NaN anywhere makes the step NaN."""
        c = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, PB)
        m = j < parts
        lo = tl.min(tl.load(part_ptr + j, mask=m, other=float("inf")), axis=0)
        hi = tl.max(tl.load(part_ptr + parts + j, mask=m, other=float("-inf")), axis=0)
        nan = tl.max(tl.load(part_ptr + 2 * parts + j, mask=m, other=0.0), axis=0)
        step = tl.math.div_rn(hi - lo, TOP)
        step = tl.where(nan > 0, float("nan"), step)
        div = tl.where(step > 0, step, 1.0)
        k = tl.arange(0, 4)
        tl.store(grid_ptr + k, tl.where(k == 0, lo, tl.where(k == 1, step, div)), mask=k + 3 * c < 3)  # program 0 only
        i = _lanes(c, G)
        v = tl.math.div_rn(tl.load(x_ptr + i) - lo, div)
        v = (v + _ROUND) - _ROUND
        v = tl.minimum(tl.maximum(v, 0.0), TOP)
        _pack(out_ptr, v.to(tl.int32), c, n, K, R, G, W)

    @triton.jit(do_not_specialize=["n"])
    def _encode_levels_kernel(v_ptr, mids_ptr, out_ptr, n, NM: tl.constexpr,
                              K: tl.constexpr, R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        v = tl.load(v_ptr + _lanes(c, G))
        codes = tl.zeros(v.shape, tl.int32)
        for j in tl.static_range(NM):  # torch.bucketize(v, mids): the midpoints below v
            codes += (v > tl.load(mids_ptr + j)).to(tl.int32)
        _pack(out_ptr, codes, c, n, K, R, G, W)

    @triton.jit(do_not_specialize=["n", "group_len"])
    def _decode_levels_kernel(packed_ptr, table_ptr, scale_ptr, y_ptr, n, group_len, GROUPED: tl.constexpr,
                              K: tl.constexpr, R: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        i = _lanes(c, G)
        codes = _unpack(packed_ptr, c, n, K, R, G, W)
        tl.store(y_ptr + i, tl.load(table_ptr + codes) * tl.load(scale_ptr + _group(i, group_len, GROUPED)))


def encode_uniform(x: torch.Tensor, lo: torch.Tensor, div: torch.Tensor, bits: int, group_len: int,
                   out: torch.Tensor) -> bool:
    """:func:`.compiled.encode_uniform` on the GPU: ``clamp(round((x - lo[g]) / div[g]), 0, 2**bits - 1)``
    of the whole chunks of ``x``, packed into ``out``.

    Args:
        x: 1-D float32, ``n`` values in wire order (contiguous), on the GPU.
        lo, div: float32 ``(n_groups,)`` on ``x``'s device; group ``i // group_len`` holds value ``i``.
        bits: code width, 1..16.
        group_len: values per group (``n`` for one group).
        out: uint8 ``(ceil(n * bits / 8),)`` on ``x``'s device; codes ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where it does not apply (the caller runs the reference).
    """
    return _run("encode_uniform", _encode_uniform_kernel, x, x, lo.reshape(-1).contiguous(),
                div.reshape(-1).contiguous(), out, x.numel(), group_len, GROUPED=group_len < x.numel(),
                TOP=float((1 << bits) - 1), **_layout(bits))


EXTREMA_BLOCK = 4 * CHUNK
"""Values per block of :func:`encode_message`'s first kernel."""

MAX_PARTS = 1024
"""Most programs of :func:`encode_message`'s first kernel: every program of the second reads their partial
extrema (12 KiB at most)."""


def encode_message(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One grid over all of ``x`` and its packed codes in two kernel launches, nothing read back to the host:
    the partial extrema, then every chunk coded by a program that reduces them itself.

    Same float32 operations as the reference (:func:`.uniform.uniform_message`: ``lo = min``,
    ``step = (max - lo) / (2**bits - 1)``, codes :func:`.uniform.grid_levels`), so the same bytes. The
    range is not checked here (that would read it back): a NaN makes the step NaN and an infinite value or
    a range past float32 an infinite one, which the decoder refuses (:func:`.uniform.finite_grid`).

    Args:
        x: 1-D float32, contiguous, on the GPU (or CPU under :func:`run_on_cpu`).
        bits: code width, 1..16.

    Returns:
        ``(grid, out)``: float32 ``(3,)`` ``[lo, step, div]`` on ``x``'s device (``grid[:2]`` is the metadata
        sent, ``div`` the step with a zero replaced by 1) and the uint8 code stream with codes
        ``0 .. n - n % CHUNK`` written (the tail is the caller's); None where it does not apply (then the
        caller runs the reference).
    """
    n = x.numel()
    if not (available(x) and n >= CHUNK and x.is_contiguous() and n < 2**31 - MAX_PARTS * EXTREMA_BLOCK):
        return None
    parts = min(MAX_PARTS, -(-n // EXTREMA_BLOCK))
    part = torch.empty(3 * parts, dtype=torch.float32, device=x.device)
    grid = torch.empty(3, dtype=torch.float32, device=x.device)
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    if not (launch("extrema", _extrema_kernel, (parts,), x, part, n, parts, EB=EXTREMA_BLOCK,
                    ROUNDS=1 << (-(-n // (parts * EXTREMA_BLOCK)) - 1).bit_length()) and
            launch("encode_message", _encode_message_kernel, (n // CHUNK,), x, part, grid, out, n, parts,
                    TOP=float((1 << bits) - 1), PB=MAX_PARTS, **_layout(bits))):
        return None
    return grid, out


def decode_uniform(packed: torch.Tensor, bits: int, lo: torch.Tensor, step: torch.Tensor, group_len: int,
                   y: torch.Tensor) -> bool:
    """:func:`.compiled.decode_uniform` on the GPU: ``y[i] = lo[g] + code[i] * step[g]`` for the whole chunks.

    Args:
        packed: uint8 stream of ``n = y.numel()`` codes of ``bits`` bits, on the GPU.
        lo, step: float32 ``(n_groups,)`` on the same device.
        group_len: values per group.
        y: float32 ``(n,)`` output (contiguous); values ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where it does not apply.
    """
    return _run("decode_uniform", _decode_uniform_kernel, y, packed, lo.reshape(-1).contiguous(),
                   step.reshape(-1).contiguous(), y, y.numel(), group_len, GROUPED=group_len < y.numel(),
                   **_layout(bits))


def encode_levels(v: torch.Tensor, mids: torch.Tensor, bits: int, out: torch.Tensor) -> bool:
    """:func:`.compiled.encode_levels` on the GPU: the nearest level's index ``#{j : v > mids[j]}`` of the whole
    chunks of ``v``, packed into ``out``.

    Args:
        v: 1-D float32 values (scaled), wire order, contiguous, on the GPU.
        mids: float32 ``(2**bits - 1,)`` ascending midpoints, on ``v``'s device.
        bits: 1..:data:`.compiled.MAX_LEVEL_BITS`.
        out: uint8 stream of ``v.numel()`` codes on ``v``'s device (the tail is left to the caller).

    Returns:
        True if done; False where it does not apply.
    """
    return _run("encode_levels", _encode_levels_kernel, v, v, mids.contiguous(), out, v.numel(), NM=(1 << bits) - 1,
                   **_layout(bits))


def decode_levels(packed: torch.Tensor, bits: int, table: torch.Tensor, scale: torch.Tensor, group_len: int,
                  y: torch.Tensor) -> bool:
    """:func:`.compiled.decode_levels` on the GPU: ``y[i] = table[code[i]] * scale[i // group_len]`` (whole chunks).

    Args:
        packed: uint8 stream of ``n = y.numel()`` codes of ``bits`` bits, on the GPU.
        table: float32 ``(2**bits,)`` levels; scale: float32 ``(n_groups,)``; both on the same device.
        group_len: values per group.
        y: float32 ``(n,)`` output (contiguous); values ``0 .. n - n % CHUNK`` are written.

    Returns:
        True if done; False where it does not apply.
    """
    return _run("decode_levels", _decode_levels_kernel, y, packed, table.contiguous(),
                scale.reshape(-1).contiguous(), y, y.numel(), group_len, GROUPED=group_len < y.numel(), **_layout(bits))
