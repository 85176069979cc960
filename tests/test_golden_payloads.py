"""Golden payloads: the wire bytes of every codec, option set and dtype, pinned.

Each case encodes a fixed input (from numpy's PCG64 generator, stable across versions)
and compares the SHA-256 of the payload -- header and every tensor, with its dtype --
and of the decoded tensor with ``tests/fixtures/golden_payloads.json``. Every case runs
with the compiled kernels on and off: whichever backend runs a step, the bytes are the
same. Stateful codecs (error feedback, delta) run a short sequence of messages.

The codecs that factor a matrix (:data:`FACTORED`: ATOMO's SVD, low-rank and subspace
iteration) send factors whose last bits depend on how the BLAS sums its products -- the CPU's
vector width, the library's kernels, the thread count -- so no byte string is the same on every
machine. For them the golden record pins the size and the header (codec, shape, layout), and on
the machine at hand the payload must be the same with the compiled kernels on and off.

A change that alters these bytes changes the wire format: regenerate the file on purpose
only, with ``python tests/test_golden_payloads.py --write``, and say so.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dgpipe.compression import DeltaCache, DeltaCoder, ErrorFeedback, Payload, get_codec
from dgpipe.compression.kernels import set_enabled

GOLDEN = Path(__file__).parent / "fixtures" / "golden_payloads.json"
#: Codecs whose payload values come from a matrix factorisation (BLAS-dependent rounding; module doc).
FACTORED = ("atomo", "lowrank", "subspace")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def make_input(shape: tuple[int, ...], kind: str, dtype: torch.dtype) -> torch.Tensor:
    """A fixed tensor of ``shape``: ``randn``, ``outliers`` (1% of features x30, as a transformer's
    hidden state), ``relu`` (60% exact zeros) or ``ints`` (small integers)."""
    rng = np.random.Generator(np.random.PCG64(sum(shape) * 31 + len(kind)))
    x = rng.standard_normal(shape, dtype=np.float32) if shape else np.float32(rng.standard_normal())
    x = np.asarray(x, dtype=np.float32)
    if kind == "outliers" and x.ndim:
        x[..., :: max(1, x.shape[-1] // 4)] *= 30
    elif kind == "relu":
        x = np.maximum(x - 0.3, 0)
    elif kind == "ints":
        x = np.round(x * 2) / 2
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


SHAPES = {
    "scalar": (),
    "empty": (0, 8),
    "tiny": (7,),
    "odd": (3, 5, 7),
    "tail": (5 * 4096 + 123,),  # whole chunks and a tail
    "minilm": (4, 64, 384),  # a MiniLM hidden state: 3 x 128 Hadamard blocks
    "conv": (4, 16, 14, 14),
    "large": (70 * 4096,),  # more than one thread's share of chunks
}

QUANT = [{"bits": b} for b in (1, 2, 4, 8, 12, 16)] + [
    {"bits": 4, "group": "token"},
    {"bits": 4, "group": "token", "rotate": "hadamard"},
    {"bits": 2, "group": "channel", "axis": 1},
    {"bits": 4, "group_size": 64},
    {"bits": 8, "group": "token", "scale_dtype": "float16"},
    {"bits": 4, "group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"},
    {"bits": 4, "stochastic": True},
]
SORTQUANT = [{"quant_bits": q, "split_bits": s} for q, s in ((12, 4), (9, 3), (6, 2), (3, 1), (8, 0), (2, 6), (5, 5))] + [
    {"quant_bits": 3, "split_bits": 1, "group": "token"},
    {"quant_bits": 2, "split_bits": 2, "group": "token", "rotate": "hadamard"},
    {"quant_bits": 6, "split_bits": 2, "rotate": "hadamard"},
    {"quant_bits": 6, "split_bits": 2, "scale_dtype": "float16"},
    {"quant_bits": 3, "split_bits": 1, "stochastic": True},
]
CODEBOOK = [{"bits": b} for b in (1, 2, 4, 8)] + [
    {"bits": 4, "group": "token", "rotate": "hadamard"},
    {"bits": 2, "group": "token", "rotate": "hadamard"},
    {"bits": 2, "group": "channel", "axis": 1},
    {"bits": 3, "levels": "fit"},
    {"bits": 4, "group": "token", "scale_dtype": "float16"},
    {"bits": 2, "stochastic": True},
    {"count": 5, "group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"},
    {"count": 3, "levels": "fit"},
    {"count": 7, "group": "channel", "axis": 1},
]
GRADIENT = [
    ("topk", {"ratio": 0.05}), ("randomk", {"ratio": 0.05}), ("lowrank", {"rank": 2}), ("onebit", {}),
    ("qsgd", {"levels": 4}), ("terngrad", {}), ("dgc", {"density": 0.05, "warmup_epochs": 0}), ("atomo", {"budget": 2}),
]


def cases() -> dict[str, tuple[str, dict, str, str, str]]:
    """``id -> (codec, options, shape name, input kind, dtype name)``."""
    out = {}

    def add(codec, options, shapes, kinds=("randn",), dtypes=("float32",)):
        for shape in shapes:
            for kind in kinds:
                for dt in dtypes:
                    opts = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
                    out[f"{codec}[{opts}]/{shape}/{kind}/{dt}"] = (codec, options, shape, kind, dt)

    lossy_shapes = ("scalar", "empty", "tiny", "odd", "tail", "minilm", "conv")
    for codec in ("none", "fp16", "bf16"):
        add(codec, {}, ("scalar", "empty", "odd", "tail"), dtypes=tuple(DTYPES))
    for options in QUANT:
        add("quant", options, lossy_shapes, kinds=("outliers", "relu"))
    for options in SORTQUANT:
        add("sortquant", options, lossy_shapes, kinds=("outliers", "relu", "ints"))
    for options in CODEBOOK:
        add("codebook", options, lossy_shapes, kinds=("outliers",))
    for codec, options in (("quant", {"bits": 8}), ("sortquant", {"quant_bits": 6, "split_bits": 2}),
                           ("codebook", {"bits": 4, "group": "token", "rotate": "hadamard"})):
        add(codec, options, ("odd", "minilm", "large"), kinds=("outliers",), dtypes=tuple(DTYPES))
    for options in ({"rank": 2}, {"rank": 3, "count": 5, "factor_dtype": "float16", "rotate": "none"},
                    {"rank": 2, "bits": 0}):
        add("subspace", options, ("empty", "tiny", "odd", "minilm", "conv"), kinds=("outliers",))
    for codec, options in GRADIENT:
        add(codec, options, ("odd", "conv"))
    return out


def digest(tensors: list[torch.Tensor]) -> str:
    """SHA-256 of the dtypes, shapes and bytes of ``tensors``."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def payload_digest(p: Payload) -> str:
    return digest([p.header, *p.tensors])


