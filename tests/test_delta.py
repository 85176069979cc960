"""Delta coding against per-example caches (AQ-SGD): the coder, the caches, the pipeline, the loaders.

Unit tests drive a sender and a receiver :class:`DeltaCoder` directly; the pipeline tests
run a 2-rank client/server MLP ([0, 1, 0]) in one spawned gloo world and check, against
independent computations, that a lossless inner codec gives plain training exactly, that
the two sides' caches stay bit-identical, that ids follow their rows through
micro-batches and uneven batches, and that a resumed pipeline continues exactly.
"""

import copy
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dgpipe.compression import get_codec
from dgpipe.compression.wrappers.delta import DeltaCache, DeltaCoder, DeltaSpec, check_ids
from dgpipe.data.loading import make_dataloader
from dgpipe.pipeline import BoundarySpec, Pipeline, SpawnError, spawn, split_layers
from helpers import assert_ranks_ok, spawn_checks

N = 24  # training examples


def pair(inner="quant", dtype=torch.float16, examples=N, **options):
    options = options or ({"bits": 2} if inner == "quant" else {})
    make = lambda: DeltaCoder(get_codec(inner, **options), DeltaCache(examples, dtype))  # noqa: E731
    return make(), make()


def test_first_visit_codes_the_activation_itself_and_sides_agree():
    sender, receiver = pair()
    x, ids = torch.randn(6, 5, 8), torch.tensor([3, 0, 7, 1, 20, 11])
    payload = sender.encode(x, ids)
    r = receiver.decode(payload, ids)
    direct = get_codec("quant", bits=2)
    torch.testing.assert_close(r, direct.decode(direct.encode(x)))  # m = 0: the change is the activation
    assert payload.nbytes == direct.encode(x).nbytes
    assert sender.cache.digest() == receiver.cache.digest()
    assert torch.equal(receiver.cache.values[ids].float(), r.half().float())


