"""The Triton kernels (dgpipe.compression.kernels.triton_codes) against the reference torch path.

With a GPU they run compiled, on CUDA tensors; without one on CPU tensors under
Triton's own interpreter (``TRITON_INTERPRET=1``, set by conftest.py before Triton is
imported; numpy's IEEE float32 arithmetic, like torch's CPU ops). Payloads must be
byte-identical and decoded tensors bit-identical to the eager path's on the same device,
the Triton path must really be taken, and a failing launch must fall back to the reference
for that kernel alone, with one warning.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dgpipe.compression import get_codec
from dgpipe.compression.kernels import backend, dispatch
from dgpipe.compression.kernels.bitpack import CHUNK
from dgpipe.compression.steps.hadamard import HadamardRotation
from dgpipe.compression.kernels import BucketIndex
from dgpipe.compression.kernels.buckets import sample_size
from test_fused import CODEBOOK, QUANT, SORTQUANT, codebook_inputs, eager_and_fused, tensors  # noqa: F401 (a fixture)

pytest.importorskip("triton", exc_type=ImportError)  # also a Triton that is installed but fails to import
from dgpipe.compression.kernels import triton_codes as fused_triton  # noqa: E402
from dgpipe.compression.kernels import triton_buckets, triton_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROW_KERNELS = ("encode_rows", "decode_rows")
KERNELS = ("encode_message", "encode_uniform", "decode_uniform", "encode_levels", "decode_levels")
BUCKET_KERNELS = ("encode_sampled", "encode_buckets", "decode_buckets")
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not fused_triton.interpreting(),
                                reason="no GPU, and Triton's interpreter was off when Triton was imported")


@pytest.fixture(scope="module", autouse=True)
def triton_on_cpu():
    """Without a GPU: the Triton kernels take CPU tensors (interpreted) for this module's tests."""
    previous = fused_triton.run_on_cpu(DEVICE == "cpu")
    yield
    fused_triton.run_on_cpu(previous)


def data(seed: int) -> dict[str, torch.Tensor]:
    """:func:`test_fused.tensors` on this module's device."""
    return {name: x.to(DEVICE) for name, x in tensors(seed).items()}


@pytest.fixture
def taken(monkeypatch):
    """Counts the Triton kernel calls that ran (returned True or a result), by name."""
    counts: dict[str, int] = {}
    for module, names in ((fused_triton, KERNELS), (triton_rows, ROW_KERNELS), (triton_buckets, BUCKET_KERNELS)):
        for name in names:
            def spy(*args, _real=getattr(module, name), _name=name):
                done = _real(*args)
                counts[_name] = counts.get(_name, 0) + (done is not None and done is not False)
                return done

            monkeypatch.setattr(module, name, spy)
    return counts


