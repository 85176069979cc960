"""Uncompressed, a pipeline computes exactly what the unsplit model computes.

For 2-rank linear, 3-rank linear and 2-rank client/server placements, an MLP and a
conv net with BatchNorm (plain and deferred) must give the same loss, parameter
gradients and BatchNorm statistics as the unsplit model run micro-batch by micro-batch
with gradient accumulation (rtol 1e-5), over two steps with an SGD update and a batch
size change between them. Tuple boundaries (hidden states + integer mask) must carry
the mask bit-exactly while the hidden states go through a lossy codec.

Each world size is spawned once per module; every rank runs every scenario and writes
its outcome to a file that the scenario's test reads.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dgpipe.compression import get_codec
from dgpipe.pipeline import Pipeline, split_layers
from helpers import assert_ranks_ok, spawn_checks

RTOL, ATOL = 1e-5, 1e-6
CHUNKS = 4


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def convnet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 5 * 5, 3),
    )  # fmt: skip


def data(kind, batch, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 6, generator=g) if kind == "mlp" else torch.randn(batch, 3, 5, 5, generator=g)
    return x, torch.randint(0, 3, (batch,), generator=g)


BALANCES = {
    ("mlp", (0, 1)): [2, 3], ("mlp", (0, 1, 0)): [1, 2, 2], ("mlp", (0, 1, 2)): [2, 2, 1],
    ("conv", (0, 1)): [3, 5], ("conv", (0, 1, 0)): [2, 3, 3], ("conv", (0, 1, 2)): [2, 3, 3],
}  # fmt: skip


def reference_step(ref, x, y, chunks):
    """Loss and gradients of the unsplit model, micro-batch by micro-batch, accumulated."""
    loss = 0.0
    for xm, ym in zip(x.chunk(chunks), y.chunk(chunks)):
        lm = F.cross_entropy(ref(xm), ym) / chunks
        lm.backward()
        loss += lm.item()
    return loss


def expected_deferred_stats(ref, x):
    """BatchNorm running stats after one update with the whole mini-batch's mean and biased
    variance (what DeferredBatchNorm tracks), from the BN inputs of the unsplit model run
    micro-batch by micro-batch in training mode (on a copy, so ``ref`` is untouched)."""
    copy_ = copy.deepcopy(ref).train()
    inputs = {}
    for name, mod in copy_.named_modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.register_forward_hook(lambda m, i, o, name=name: inputs.setdefault(name, []).append(i[0].detach()))
    with torch.no_grad():
        for xm in x.chunk(CHUNKS):
            copy_(xm)
    out = {}
    for name, mod in ref.named_modules():
        if isinstance(mod, nn.BatchNorm2d):
            v, m = torch.cat(inputs[name]), mod.momentum
            mean, var = v.mean(dim=(0, 2, 3)), v.var(dim=(0, 2, 3), unbiased=False)
            out[name] = ((1 - m) * mod.running_mean + m * mean, (1 - m) * mod.running_var + m * var)
    return out


def run_equivalence(rank, kind, placement, deferred=False):
    model = mlp() if kind == "mlp" else convnet()
    ref = copy.deepcopy(model)
    pipe = Pipeline(
        split_layers(model, BALANCES[(kind, tuple(placement))]), placement, chunks=CHUNKS,
        loss_fn=F.cross_entropy, timeout=30, deferred_batchnorm=deferred,
    )  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_params = dict(ref.named_parameters())
    ref_buffers = dict(ref.named_buffers())
    for step, batch in enumerate([8, 12]):  # the batch size changes between steps
        x, y = data(kind, batch, seed=step)
        deferred_stats = expected_deferred_stats(ref, x) if deferred else None
        opt.zero_grad()
        ref_opt.zero_grad()
        loss, out = pipe.train_step(x, y, return_outputs=True)
        ref_loss = reference_step(ref, x, y, CHUNKS)
        assert loss == pytest.approx(ref_loss, rel=RTOL), (step, loss, ref_loss)
        if pipe.holds_last_stage:
            assert out.shape == (batch, 3)
        else:
            assert out is None
        for i, stage in pipe.stages.items():
            for name, p in stage.named_parameters():
                torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=RTOL, atol=ATOL, msg=f"grad {name}")
            for name, b in stage.named_buffers():
                if name.endswith(("running_mean", "running_var")):
                    if deferred:
                        mean, var = deferred_stats[name.rsplit(".", 1)[0]]
                        want = mean if name.endswith("mean") else var
                    else:
                        want = ref_buffers[name]
                    torch.testing.assert_close(b, want, rtol=RTOL, atol=ATOL, msg=f"buffer {name}")
        if deferred:  # the reference tracked per micro-batch; give it the mini-batch statistics
            for name, b in ref_buffers.items():
                if name.endswith(("running_mean", "running_var")):
                    b.copy_(deferred_stats[name.rsplit(".", 1)[0]][name.endswith("var")])
        opt.step()
        ref_opt.step()
    x, _ = data(kind, 3, seed=5)  # eval with 3 samples, fewer than chunks
    got = pipe.eval_step(x)
    if pipe.holds_last_stage:
        torch.testing.assert_close(got, ref.eval()(x), rtol=RTOL, atol=ATOL)
    else:
        assert got is None


class Embed(nn.Module):
    """(features, mask) -> (hidden, mask)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, inp):
        x, mask = inp
        return torch.tanh(self.lin(x)), mask