def test_caches_stay_identical_over_epochs_and_error_shrinks_for_a_fixed_example():
    sender, receiver = pair(dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    acts = torch.randn(N, 16, 32, generator=g)
    errors = []
    for epoch in range(6):
        for ids in torch.randperm(N, generator=g).split(8):
            a = acts[ids] + 0.01 * epoch  # activations drift a little between visits
            r = receiver.decode(sender.encode(a, ids), ids)
            errors.append(float(((r - a) ** 2).mean() / (a**2).mean()) if 0 in ids else None)
        assert sender.cache.digest() == receiver.cache.digest()
    errors = [e for e in errors if e is not None]
    assert len(errors) == 6 and all(b < a for a, b in zip(errors, errors[1:]))
    assert errors[-1] < errors[0] / 1000  # 2-bit direct coding: ~0.1 relative MSE; the deltas converge


def test_lossless_inner_codec_with_a_float64_cache_reconstructs_exactly():
    sender, receiver = pair("none", dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    for visit in range(4):
        ids = torch.randperm(N, generator=g)[:10]
        a = torch.randn(10, 7, generator=g) * 10 ** (visit - 2)
        assert torch.equal(receiver.decode(sender.encode(a, ids), ids), a)


def test_rows_of_varying_length_grow_the_cache_and_use_its_leading_part():
    sender, receiver = pair(dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    for length in (5, 9, 3, 9):  # padded text batches: the sequence length changes per batch
        ids = torch.randperm(N, generator=g)[:4]
        a = torch.randn(4, length, 6, generator=g)
        r = receiver.decode(sender.encode(a, ids), ids)
        assert r.shape == a.shape
        assert torch.equal(receiver.cache.values[ids, :length], r)
    assert sender.cache.values.shape == (N, 9, 6) and sender.cache.digest() == receiver.cache.digest()
    with pytest.raises(ValueError, match="number of dimensions"):
        sender.encode(torch.randn(2, 9), torch.tensor([0, 1]))


def test_memory_mapped_cache_matches_the_in_memory_one(tmp_path):
    mapped = DeltaCoder(get_codec("quant", bits=3), DeltaCache(N, torch.bfloat16, tmp_path / "c" / "cache.bin"))
    plain, _ = pair(bits=3, dtype=torch.bfloat16)
    for seed in range(3):
        ids = torch.randperm(N, generator=torch.Generator().manual_seed(seed))[:8]
        a = torch.randn(8, 12, generator=torch.Generator().manual_seed(10 + seed))
        assert mapped.encode(a, ids).nbytes == plain.encode(a, ids).nbytes
    assert mapped.cache.digest() == plain.cache.digest()
    assert (tmp_path / "c" / "cache.bin").stat().st_size == N * 12 * 2


def test_a_cache_over_the_limit_is_refused_naming_the_memory_mapped_option():
    lines = []
    cache = DeltaCache(1000, torch.float16, max_bytes=1 << 20, name="boundary X", report=lines.append)
    with pytest.raises(ValueError, match=r"boundary X: .*1000 examples x 1024 values x 2 bytes.*--delta-cache-dir"):
        cache.rows(torch.tensor([0]), (4, 256))
    cache.rows(torch.tensor([0]), (2, 256))  # 1000 x 512 x 2 = 1 MiB: fits
    assert lines == ["boundary X: 1000 examples x 512 values x 2 bytes = 1.0 MiB in memory"]


def test_cache_state_round_trip_and_bad_state():
    sender, _ = pair()
    ids = torch.tensor([1, 2, 3])
    sender.encode(torch.randn(3, 4), ids)
    state = sender.cache.state_dict()
    other = DeltaCache(N, torch.float16)
    other.load_state_dict(state)
    assert other.digest() == sender.cache.digest()
    with pytest.raises(ValueError, match="does not fit 5 examples"):
        DeltaCache(5, torch.float16).load_state_dict(state)


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([0, 24]), r"id 24 is out of range \[0, 24\)"),
    (torch.tensor([-1, 2]), r"id -1 is out of range"),
    (torch.tensor([3, 3]), "repeats an id"),
    (torch.tensor([1.0, 2.0]), "1-D int64"),
    (torch.tensor([[1, 2]]), "1-D int64"),
])
def test_bad_ids_are_refused(ids, match):
    with pytest.raises(ValueError, match=match):
        check_ids(ids, N)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match=r"delta boundaries \(2,\): there are 2 boundaries"):
        Pipeline(split_layers(mlp(), [1, 2, 2]), [0, 0, 0], loss_fn=F.cross_entropy,
                 boundary=BoundarySpec(delta=DeltaSpec(N, boundaries=(2,))))
    with pytest.raises(ValueError, match="number of training examples"):
        DeltaSpec(0)
    with pytest.raises(ValueError, match="cache dtype"):
        DeltaSpec(10, cache_dtype=torch.int8)
    with pytest.raises(ValueError, match="stateless inner codec"):
        from dgpipe.compression import ErrorFeedback

        DeltaCoder(ErrorFeedback(get_codec("quant", bits=2)), DeltaCache(4))


@pytest.mark.parametrize("batch_seeds", [False, True])
def test_loaders_yield_the_dataset_index_of_every_row(batch_seeds):
    data = torch.arange(40).float()

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, key):
            i = key[0] if isinstance(key, tuple) else key
            return data[i], int(data[i]) % 3

    loader = make_dataloader(Items(), 8, shuffle=True, seed=3, batch_seeds=batch_seeds, sample_ids=True)
    loader.batch_sampler.set_epoch(1)
    seen = []
    for x, y, ids in loader:
        assert ids.dtype == torch.int64 and torch.equal(x, data[ids]) and torch.equal(y, ids % 3)
        seen += ids.tolist()
    assert sorted(seen) == list(range(40)) and seen != sorted(seen)


# -- pipeline ---------------------------------------------------------------------------------

CHUNKS = 4


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def dataset():
    g = torch.Generator().manual_seed(5)
    return torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)


def make_pipe(model, codec, delta, lr=0.1, **spec):
    pipe = Pipeline(split_layers(model, [1, 2, 2]), [0, 1, 0], chunks=CHUNKS, loss_fn=F.cross_entropy,
                    act_codec=codec, grad_codec="none", timeout=30,
                    boundary=BoundarySpec(delta=DeltaSpec(N, **spec) if delta else None),
                    delta_report=None)
    return pipe, torch.optim.SGD(pipe.parameters(), lr=lr)