def run_case(codec: str, options: dict, shape: str, kind: str, dt: str) -> dict:
    x = make_input(SHAPES[shape], kind, DTYPES[dt])
    torch.manual_seed(1234)  # stochastic rounding, random sparsification
    c = get_codec(codec, **options)
    # The subspace codec's factors come from matrix products whose rounding depends on how many
    # threads split the sums: its bytes are pinned on one thread (the receiver decodes whatever
    # factors it is sent, so both sides agree on any machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if codec == "subspace" else threads)
    try:
        p = c.encode(x)
    finally:
        torch.set_num_threads(threads)
    out = {"nbytes": p.nbytes, "payload": payload_digest(p), "decoded": digest([c.decode(p)])}
    return out | ({"header": digest([p.header])} if codec in FACTORED else {})


def stateful_runs() -> dict[str, dict]:
    """Error feedback over three steps and delta coding over a first visit and a revisit."""
    out = {}
    torch.manual_seed(1234)
    ef = ErrorFeedback(get_codec("quant", bits=2))
    xs = [make_input((3, 5, 7), kind, torch.float32) for kind in ("randn", "outliers", "relu")]
    out["feedback(quant[bits=2])"] = {"payloads": [payload_digest(ef.encode(x)) for x in xs]}
    for inner in ({"bits": 2, "group": "token", "rotate": "hadamard"}, {"bits": 4}):
        sender = DeltaCoder(get_codec("codebook" if "rotate" in inner else "quant", **inner), DeltaCache(8))
        receiver = DeltaCoder(get_codec("codebook" if "rotate" in inner else "quant", **inner), DeltaCache(8))
        ids = torch.tensor([5, 1, 3, 0])
        digests = []
        for kind in ("outliers", "randn"):  # first visit, then a revisit of the same examples
            x = make_input((4, 64, 384), kind, torch.float32)
            p = sender.encode(x, ids)
            digests += [payload_digest(p), digest([receiver.decode(p, ids)])]
        out[f"delta({','.join(f'{k}={v}' for k, v in sorted(inner.items()))})"] = {"payloads": digests}
    return out


def compute_all() -> dict[str, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hostile inputs (constant tensors to a low-rank codec, ...)
        return {**{k: run_case(*v) for k, v in cases().items()}, **stateful_runs()}


@pytest.fixture(scope="module")
def golden() -> dict[str, dict]:
    return json.loads(GOLDEN.read_text())


def _pinned(key: str, record: dict) -> dict:
    """What the golden file pins of a case: everything, or size and header for a :data:`FACTORED` codec."""
    if key.split("[")[0].split("/")[0] in FACTORED:
        return {k: record[k] for k in ("nbytes", "header")}
    return record


@pytest.fixture(scope="module")
def computed() -> dict[bool, dict[str, dict]]:
    """Every case with the compiled kernels on (True) and off (False)."""
    out = {}
    for kernels in (True, False):
        previous = set_enabled(kernels)
        try:
            out[kernels] = compute_all()
        finally:
            set_enabled(previous)
    return out


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
def test_payloads_match_golden(golden, computed, kernels):
    got = computed[kernels]
    assert sorted(got) == sorted(golden), "the case list changed: regenerate on purpose"
    wrong = [k for k in golden if _pinned(k, got[k]) != _pinned(k, golden[k])]
    assert not wrong, f"{len(wrong)} of {len(golden)} payloads differ from the golden bytes, e.g. {wrong[:5]}"


def test_factored_codecs_send_the_same_bytes_on_every_backend(computed):
    factored = [k for k in computed[True] if k.split("[")[0] in FACTORED]
    assert factored
    assert all(computed[True][k] == computed[False][k] for k in factored)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_golden_payloads.py --write   (regenerates the golden bytes)")
    GOLDEN.write_text(json.dumps(compute_all(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