@pytest.mark.parametrize("opts", QUANT, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_quant_triton_equals_eager(eager_and_fused, taken, opts):
    codec = get_codec("quant", **opts)
    for name, x in data(seed=4).items():
        if name == "wide" and opts.get("scale_dtype") == "float16":
            continue  # refused by both paths: the ranges overflow float16 scales
        if opts.get("group") == "token" and x.dim() < 2:
            x = x[: x.numel() // 64 * 64].view(-1, 64)
        eager_and_fused(codec, x)
    encodes = taken.get("encode_message", 0) + taken.get("encode_uniform", 0)  # one grid / a grid per group
    assert encodes >= 10 and taken.get("decode_uniform", 0) >= 10, taken


@pytest.mark.parametrize("qs", SORTQUANT + [(2, 6)], ids=lambda qs: f"{qs[0]}+{qs[1]}")
def test_sortquant_triton_equals_eager(eager_and_fused, taken, qs):
    """Also 64 buckets, beyond the CPU kernels' 16."""
    q, s = qs
    codec = get_codec("sortquant", quant_bits=q, split_bits=s)
    for x in data(seed=5).values():
        eager_and_fused(codec, x)
    kind = "buckets" if s else "uniform"
    encodes = taken.get(f"encode_{kind}", 0) + taken.get("encode_sampled", 0)
    assert encodes >= 10 and taken.get(f"decode_{kind}", 0) >= 10, taken
    if s:
        assert taken.get("encode_sampled", 0) >= 1, taken  # the sampled splits: two launches


@pytest.mark.parametrize("opts", CODEBOOK, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_codebook_triton_equals_eager(eager_and_fused, taken, opts):
    codec = get_codec("codebook", **opts)
    for t in codebook_inputs(data(seed=6), opts):
        eager_and_fused(codec, t)
    if opts.get("group") == "token" and opts["levels"] == "normal":  # rotation to packing in two launches
        assert taken.get("encode_rows", 0) >= 7 and taken.get("decode_rows", 0) >= 7, taken
    else:
        assert taken.get("encode_levels", 0) >= 7 and taken.get("decode_levels", 0) >= 7, taken


@pytest.mark.parametrize("name", ["randn", "relu_ties", "integers", "constant", "signed_zeros", "outliers"])
def test_bucket_maxima_equal_the_eager_scatter_reduce(name):
    """The maxima of a sampled split (GPU path): ``max(min, values)`` per bucket, empty buckets at their min,
    a zero max as +0.0, as the eager ``scatter_reduce`` gives them -- bit for bit."""
    flat = data(seed=7)[name].reshape(-1).contiguous()
    for buckets in (2, 4, 16, 64):
        s = torch.sort(flat[:: 7]).values
        bounds = s[torch.arange(1, buckets, device=DEVICE) * s.numel() // buckets]
        mins = torch.cat((flat.min().view(1), bounds))
        want = mins.clone().scatter_reduce_(0, BucketIndex(bounds)(flat), flat, "amax") + 0.0
        got = triton_buckets.bucket_maxima(flat, bounds, mins)
        assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32)), (buckets, got, want)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU routing")
def test_cpu_tensors_go_to_triton_only_when_asked():
    x = torch.randn(3 * CHUNK)
    assert dispatch.choose(x) == "triton"
    fused_triton.run_on_cpu(False)
    try:
        assert dispatch.choose(x) == "c"
    finally:
        fused_triton.run_on_cpu(True)
    previous = backend.set_enabled(False)
    try:
        assert dispatch.choose(x) == "torch"
    finally:
        backend.set_enabled(previous)


def test_not_applicable_returns_false():
    small, out = torch.randn(CHUNK - 1, device=DEVICE), torch.empty(CHUNK, dtype=torch.uint8, device=DEVICE)
    assert not fused_triton.encode_uniform(small, small[:1], small[:1], 8, small.numel(), out)
    strided = torch.randn(2 * CHUNK, 2, device=DEVICE)[:, 0]
    assert not fused_triton.encode_uniform(strided, strided[:1], strided[:1], 8, strided.numel(), out)


def test_launch_failure_falls_back_with_one_warning(monkeypatch):
    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no ptxas here")

            return launch

    monkeypatch.setattr(fused_triton, "_encode_message_kernel", Broken())
    monkeypatch.setattr(backend, "_failed", set())
    x = torch.randn(5 * CHUNK + 1, device=DEVICE)
    codec = get_codec("quant", bits=8)
    with pytest.warns(RuntimeWarning, match="Triton codec kernel triton_encode_message unavailable.*no ptxas here"):
        p = codec.encode(x)
    assert backend.failed_kernels() == {("triton_encode_message",)}  # that kernel alone, for the rest of the process
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only one warning
        y = codec.decode(p)
        get_codec("sortquant", quant_bits=6, split_bits=2).encode(x)
    previous = backend.set_enabled(False)
    try:
        ref = codec.encode(x)
    finally:
        backend.set_enabled(previous)
    assert all(torch.equal(a, b) for a, b in zip(p.tensors, ref.tensors)) and torch.equal(y, codec.decode(ref))


#: The float instructions the kernels may use: IEEE-rounded float32 add, subtract, multiply and divide (torch's CUDA
#: kernels use the same), int -> float conversion, truncation of an integral float to int; the row scales' float64
#: add, multiply, divide and square root (all IEEE-rounded), exact widenings and rounding-to-nearest narrowings.
ALLOWED_FLOAT_OPS = {"add.rn.f32", "sub.rn.f32", "mul.rn.f32", "div.rn.f32", "cvt.rn.f32", "cvt.rzi.s32.f32",
                     "add.rn.f64", "mul.rn.f64", "div.rn.f64", "sqrt.rn.f64", "cvt.f64.f32", "cvt.f32",
                     "cvt.rn.f32.f64", "cvt.rn.bf16.f32", "cvt.rn.f16.f32"}


def test_kernels_compile_for_nvidia_gpus_with_ieee_division_and_no_fma():
    """Every kernel, at every width, bucket count and grouping the codecs launch, compiles ahead of time for
    sm_80 and sm_90 (Triton's own ptxas; no GPU needed), and its PTX does only IEEE-rounded float operations:
    no fused multiply-add, no approximate division -- the operations the interpreted tests above check, so
    the compiled kernels give the same bytes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter builds no PTX
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_ptx.py"))], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert {r["kernel"] for r in rows} == {name for module in (fused_triton, triton_rows, triton_buckets)
                                           for name in vars(module) if name.endswith("_kernel")}
    assert {r["sm"] for r in rows} == {80, 90} and len(rows) >= 120
    for r in rows:
        ops = r["float_ops"]
        assert set(ops) <= ALLOWED_FLOAT_OPS, r
        if r["kernel"] in ("_encode_uniform_kernel", "_encode_message_kernel", "_encode_buckets_kernel",
                           "_encode_kernel", "_encode_sampled_kernel"):
            assert ops.get("div.rn.f32", 0) > 0, r


@pytest.mark.parametrize("shape, bits, scale_dtype, rotate", [
    ((3, 40, 56), 2, "bfloat16", "hadamard"),  # padded to 64
    ((7, 576), 4, "bfloat16", "hadamard"),  # 9 blocks of 64: odd factor 9; a tail
    ((2, 9, 384), 3, "float16", "hadamard"),  # 3 blocks of 128; 3-bit codes across bytes in the tail
    ((5, 960), 1, "float32", "hadamard"),  # odd factor 15
    ((3, 4096), 4, "float32", "hadamard"),  # one row per program
    ((4, 11, 384), 2, "bfloat16", "none"),
    ((6, 33, 100), 4, "float32", "none"),  # odd factor 25: the steps
])
def test_token_rows_in_one_launch_equal_the_steps(eager_and_fused, taken, shape, bits, scale_dtype, rotate):
    """Rotation, RMS scale (float64 pairwise fold), rounding to the scale dtype, levels and packing fused on the
    GPU: the steps' bytes, for widths with odd factors 1 to 15, tails of every kind, no rotation."""
    codec = get_codec("codebook", bits=bits, group="token", rotate=rotate, scale_dtype=scale_dtype)
    g = torch.Generator().manual_seed(sum(shape) + bits)
    for x in (torch.randn(shape, generator=g), torch.randn(shape, generator=g) * torch.rand(shape, generator=g) ** 4,
              torch.randn(shape, generator=g) * 1e-30):
        eager_and_fused(codec, x.to(DEVICE))
    width = shape[-1] if rotate == "none" else HadamardRotation(shape[-1]).width
    if width // (width & -width) <= triton_rows.MAX_ODD:
        assert taken.get("encode_rows", 0) == 3 and taken.get("decode_rows", 0) == 3, taken
    else:
        assert not taken.get("encode_rows", 0), taken


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_token_rows_send_a_scale_that_is_not_finite_and_the_decoder_refuses_it(bad):
    x = torch.randn(4, 256, device=DEVICE)
    x[2, 17] = bad
    codec = get_codec("codebook", bits=2, group="token", rotate="hadamard", scale_dtype="bfloat16")
    p = codec.encode(x)  # nothing read back: no check here
    with pytest.raises(ValueError, match="grid that is not finite"):
        codec.decode(p)


@pytest.fixture
def launches(monkeypatch):
    """The names of the Triton launches that ran, in order."""
    names: list[str] = []
    real = fused_triton.launch

    def spy(name, *args, **constexprs):
        names.append(name)
        return real(name, *args, **constexprs)

    for module in (fused_triton, triton_rows, triton_buckets):
        monkeypatch.setattr(module, "launch", spy)
    return names


@pytest.mark.parametrize("options", [{"bits": 4, "group": "token", "rotate": "hadamard"},
                                     {"bits": 2, "group": "token", "rotate": "hadamard"},
                                     {"bits": 4, "group": "token", "scale_dtype": "float16"}])
def test_token_rows_encode_in_one_launch_with_the_golden_bytes(launches, options):
    """The one-pass low-bit kernel: signs, butterflies, the row scale, levels and packing in one launch per
    encode and one per decode, giving the golden payloads' bytes (pinned for the reference and the C path)."""
    from test_golden_payloads import GOLDEN, cases, run_case

    golden = json.loads(GOLDEN.read_text())
    picked = {k: v for k, v in cases().items() if v[0] == "codebook" and v[1] == options and v[2] in ("minilm", "odd")}
    assert picked
    for key, case in picked.items():
        launches.clear()
        assert run_case(*case) == golden[key], key
        assert launches == ["encode_rows", "decode_rows"], (key, launches)


@pytest.mark.parametrize("qs", [(6, 2), (3, 1), (2, 6)])
def test_sortquant_encodes_a_sampled_split_in_two_launches_with_the_golden_bytes(launches, qs):
    """The sampled split: partial bucket maxima, then the grid and the codes, two Triton launches (after the
    sample's gather and sort), decoded in one; the golden payloads' bytes where they are pinned, the eager
    path's otherwise."""
    from test_golden_payloads import GOLDEN, SHAPES, cases, run_case

    golden = json.loads(GOLDEN.read_text())
    options = {"quant_bits": qs[0], "split_bits": qs[1]}
    picked = {k: v for k, v in cases().items() if v[0] == "sortquant" and v[1] == options and v[2] in ("tail", "large")}
    assert picked
    for key, case in picked.items():
        launches.clear()
        assert run_case(*case) == golden[key], key
        n = math.prod(SHAPES[case[2]])
        sampled = sample_size(n, 1 << qs[1]) < n  # else the exact split: the whole tensor sorted, one launch
        want = ["sampled_parts", "encode_sampled"] if sampled else ["encode_buckets"]
        assert launches == want + ["decode_buckets"], (key, launches)
    codec = get_codec("sortquant", **options)
    x = torch.randn(40 * CHUNK + 7, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    launches.clear()
    payload = codec.encode(x)
    assert launches == ["sampled_parts", "encode_sampled"], launches
    previous = backend.set_enabled(False)
    try:
        ref = codec.encode(x)
    finally:
        backend.set_enabled(previous)
    assert all(torch.equal(a, b) for a, b in zip((payload.header, *payload.tensors), (ref.header, *ref.tensors)))