def epochs(n, seed=0, batch=8):
    """Batches of ids: a permutation of the dataset per epoch."""
    g = torch.Generator().manual_seed(seed)
    return [ids for _ in range(n) for ids in torch.randperm(N, generator=g).split(batch)]


def train(pipe, opt, batches):
    x, y = dataset()
    losses = []
    for ids in batches:
        opt.zero_grad()
        losses.append(pipe.train_step(x[ids], y[ids], sample_ids=ids))
        opt.step()
    return losses


def params(pipe):
    return [p.detach().clone() for p in pipe.parameters()]


def run_lossless_equals_plain(rank):
    plain, plain_opt = make_pipe(mlp(), "none", delta=False)
    delta, delta_opt = make_pipe(mlp(), "none", delta=True, cache_dtype=torch.float64)
    batches = epochs(3)
    assert train(plain, plain_opt, batches) == train(delta, delta_opt, batches)
    for p, q in zip(params(plain), params(delta)):
        assert torch.equal(p, q)


def _digests_across_ranks(pipe):
    """Every boundary's cache digest on both of its ranks, compared through an all-gather."""
    mine = pipe.delta_digests()
    names = ["stage0->stage1", "stage1->stage2"]
    local = torch.tensor([[int(mine[n][0][i:i + 15], 16) for i in range(0, 60, 15)] for n in names])
    everyone = [torch.zeros_like(local) for _ in range(2)]
    dist.all_gather(everyone, local)
    assert torch.equal(everyone[0], everyone[1])


def run_lossy_caches_identical(rank):
    pipe, opt = make_pipe(mlp(), ("quant", {"bits": 2}), delta=True)
    losses = train(pipe, opt, epochs(3))
    assert all(np.isfinite(losses))
    _digests_across_ranks(pipe)


def run_ids_follow_rows(rank):
    """Receiver caches hold, per id, the stage-0 output of that example (lr 0: fixed weights),
    after a batch of 12 (3 rows per micro-batch) and an uneven last batch of 4."""
    model = mlp()
    pipe, opt = make_pipe(copy.deepcopy(model), "none", delta=True, lr=0.0, cache_dtype=torch.float64)
    x, y = dataset()
    batches = [torch.tensor([5, 17, 2, 9, 23, 0, 11, 14, 3, 20, 8, 1]), torch.tensor([22, 6, 13, 19])]
    train(pipe, opt, batches)
    if rank == 1:  # the receiver of stage0->stage1
        ids = torch.cat(batches)
        cache = pipe._bounds[0].coders.delta(0).cache
        with torch.no_grad():
            want = model[0](x[ids]).double()  # stage 0 is the first Linear
        torch.testing.assert_close(cache.values[ids], want, rtol=1e-6, atol=1e-7)
        untouched = torch.ones(N, dtype=torch.bool)
        untouched[ids] = False
        assert not cache.values[untouched].any()


def run_resume_is_exact(rank):
    batches = epochs(3, seed=1)
    whole, whole_opt = make_pipe(mlp(), ("quant", {"bits": 3}), delta=True)
    train(whole, whole_opt, batches)
    first, first_opt = make_pipe(mlp(), ("quant", {"bits": 3}), delta=True)
    train(first, first_opt, batches[:4])
    state, opt_state = copy.deepcopy(first.state_dict()), copy.deepcopy(first_opt.state_dict())
    assert set(state["delta"]) == {"stage0->stage1", "stage1->stage2"}  # each rank: one side of each
    resumed, resumed_opt = make_pipe(mlp(), ("quant", {"bits": 3}), delta=True)
    resumed.load_state_dict(state)
    resumed_opt.load_state_dict(opt_state)
    train(resumed, resumed_opt, batches[4:])
    for p, q in zip(params(whole), params(resumed)):
        assert torch.equal(p, q)
    assert whole.delta_digests() == resumed.delta_digests()


def run_eval_carries_no_ids(rank):
    pipe, opt = make_pipe(mlp(), ("quant", {"bits": 2}), delta=True)
    train(pipe, opt, epochs(1)[:1])
    before = pipe.delta_digests()
    x, _ = dataset()
    out = pipe.eval_step(x[:5])
    assert (out.shape == (5, 3)) if rank == 0 else out is None
    assert pipe.delta_digests() == before


