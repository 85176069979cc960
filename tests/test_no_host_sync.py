"""The codecs never wait for a device: no value read back to the host in an encode or a decode.

A host sync is a read of a device value: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``,
``.tolist()``), ``is_nonzero``, ``equal``, or a copy from the device to the CPU. The codecs run here on tensors
of the ``meta`` device -- a device without values: every read raises -- under a dispatch mode that names the
operation that would have waited. That is the path a GPU runs (everything but the CPU's numpy checks and
compiled loops) with the Triton kernels off: the torch reference, which also codes the tail of every Triton
launch. The Triton kernels themselves are checked on a GPU (``tests/test_cuda.py``, torch's sync debug mode).

On a device a non-finite input is refused by the decoder, at the runtime's next wait
(:mod:`dgpipe.compression.kernels.deferred`); the tests below run that path on CPU values by declaring them
off the host, through a codec, and through a two-rank pipeline.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dgpipe.compression import get_codec, raise_deferred
from dgpipe.compression.kernels import backend, buckets, deferred
from dgpipe.compression.kernels.uniform import NOT_FINITE
from dgpipe.compression.wrappers.delta import DeltaCache, DeltaCoder
from dgpipe.compression.wrappers.reference import ReferenceCoder, ScaledReferenceCoder, TokenTable
from dgpipe.pipeline import Pipeline, SpawnError, spawn

READS = {"_local_scalar_dense", "is_nonzero", "item", "equal"}


class NoHostSync(TorchDispatchMode):
    """Fails on any operation that reads a non-CPU value on the host (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        on_device = any(isinstance(a, torch.Tensor) and not a.is_cpu for a in args)
        if on_device and name in READS:
            raise AssertionError(f"host sync: {func}")
        if on_device and name in ("_to_copy", "copy_") and (
                kwargs.get("device") == torch.device("cpu") or (name == "copy_" and args[0].is_cpu)):
            raise AssertionError(f"device-to-host copy: {func}")
        return func(*args, **kwargs)


CODECS = [
    ("quant", {"bits": 8}),
    ("quant", {"bits": 4, "group": "token"}),
    ("quant", {"bits": 2, "group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}),
    ("quant", {"bits": 3, "group_size": 256, "scale_dtype": "float16"}),
    ("sortquant", {"quant_bits": 6, "split_bits": 2}),
    ("sortquant", {"quant_bits": 3, "split_bits": 1, "group": "token"}),
    ("codebook", {"bits": 2, "group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}),
    ("codebook", {"bits": 4}),
    ("codebook", {"bits": 3, "levels": "fit"}),
    ("codebook", {"count": 5, "group": "token"}),
]


@pytest.fixture
def reference_path(monkeypatch):
    """The torch reference (Triton and C off); random draws from a seeded CPU generator, as a ``meta`` device has
    none of its own (the draws read nothing back either way)."""
    previous = backend.set_enabled(False)
    real = torch.Generator

    class Generator(real):  # a class still: torch's annotations combine it with None
        def __new__(cls, device="cpu"):
            return real() if torch.device(device).type == "meta" else real(device)

    monkeypatch.setattr(torch, "Generator", Generator)
    yield
    backend.set_enabled(previous)


@pytest.mark.parametrize("shape", [(4, 64, 384), (3, 100)])  # large enough to sample the buckets; a small exact one
@pytest.mark.parametrize("name, options", CODECS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={o}" for k, o in v.items()))
def test_encode_and_decode_read_nothing_back(reference_path, name, options, shape):
    codec = get_codec(name, **options)
    x = torch.empty(shape, device="meta")
    with NoHostSync():
        payload = codec.encode(x)
    assert all(t.device.type == "meta" for t in payload.tensors) and payload.header.is_cpu
    with NoHostSync():
        y = codec.decode(payload)
    assert y.shape == x.shape and y.device.type == "meta"
    assert deferred.pending() >= 1  # the decoder's check of the grid or scales waits for the runtime
    deferred._held.clear()  # meta flags have no values to read


def test_the_dispatch_mode_sees_a_read_back():
    x = torch.empty(8, device="meta")
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        bool(x.sum() > 0)
    with pytest.raises(AssertionError, match="device-to-host copy"), NoHostSync():
        x.to("cpu")


@pytest.fixture
def off_host(monkeypatch):
    """CPU values treated as a device's: no range check in the encoder, the decoder's check deferred, and the
    device's bucket split (torch ops; the CPU's numpy split checks its range whatever the device)."""
    previous = backend.set_enabled(False)
    monkeypatch.setattr(deferred, "on_host", lambda t: False)
    monkeypatch.setattr(buckets, "_cpu_grid", buckets._torch_grid)
    yield
    deferred._held.clear()
    backend.set_enabled(previous)


@pytest.mark.parametrize("name, options", [("quant", {"bits": 8}), ("quant", {"bits": 4, "group": "token"}),
                                           ("sortquant", {"quant_bits": 6, "split_bits": 2}),
                                           ("codebook", {"bits": 2, "group": "token", "scale_dtype": "float16"})])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_device_decoder_refuses_a_grid_that_is_not_finite_at_the_next_wait(off_host, name, options, bad):
    codec = get_codec(name, **options)
    good = torch.randn(4, 16, 64)
    y = codec.decode(codec.encode(good))
    raise_deferred()  # finite: nothing raised
    assert deferred.pending() == 0 and (y - good).abs().max() < good.abs().max()
    x = good.clone()
    x[1, 2, 3] = bad
    payload = codec.encode(x)  # no check in the encoder
    codec.decode(payload)  # none in the decoder either
    codec.decode(codec.encode(good))
    codec.decode(payload)
    assert deferred.pending() == 1  # one flag per device and message, however many decodes
    with pytest.raises(ValueError, match=f"^{name} payload has a grid that is not finite"):
        raise_deferred()
    assert deferred.pending() == 0
    raise_deferred()  # read and cleared


def test_many_decodes_are_kept_in_bounded_memory(off_host):
    """Past FOLD_AT decodes of one boundary the kept grids fold into one sum, which still catches one bad grid."""
    codec = get_codec("quant", bits=4, group="token")
    good, bad = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    bad[1, 2, 3] = float("inf")
    payload = codec.encode(good)
    for _ in range(deferred.FOLD_AT + 5):
        codec.decode(payload)
    assert len(deferred._held[(good.device, NOT_FINITE.format("quant"))]) == 6
    raise_deferred()
    for _ in range(deferred.FOLD_AT - 1):
        codec.decode(payload)
    codec.decode(codec.encode(bad))  # the 64th: folded with the others
    assert len(deferred._held[(good.device, NOT_FINITE.format("quant"))]) == 1
    with pytest.raises(ValueError, match="grid that is not finite"):
        raise_deferred()


def test_a_scale_past_float16_is_refused_by_the_decoder_off_the_host(off_host):
    codec = get_codec("quant", bits=4, group="token", scale_dtype="float16")
    x = torch.randn(2, 8, 16)
    x[1, 3] *= 1e6  # a step past float16's 65504
    codec.decode(codec.encode(x))
    with pytest.raises(ValueError, match="group parameter past its scale_dtype"):
        raise_deferred()


def test_on_the_host_the_refusal_is_at_once():
    with pytest.raises(ValueError, match="inf/NaN"):
        get_codec("quant", bits=8).encode(torch.tensor([0.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match="not finite"):
        deferred.refuse_unless(torch.tensor([1.0, float("inf")]), "not finite")
    assert deferred.pending() == 0


def _nan_step(rank, world_size):
    """Two ranks whose boundary behaves as on a device; the second micro-batch's activations hold a NaN."""
    torch.set_num_threads(1)
    backend.set_enabled(False)
    deferred.on_host = lambda t: False
    torch.manual_seed(0)
    pipe = Pipeline([nn.Linear(4, 4), nn.Linear(4, 4)], [0, 1], chunks=4, act_codec=get_codec("quant", bits=8),
                    loss_fn=nn.functional.mse_loss, timeout=60)
    x = torch.randn(8, 4)
    x[3, 1] = float("nan")
    pipe.train_step(x, torch.randn(8, 4))


def test_the_pipeline_ends_the_step_with_the_decoders_error():
    with pytest.raises(SpawnError, match=r"rank [01] failed: ValueError: quant payload has a grid that is not finite"):
        spawn(_nan_step, 2, timeout=60, start_method="fork")


@pytest.mark.parametrize("scaled", [False, True])
def test_the_token_reference_reads_nothing_back(reference_path, scaled):
    """Both sides' coders on a device: lookup, coding and the table's update without a read back."""
    vocab, ids = 50, torch.randint(50, (2, 16))

    def coder():
        tables = (TokenTable(vocab), TokenTable(vocab))
        return (ScaledReferenceCoder(get_codec("codebook", count=5, group="token"), *tables, backoff=True) if scaled
                else ReferenceCoder(get_codec("quant", bits=4, group="token"), tables[0], backoff=True))

    sender, receiver = coder(), coder()
    for _ in range(2):  # the second message reads a table that the first updated
        x = torch.empty(2, 16, 64, device="meta")
        with NoHostSync():
            payload = sender.encode(x, ids.to("meta"), update=True)
            y = receiver.decode(payload, ids.to("meta"), update=True)
        assert y.shape == x.shape
    deferred._held.clear()


def test_a_device_updates_the_token_table_as_the_host_does(monkeypatch):
    """The sorted, read-back-free update gives the host's rows (to float32 rounding: other sums) and counts."""
    gen = torch.Generator().manual_seed(0)
    host, device = TokenTable(40, alpha=0.1), TokenTable(40, alpha=0.1)
    messages = [(torch.randint(40, (3, 24), generator=gen), torch.randn(3, 24, 8, generator=gen)) for _ in range(5)]
    for ids, values in messages:
        host.lookup(ids, 8, torch.device("cpu"))
        host.update(ids, values)
    monkeypatch.setattr(deferred, "on_host", lambda t: False)
    for ids, values in messages:
        device.lookup(ids, 8, torch.device("cpu"))
        device.update(ids, values)
    assert torch.equal(device.count, host.count) and int(host.count.sum()) == 5 * 72
    torch.testing.assert_close(device.rows, host.rows, rtol=1e-5, atol=1e-6)
    assert (host.rows != 0).any(dim=1).sum() == (host.count > 0).sum()


def test_delta_coding_against_a_cache_on_the_device_reads_nothing_back(reference_path):
    """Both sides' caches on the activations' device: rows read and stored there, the statistics kept there;
    the sample ids come from the host (an asynchronous copy)."""
    inner = get_codec("codebook", bits=2, group="token", rotate="hadamard")
    sender, receiver = (DeltaCoder(inner, DeltaCache(16, device="meta")) for _ in range(2))
    ids = torch.tensor([5, 1, 3, 0])
    for _ in range(2):  # a first visit, then a revisit
        x = torch.empty(4, 32, 64, device="meta")
        with NoHostSync():
            payload = sender.encode(x, ids)
            y = receiver.decode(payload, ids)
        assert y.shape == x.shape and sender.cache.values.device.type == "meta"
    assert sender.stats.device.type == "meta"
    deferred._held.clear()


def test_a_memory_mapped_delta_cache_stays_on_the_host(tmp_path):
    with pytest.raises(ValueError, match="memory-mapped delta cache lives in host memory"):
        DeltaCache(4, path=tmp_path / "c.bin", device="meta")
