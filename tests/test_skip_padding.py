"""Padding rows stay behind (``BoundarySpec(row_mask=ATTENTION_MASK)``): a client/server split of a tiny BERT whose
boundaries send only the real tokens' rows of the hidden states and of their gradients -- loss and
gradients equal to the unsplit model's, the wire bytes those of the kept rows exactly; with delta
coding, the same losses as whole tensors, fewer bytes, and equal caches on both sides -- and the
message flags and row checks that guard it."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dgpipe.compression import DeltaSpec, get_codec
from dgpipe.models.encoder import ATTENTION_MASK, encoder_layers
from dgpipe.pipeline import BoundarySpec, Pipeline
from dgpipe.pipeline.lanes import put_rows
from dgpipe.pipeline.message import CODED, LOSSLESS, REQUIRES_GRAD, ROW_MASK, ROWS, Message
from helpers import assert_ranks_ok, spawn_checks, tiny_bert

VOCAB, LENGTH, HIDDEN = 120, 12, 32
pytestmark = pytest.mark.usefixtures("one_thread")


def _model():
    return tiny_bert(VOCAB, LENGTH, HIDDEN)


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (8, LENGTH), generator=g)
    mask = torch.ones(8, LENGTH, dtype=torch.int64)
    for row, length in ((1, 7), (2, 3), (5, 9), (6, 1)):
        mask[row, length:] = 0
    ids[mask == 0] = 0
    return ids, mask


def run_client_server(rank):
    """Stages [embeddings + 1 layer | 2 layers | 1 layer + head] on ranks [0, 1, 0], 2 micro-batches, codec
    ``none``: loss and every gradient equal to the unsplit model's; each boundary's forward bytes are the
    kept rows' and the packed mask's payloads, its backward bytes the kept rows' of the gradient."""
    model = _model()
    ref = copy.deepcopy(model)
    layers = encoder_layers(model)  # embeddings, 4 encoder layers, head
    stages = [torch.nn.Sequential(*layers[:2]), torch.nn.Sequential(*layers[2:4]), torch.nn.Sequential(*layers[4:])]
    pipe = Pipeline(stages, [0, 1, 0], chunks=2, loss_fn=F.cross_entropy, timeout=30,
                    boundary=BoundarySpec(row_mask=ATTENTION_MASK))
    (ids, mask), y = _inputs(), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    loss = pipe.train_step((ids, mask), y)

    expected, sent = 0.0, {"stage0->stage1": [0, 0], "stage1->stage2": [0, 0]}
    none, ints = get_codec("none"), get_codec("intpack")
    ref_layers = encoder_layers(ref)
    for m in range(2):
        rows = slice(4 * m, 4 * m + 4)
        keep = mask[rows] != 0
        value = (ids[rows], mask[rows])
        for i, layer in enumerate(ref_layers):
            value = layer(value)
            name = {1: "stage0->stage1", 3: "stage1->stage2"}.get(i)
            if name:  # forward: the kept rows and the mask; backward: the kept rows of the gradient
                kept = value[0].detach()[keep]
                sent[name][0] += none.encode(kept).nbytes + ints.encode(mask[rows]).nbytes
                sent[name][1] += none.encode(kept).nbytes
        micro = F.cross_entropy(value, y[rows]) / 2
        micro.backward()
        expected += float(micro)
    assert abs(loss - expected) < 1e-5

    mine = {n: p for n, p in model.named_parameters() if p.grad is not None}
    assert mine
    ref_params = dict(ref.named_parameters())
    for name, p in mine.items():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    for rec in pipe.meter.records():
        if rec["wire_bytes"]:  # the sending side of this boundary and direction
            assert rec["wire_bytes"] == sent[rec["name"]][rec["direction"] == "backward"], rec
            assert rec["wire_bytes"] < rec["raw_bytes"] * 0.9  # 12 padding rows of 48 stay behind
    pipe.eval_step((ids, mask))  # evaluation sends rows too (no backward follows)