def run_warmup_is_lossless_then_deltas_follow(rank):
    """A warm-up epoch sends activations uncompressed (training equals plain uncompressed
    training) and caches them; the coded epochs after it keep both sides' caches equal."""
    plain, plain_opt = make_pipe(mlp(), "none", delta=False)
    pipe, opt = make_pipe(mlp(), ("quant", {"bits": 2}), delta=True, cache_dtype=torch.float32)
    batches = epochs(3, seed=2)
    outputs = []
    if rank == 0:  # record what stage 0 sends, micro-batch by micro-batch
        pipe.stages[0].register_forward_hook(lambda m, i, o: outputs.append(o.detach().clone()))
    pipe.delta_warmup = True
    assert train(pipe, opt, batches[:3]) == train(plain, plain_opt, batches[:3])
    if rank == 0:  # the sender's cache holds exactly the activations it sent (fp32 cache)
        cache = pipe._bounds[0].coders.delta(0).cache
        micro_ids = [m for ids in batches[:3] for m in ids.tensor_split(CHUNKS)]
        assert len(outputs) == len(micro_ids)
        for ids, out in zip(micro_ids, outputs):
            assert torch.equal(cache.values[ids], out)
    pipe.delta_warmup = False
    train(pipe, opt, batches[3:])
    _digests_across_ranks(pipe)


def run_only_the_named_boundary_is_delta_coded(rank):
    pipe = Pipeline(split_layers(mlp(), [1, 2, 2]), [0, 1, 0], chunks=CHUNKS, loss_fn=F.cross_entropy,
                    act_codec=("quant", {"bits": 2}), timeout=30,
                    boundary=BoundarySpec(delta=DeltaSpec(N, boundaries=(1,))), delta_report=None)
    train(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), epochs(2))
    assert pipe.delta_boundaries == ["stage1->stage2"]
    assert set(pipe.delta_digests()) == set(pipe.state_dict()["delta"]) == {"stage1->stage2"}
    mine = pipe.delta_digests()["stage1->stage2"][0]
    local = torch.tensor([int(mine[i:i + 15], 16) for i in range(0, 60, 15)])
    everyone = [torch.zeros_like(local) for _ in range(2)]
    dist.all_gather(everyone, local)
    assert torch.equal(everyone[0], everyone[1])


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    checks = {"lossless": run_lossless_equals_plain, "lossy": run_lossy_caches_identical,
              "ids": run_ids_follow_rows, "resume": run_resume_is_exact, "eval": run_eval_carries_no_ids,
              "warmup": run_warmup_is_lossless_then_deltas_follow, "partial": run_only_the_named_boundary_is_delta_coded}
    return spawn_checks(checks, 2, tmp_path_factory.mktemp("delta"))


@pytest.mark.parametrize("name", ["lossless", "lossy", "ids", "resume", "eval", "warmup", "partial"])
def test_pipeline_delta(outcomes, name):
    assert_ranks_ok(outcomes, name, 2)


def test_wire_bytes_count_the_ids_and_raw_bytes_do_not(tmp_path):
    """A 2-rank step with a lossless codec, with and without delta: the forward wire bytes
    grow by exactly one int64 ids payload per micro-batch; the raw bytes do not change."""
    spawn(_wire_step, 2, (str(tmp_path),), timeout=60, start_method="fork")
    plain, delta = (np.load(tmp_path / f"{k}.npy") for k in ("plain", "delta"))
    assert plain[0] == delta[0]  # raw bytes unchanged
    assert delta[1] - plain[1] == CHUNKS * (get_codec("none").encode(torch.zeros(2, dtype=torch.int64)).nbytes)


def _wire_step(rank, world_size, out):
    totals = {}
    for kind in ("plain", "delta"):
        pipe, opt = make_pipe(mlp(), "none", delta=kind == "delta")
        train(pipe, opt, [torch.arange(8)])
        rec = {(r["name"], r["direction"]): r for r in pipe.meter.records()}[("stage0->stage1", "forward")]
        totals[kind] = (rec["raw_bytes"], rec["wire_bytes"])
    if rank == 0:
        for kind, values in totals.items():
            np.save(f"{out}/{kind}.npy", np.array(values))


