"""Partition, placement and schedule helpers, and configuration errors (one process, no spawning)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dgpipe.pipeline import (
    Pipeline,
    balance_by_params,
    balance_by_time,
    bubble_fraction,
    client_server_placement,
    linear_placement,
    spawn,
    split_layers,
    validate_placement,
)
from dgpipe.pipeline.schedule import gpipe_tasks, segments


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def test_split_layers_shares_modules_and_keeps_names():
    model = mlp()
    stages = split_layers(model, [2, 3])
    assert [len(s) for s in stages] == [2, 3]
    assert stages[1][0] is model[2]
    assert set(stages[1].state_dict()) == {"2.weight", "2.bias", "4.weight", "4.bias"}
    x = torch.randn(5, 6)
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=0)
    assert [len(s) for s in split_layers(list(model), [1, 1, 3])] == [1, 1, 3]


@pytest.mark.parametrize("balance, match", [([2, 2], "sum to 5"), ([0, 5], "positive"), ([], "positive")])
def test_split_layers_rejects_bad_balance(balance, match):
    with pytest.raises(ValueError, match=match):
        split_layers(mlp(), balance)


def test_balance_by_params_evens_out_parameters():
    layers = [nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10), nn.ReLU()]
    # 110, 0, 1100, 0, 1010, 0 parameters: the two big layers must land in different stages
    balance = balance_by_params(layers, 2)
    assert sum(balance) == 6 and len(balance) == 2
    assert balance[0] in (3, 4)
    with pytest.raises(ValueError, match="into 7 stages"):
        balance_by_params(layers, 7)


def test_balance_by_time_returns_a_valid_balance():
    balance = balance_by_time(mlp(), 2, torch.randn(8, 6), timeout=0.05)
    assert len(balance) == 2 and sum(balance) == 5 and min(balance) >= 1


def test_builtin_placements():
    assert linear_placement(3) == [0, 1, 2]
    assert client_server_placement() == [0, 1, 0]
    assert validate_placement((0, 1, 0), 3, 2) == [0, 1, 0]


@pytest.mark.parametrize(
    "placement, n_stages, world, match",
    [
        ([0, 1], 3, 2, "has 2 entries but there are 3 stages"),
        ([0, 2], 2, 2, r"placement\[1\] = 2 is not a rank"),
        ([0, 0, 2], 3, 3, r"leaves rank\(s\) \[1\] without a stage"),
        ([0, -1], 2, 2, r"placement\[1\] = -1"),
    ],
)
def test_validate_placement_errors(placement, n_stages, world, match):
    with pytest.raises(ValueError, match=match):
        validate_placement(placement, n_stages, world)


def test_segments_merge_consecutive_stages_of_one_rank():
    assert [(s.rank, s.first, s.last) for s in segments([0, 1, 0])] == [(0, 0, 0), (1, 1, 1), (0, 2, 2)]
    assert [(s.rank, s.first, s.last) for s in segments([0, 0, 1, 1, 0])] == [(0, 0, 1), (1, 2, 3), (0, 4, 4)]


def test_gpipe_tasks_client_order():
    tasks = [(t.phase[0], t.micro, t.segment) for t in gpipe_tasks(segments([0, 1, 0]), 0, 4)]
    # every micro-batch of the first stage before the last stage of any; backward in reverse
    assert tasks == [
        ("f", 0, 0), ("f", 1, 0), ("f", 2, 0), ("f", 3, 0), ("f", 0, 2), ("f", 1, 2), ("f", 2, 2), ("f", 3, 2),
        ("b", 3, 2), ("b", 2, 2), ("b", 1, 2), ("b", 0, 2), ("b", 3, 0), ("b", 2, 0), ("b", 1, 0), ("b", 0, 0),
    ]  # fmt: skip
    # a rank with one segment: micro-batches in order, backward reversed
    assert [(t.phase[0], t.micro) for t in gpipe_tasks(segments([0, 1, 0]), 1, 2)] == [
        ("f", 0), ("f", 1), ("b", 1), ("b", 0)]


def _simulate(placement, n_micro):
    """Run every rank's task list with blocking receives; True if all finish (no deadlock)."""
    segs = segments(placement)
    queues = {r: gpipe_tasks(segs, r, n_micro) for r in set(placement)}
    done = set()
    last = len(segs) - 1
    progress = True
    while progress:
        progress = False
        for r, q in queues.items():
            while q:
                t = q[0]
                if t.phase == "forward":
                    ready = t.segment == 0 or ("forward", t.micro, t.segment - 1) in done
                else:
                    ready = ("forward", t.micro, t.segment) in done and (
                        t.segment == last or ("backward", t.micro, t.segment + 1) in done
                    )
                if not ready:
                    break
                done.add((t.phase, t.micro, t.segment))
                q.pop(0)
                progress = True
    return all(not q for q in queues.values()) and len(done) == 2 * n_micro * len(segs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=7), st.integers(1, 6))