def _delta_pipe(skip_padding):
    layers = encoder_layers(_model())
    stages = [torch.nn.Sequential(*layers[:2]), torch.nn.Sequential(*layers[2:4]), torch.nn.Sequential(*layers[4:])]
    codec = ("codebook", {"bits": 2, "group": "token", "rotate": "hadamard"})
    pipe = Pipeline(stages, [0, 1, 0], chunks=2, loss_fn=F.cross_entropy, timeout=30, act_codec=codec,
                    grad_codec=codec, delta_report=None,
                    boundary=BoundarySpec(delta=DeltaSpec(8), row_mask=ATTENTION_MASK if skip_padding else None))
    return pipe, torch.optim.SGD(pipe.parameters(), lr=0.1)


def run_delta(rank):
    """Delta coding (2-bit token-grouped codebook) through a warm-up step and two coded steps: the same loss at
    every step with and without skip_padding (the codec codes each token's row on its own, so the real rows'
    codes do not depend on the padding's), fewer bytes both ways, and equal caches on both ranks."""
    (ids, mask), y, sample_ids = _inputs(), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]), torch.arange(8)
    losses, wire = {}, {}
    for skip in (False, True):
        pipe, opt = _delta_pipe(skip)
        losses[skip] = []
        for step in range(3):
            pipe.delta_warmup = step == 0
            opt.zero_grad()
            losses[skip].append(pipe.train_step((ids, mask), y, sample_ids=sample_ids))
            opt.step()
        wire[skip] = {(r["name"], r["direction"]): r["wire_bytes"] for r in pipe.meter.records() if r["wire_bytes"]}
        mine = pipe.delta_digests()
        local = torch.tensor([[int(mine[n][0][i:i + 15], 16) for i in range(0, 60, 15)]
                              for n in ("stage0->stage1", "stage1->stage2")])
        everyone = [torch.zeros_like(local) for _ in range(2)]
        dist.all_gather(everyone, local)
        assert torch.equal(everyone[0], everyone[1])
    assert losses[True] == losses[False]
    assert set(wire[True]) == set(wire[False]) and len(wire[True]) == 2  # this rank's two sending directions
    for key, whole in wire[False].items():
        assert wire[True][key] < 0.85 * whole, (key, wire[True][key], whole)


@pytest.fixture(scope="module")
def client_server_outcome(tmp_path_factory):
    return spawn_checks({"client_server": run_client_server, "delta": run_delta}, 2,
                        tmp_path_factory.mktemp("skip_padding"))


def test_client_server_pipeline_sends_real_tokens_only_and_matches_the_unsplit_model(client_server_outcome):
    assert_ranks_ok(client_server_outcome, "client_server", 2)


def test_delta_coding_sends_the_change_of_real_tokens_only(client_server_outcome):
    assert_ranks_ok(client_server_outcome, "delta", 2)


def test_rows_go_back_in_place_with_zeros_for_padding():
    keep = torch.tensor([[True, False, True], [False, False, True]])
    rows = torch.arange(6.0).view(3, 2)
    full = put_rows(rows, keep)
    assert full.shape == (2, 3, 2)
    assert torch.equal(full[keep], rows) and not full[~keep].any()
    with pytest.raises(ValueError, match=r"corrupt payload: \(2, 2\) rows for a mask that keeps 3"):
        put_rows(rows[:2], keep)


@pytest.mark.parametrize("flags", [
    (CODED | REQUIRES_GRAD | ROWS, LOSSLESS | ROW_MASK, LOSSLESS | ROW_MASK),  # two row masks
    (ROWS,),  # an absent tensor has no rows
    (CODED | ROW_MASK,),  # a row mask travels losslessly
    (LOSSLESS | REQUIRES_GRAD | ROW_MASK,),
])
def test_row_flags_are_checked(flags):
    meta = Message((LOSSLESS,), 1, 0).to_meta()[:4] + list(flags)
    with pytest.raises(ValueError, match="corrupt message meta"):
        Message.from_meta(meta, len(flags))


def test_row_flags_round_trip():
    m = Message((CODED | REQUIRES_GRAD | ROWS, LOSSLESS | ROW_MASK), 2, 1)
    back = Message.from_meta(m.to_meta(), 2)
    assert back == m and back.row_mask == 1 and back.rows(0) and not back.rows(1)
    assert back.kind(0) == CODED and back.kind(1) == LOSSLESS and back.requires_grad(0)