def _no_ids(rank, world_size):
    pipe, _ = make_pipe(mlp(), ("quant", {"bits": 2}), delta=True)
    x, y = dataset()
    pipe.train_step(x[:8], y[:8])


def _ids_out_of_range(rank, world_size):
    pipe, _ = make_pipe(mlp(), ("quant", {"bits": 2}), delta=True)
    x, y = dataset()
    pipe.train_step(x[:8], y[:8], sample_ids=torch.arange(8) + 20)


@pytest.mark.parametrize("fn, match", [(_no_ids, "train_step needs sample_ids"),
                                       (_ids_out_of_range, r"id 27 is out of range \[0, 24\)")])
def test_bad_use_ends_both_ranks_with_a_clear_error(fn, match):
    start = time.monotonic()
    with pytest.raises(SpawnError, match=rf"rank 0 failed: ValueError: .*{match}"):
        spawn(fn, 2, (), timeout=60, start_method="fork")
    assert time.monotonic() - start < 30


# -- the wire: ids and delta payloads are validated ------------------------------------------

def _boundary(delta=True):
    from dgpipe.comm import BandwidthMeter
    from dgpipe.pipeline.boundary import Boundary

    spec = BoundarySpec(delta=DeltaSpec(N) if delta else None)
    return Boundary(0, 0, 1, lambda: get_codec("quant", bits=2), lambda: get_codec("none"), BandwidthMeter(),
                    torch.device("cpu"), 5.0, rank=1, spec=spec, report=None)


def test_ids_and_delta_payloads_are_checked_on_receipt():
    from dgpipe.pipeline.lanes import LaneContext
    from dgpipe.pipeline.message import DELTA_CODED

    payload = get_codec("quant", bits=2).encode(torch.randn(2, 3))
    lane = lambda b=None: (b or _boundary()).coders.lane("forward", 0, 0, DELTA_CODED)  # noqa: E731
    with pytest.raises(ValueError, match=r"id 30 is out of range"):
        _boundary()._parse_ids(torch.tensor([1, 30]), "forward", 0)
    with pytest.raises(ValueError, match="sample ids in a eval message"):
        _boundary()._parse_ids(torch.tensor([1, 2]), "eval", 0)
    with pytest.raises(ValueError, match="expects none"):
        _boundary(delta=False)._parse_ids(torch.tensor([1, 2]), "forward", 0)
    with pytest.raises(ValueError, match="does not delta-code"):
        lane(_boundary(delta=False))
    with pytest.raises(ValueError, match="without sample ids"):
        lane().decode(payload, LaneContext())
    with pytest.raises(ValueError, match="delta payload of shape"):
        lane().decode(payload, LaneContext(torch.tensor([1, 2, 3])))
    r = lane().decode(payload, LaneContext(torch.tensor([4, 5])))
    assert r.shape == (2, 3) and r.dtype == torch.float32


def test_a_delta_payload_names_the_activation_dtype_in_the_inner_payload_bytes():
    """bf16 activations, float16 caches: the change is coded in float32 (their promotion), the
    header's dtype field says bfloat16, the receiver returns bfloat16, and the bytes are the
    inner codec's payload of the change with only that field changed."""
    from dgpipe.compression.base import code_from_dtype

    sender, receiver = pair()
    ids = torch.tensor([2, 9, 4])
    x = torch.randn(3, 4, 8).bfloat16()
    p = sender.encode(x, ids)
    direct = get_codec("quant", bits=2).encode(x.float())  # first visit: the change is the activation
    assert p.header[2] == code_from_dtype(torch.bfloat16) and direct.header[2] == code_from_dtype(torch.float32)
    assert torch.equal(p.header[3:], direct.header[3:]) and all(map(torch.equal, p.tensors, direct.tensors))
    r = receiver.decode(p, ids)
    assert r.dtype == torch.bfloat16 and sender.cache.digest() == receiver.cache.digest()
    torch.testing.assert_close(r, get_codec("quant", bits=2).decode(direct).bfloat16())
    bad = p.header.clone()
    bad[2] = code_from_dtype(torch.int64)
    with pytest.raises(ValueError, match="not a floating dtype"):
        receiver.decode(type(p)(bad, p.tensors), ids)