class Masked(nn.Module):
    """Uses the integer mask; remembers the last mask it saw."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen = None

    def forward(self, inp):
        h, mask = inp
        self.seen = mask
        return self.lin(h) * (mask[:, 0] % 2).unsqueeze(-1).to(h.dtype), mask


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, inp):
        h, mask = inp
        return self.lin(h + mask.ne(0).sum(1, keepdim=True))


def tuple_data(batch):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, 6, generator=g)
    mask = torch.arange(batch * 16).view(batch, 16) % 3 + 2**40 + 1  # int64, not representable in fp16/float32
    return (x, mask), torch.randint(0, 3, (batch,), generator=g)


def run_tuple_boundary(rank, placement, act_codec):
    torch.manual_seed(0)
    model = nn.Sequential(Embed(), Masked(), Head())
    ref = copy.deepcopy(model)
    pipe = Pipeline(list(model), placement, chunks=CHUNKS, loss_fn=F.cross_entropy, act_codec=act_codec, timeout=30)
    inputs, y = tuple_data(8)
    loss = pipe.train_step(inputs, y)
    if 1 in pipe.stages:  # the mask arrived bit-exact, as int64, whatever the activation codec
        assert pipe.stages[1].seen.dtype == torch.int64
        assert torch.equal(pipe.stages[1].seen, inputs[1][-2:])
    ref_loss = 0.0
    for m in range(CHUNKS):
        sl = slice(2 * m, 2 * m + 2)
        lm = F.cross_entropy(ref((inputs[0][sl], inputs[1][sl])), y[sl]) / CHUNKS
        lm.backward()
        ref_loss += lm.item()
    ref_params = dict(ref.named_parameters())
    if act_codec == "none":
        assert loss == pytest.approx(ref_loss, rel=RTOL)
        for i, stage in pipe.stages.items():
            for name, p in stage.named_parameters():
                torch.testing.assert_close(p.grad, ref_params[f"{i}.{name}"].grad, rtol=RTOL, atol=ATOL)
    else:  # fp16 hidden states: close to, but not exactly, the reference
        assert loss == pytest.approx(ref_loss, rel=1e-2) and loss != ref_loss
    for r in pipe.meter.records():
        if r["direction"] == "forward" and r["recv_count"]:
            # per micro-batch: float32[2, 8] hidden states through act_codec, the int64[2, 16] mask
            # through 'intpack' (2 bits a value: 3 distinct values), far less than as int64
            hidden = get_codec(act_codec).encode(torch.zeros(2, 8)).nbytes
            mask = get_codec("intpack").encode(inputs[1][:2]).nbytes
            assert mask == 8 * 12 + 2 * 16 * 2 // 8 < get_codec("none").encode(inputs[1][:2]).nbytes
            assert r["raw_bytes"] == 0 and r["recv_count"] == CHUNKS
            assert r["recv_bytes"] == CHUNKS * (hidden + mask)


def _same(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def run_state_dict_round_trip(rank):
    """Stage weights and stateful-codec state (dgc gradients) survive save/load: a restored
    pipeline continues exactly like the original."""
    x, y = data("mlp", 8, seed=0)
    grad_codec = ("dgc", {"density": 0.25, "warmup_epochs": 0})

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        return Pipeline(split_layers(model, [2, 1]), [0, 1], chunks=CHUNKS, loss_fn=F.cross_entropy,
                        grad_codec=grad_codec, timeout=30)  # fmt: skip

    pipe = build(0)
    pipe.train_step(x, y)
    state = pipe.state_dict()
    assert set(state["stages"]) == {str(rank)}
    codec_keys = set(state["codecs"]["stage0->stage1"])
    assert codec_keys == {f"backward/{m}/0" for m in range(CHUNKS)}, codec_keys
    restored = build(1)
    restored.load_state_dict(state)
    loaded = restored.state_dict()
    for p in (pipe, restored):
        for q in p.parameters():
            q.grad = None
    losses = [p.train_step(x, y) for p in (pipe, restored)]  # communication first, checks after
    assert _same(loaded, state)
    assert losses[0] == losses[1]
    for a, b in zip(pipe.parameters(), restored.parameters()):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match="this rank holds stages"):
        restored.load_state_dict({"stages": {"0": {}, "1": {}}})


def run_frozen_first_stage(rank):
    """No gradient crosses the boundary (stage 0 is frozen): rank 0 still gets the loss,
    carried by the gradient-less backward messages, and the rest trains as unsplit."""
    model = mlp()
    for p in model[:2].parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(model)
    pipe = Pipeline(split_layers(model, [2, 3]), [0, 1], chunks=CHUNKS, loss_fn=F.cross_entropy, timeout=30)
    x, y = data("mlp", 8, seed=0)
    loss = pipe.train_step(x, y)
    assert loss == pytest.approx(reference_step(ref, x, y, CHUNKS), rel=RTOL)
    ref_params = dict(ref.named_parameters())
    for stage in pipe.stages.values():
        for name, p in stage.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=RTOL, atol=ATOL)
            else:
                assert p.grad is None
    records = {(r["name"], r["direction"]): r for r in pipe.meter.records()}
    backward = records[("stage0->stage1", "backward")]
    assert backward["wire_bytes"] == 0 and backward["count" if rank == 1 else "recv_count"] == CHUNKS


def _scenarios(world):
    if world == 2:
        out = {}
        for placement in ([0, 1], [0, 1, 0]):
            tag = "linear2" if placement == [0, 1] else "clientserver"
            out[f"mlp-{tag}"] = lambda r, p=placement: run_equivalence(r, "mlp", p)
            out[f"conv-bn-{tag}"] = lambda r, p=placement: run_equivalence(r, "conv", p)
            out[f"conv-deferred-bn-{tag}"] = lambda r, p=placement: run_equivalence(r, "conv", p, deferred=True)
        out["tuple-clientserver-none"] = lambda r: run_tuple_boundary(r, [0, 1, 0], "none")
        out["tuple-clientserver-fp16"] = lambda r: run_tuple_boundary(r, [0, 1, 0], "fp16")
        out["state-dict-round-trip"] = run_state_dict_round_trip
        out["frozen-first-stage-linear2"] = run_frozen_first_stage
        return out
    return {
        "mlp-linear3": lambda r: run_equivalence(r, "mlp", [0, 1, 2]),
        "conv-bn-linear3": lambda r: run_equivalence(r, "conv", [0, 1, 2]),
        "conv-deferred-bn-linear3": lambda r: run_equivalence(r, "conv", [0, 1, 2], deferred=True),
        "tuple-linear3-none": lambda r: run_tuple_boundary(r, [0, 1, 2], "none"),
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return {world: spawn_checks(_scenarios(world), world, tmp_path_factory.mktemp(f"world{world}"))
            for world in (2, 3)}


@pytest.mark.parametrize("world, name", [(w, n) for w in (2, 3) for n in _scenarios(w)])
def test_pipeline_matches_unsplit_model(outcomes, world, name):
    assert_ranks_ok(outcomes[world], name, world)