def test_gpipe_schedule_never_deadlocks(raw, n_micro):
    ranks = sorted(set(raw))
    placement = [ranks.index(r) for r in raw]  # every rank 0..R-1 used
    assert _simulate(placement, n_micro)


def test_bubble_fraction():
    assert bubble_fraction(1, 4) == 0
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    with pytest.raises(ValueError):
        bubble_fraction(2, 0)


def test_one_process_pipeline_matches_unsplit_model():
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = Pipeline(split_layers(model, [2, 3]), [0, 0], chunks=4, loss_fn=F.mse_loss)
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    loss, out = pipe.train_step(x, y, return_outputs=True)
    ref_loss = 0.0
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        lm = F.mse_loss(ref(xm), ym) / 4
        lm.backward()
        ref_loss += lm.item()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(out, ref(x).detach(), rtol=1e-5, atol=1e-6)
    for (name, p), (rname, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert name == rname
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-7)
    assert pipe.holds_first_stage and pipe.holds_last_stage
    assert len(list(pipe.parameters())) == 6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"chunks": 0}, "chunks must be a positive int"),
        ({"chunks": 2.0}, "chunks must be a positive int"),
        ({"placement": [0, 1]}, r"placement\[1\] = 1 is not a rank"),
        ({"placement": [0]}, "has 1 entries but there are 2 stages"),
        ({"rank": 1}, "rank=1 but this process is rank 0"),
        ({"timeout": 0}, "timeout must be a positive"),
        ({"act_codec": "nosuchcodec"}, "unknown codec 'nosuchcodec'"),
        ({"act_codec": ["none", "none"]}, "lists 2 codecs but there are 1 stage boundaries"),
        ({"grad_codec": ("fp16", {"bits": 3})}, "bad options for codec 'fp16'"),
        ({"act_codec": lambda: 3}, "returned int, not a Codec"),
    ],
)
def test_pipeline_rejects_bad_configuration(kwargs, match):
    args = {"placement": [0, 0], "chunks": 2, "loss_fn": F.mse_loss, **kwargs}
    with pytest.raises(ValueError, match=match):
        Pipeline(split_layers(mlp(), [2, 3]), **args)


@pytest.mark.parametrize(
    "batch, match",
    [(3, "chunks=4 is larger than the batch of 3"), (6, "a batch of 6 does not split into chunks=4")],
)
def test_train_step_rejects_bad_chunking(batch, match):
    pipe = Pipeline(split_layers(mlp(), [2, 3]), [0, 0], chunks=4, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=match):
        pipe.train_step(torch.randn(batch, 6), torch.randn(batch, 4))


def test_eval_step_accepts_any_batch_size():
    model = mlp()
    pipe = Pipeline(split_layers(model, [2, 3]), [0, 0], chunks=4)
    x = torch.randn(3, 6)
    torch.testing.assert_close(pipe.eval_step(x), model(x))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"world_size": 0}, "world_size must be a positive int"), ({"backend": "mpi"}, "backend must be"),
     ({"timeout": -1}, "timeout must be positive")],
)  # fmt: skip
def test_spawn_rejects_bad_arguments_before_starting(kwargs, match):
    args = {"world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        spawn(print, **args)
