"""Per-token reference (``BoundarySpec(token_reference=...)``, :mod:`dgpipe.compression.wrappers.reference`): the
table's running mean against an independent computation, equal tables and reconstructions on the two sides,
evaluation that reads without writing; a client/server split of a tiny BERT whose boundaries carry the token
ids -- loss and gradients equal to the unsplit model's, exact wire bytes, equal tables on both ranks after
coded training steps -- and the checks that guard it."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dgpipe.compression import get_codec
from dgpipe.compression.wrappers.reference import (ReferenceCoder, ScaledReferenceCoder, TokenReference, TokenTable,
                                                   check_tokens)
from dgpipe.models.encoder import encoder_layers
from dgpipe.pipeline import BoundarySpec, Pipeline
from dgpipe.pipeline.message import CODED, LOSSLESS, REFERENCE, REQUIRES_GRAD, TOKEN_IDS, Message
from helpers import assert_ranks_ok, spawn_checks, tiny_bert

VOCAB, LENGTH, HIDDEN = 120, 12, 32
CODEBOOK = {"count": 5, "group": "token", "rotate": "hadamard", "scale_dtype": "bfloat16"}
pytestmark = pytest.mark.usefixtures("one_thread")


def test_table_is_the_running_mean_of_the_rows_with_a_least_weight():
    """Lossless codec: the table after each message equals a float64 running mean computed here, each
    new row of a token weighted ``max(1 / count, alpha)``, a message's rows at most 1 together."""
    alpha = 0.25
    coder = ReferenceCoder(get_codec("none"), TokenTable(6, alpha))
    g = torch.Generator().manual_seed(0)
    mean, count = torch.zeros(6, 3, dtype=torch.float64), torch.zeros(6)
    for _ in range(7):
        ids = torch.randint(0, 6, (2, 4), generator=g)
        x = torch.randn(2, 4, 3, generator=g)
        coder.encode(x, ids, update=True)
        for t in ids.unique().tolist():
            rows = x[ids == t].double()
            count[t] += len(rows)
            w = min(max(1 / count[t], alpha) * len(rows), 1.0)
            mean[t] += (rows.mean(0) - mean[t]) * w
    torch.testing.assert_close(coder.table.rows.double(), mean, rtol=1e-5, atol=1e-6)
    assert torch.equal(coder.table.count, count.long())


def test_both_sides_hold_the_same_table_and_the_error_falls():
    """Codebook 5 levels on rows that are mostly a function of their token: sender and receiver tables stay
    bit-identical, the receiver returns the sender's reconstruction, the error after 30 messages is under half
    of direct coding's, and an evaluation message (no update) leaves both tables as they were."""
    make = lambda: ReferenceCoder(get_codec("codebook", **CODEBOOK), TokenTable(50))  # noqa: E731
    sender, receiver, direct = make(), make(), get_codec("codebook", **CODEBOOK)
    g = torch.Generator().manual_seed(0)
    emb = 3 * torch.randn(50, 64, generator=g)

    def message():
        ids = torch.randint(0, 50, (4, 16), generator=g)
        return emb[ids] + 0.3 * torch.randn(4, 16, 64, generator=g), ids

    err = lambda x, y: float((x - y).square().sum() / x.square().sum())  # noqa: E731
    for _ in range(30):
        x, ids = message()
        payload = sender.encode(x, ids, update=True)
        y = receiver.decode(payload, ids, update=True)
        assert sender.table.digest() == receiver.table.digest()
    torch.testing.assert_close(sender.table.rows, receiver.table.rows, rtol=0, atol=0)
    x, ids = message()
    before = receiver.table.digest()
    y = receiver.decode(sender.encode(x, ids, update=False), ids, update=False)
    assert receiver.table.digest() == before == sender.table.digest()
    assert y.dtype == x.dtype and y.shape == x.shape
    assert err(x, y) < 0.5 * err(x, direct.decode(direct.encode(x)))


def test_table_state_round_trips_and_is_checked():
    """A table restored from ``state_dict`` has the same digest and codes the next message to the same bytes;
    a state of another vocabulary is refused; an empty state restores an empty table."""
    make = lambda vocab=50: ReferenceCoder(get_codec("codebook", **CODEBOOK), TokenTable(vocab))  # noqa: E731
    coder, g = make(), torch.Generator().manual_seed(0)
    batch = lambda: (torch.randn(2, 8, 64, generator=g), torch.randint(0, 50, (2, 8), generator=g))  # noqa: E731
    for _ in range(4):
        coder.encode(*batch(), update=True)
    restored = make()
    restored.table.load_state_dict(coder.table.state_dict())
    assert restored.table.digest() == coder.table.digest()
    x, ids = batch()
    a, b = coder.encode(x, ids, update=True), restored.encode(x, ids, update=True)
    assert torch.equal(a.header, b.header) and all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))
    assert restored.table.digest() == coder.table.digest()
    with pytest.raises(ValueError, match="do not fit a vocabulary of 49"):
        TokenTable(49).load_state_dict(coder.table.state_dict())
    with pytest.raises(ValueError, match="do not fit"):
        TokenTable(50).load_state_dict({"rows": coder.table.rows, "count": None})
    empty = TokenTable(50)
    empty.load_state_dict(make().table.state_dict())
    assert empty.rows is None and empty.digest() == make().table.digest()


def test_backoff_rows_are_the_running_means_of_first_positions_and_of_the_rest():
    """Lossless codec, ``backoff``: after each message the token rows are the running means of their rows after
    the first position, the last row that of the first positions, the row before it that of all other rows
    (each computed here in float64 with the same least weight); a message's first position reads the last row,
    a token never seen the shared row, a seen one its own (the payload codes exactly ``x`` minus that)."""
    alpha, vocab, d = 0.25, 6, 3
    coder = ReferenceCoder(get_codec("none"), TokenTable(vocab + 2, alpha), backoff=True)
    g = torch.Generator().manual_seed(0)
    mean, count = torch.zeros(vocab + 2, d, dtype=torch.float64), torch.zeros(vocab + 2)
    rest, first = vocab, vocab + 1

    def fold(key, rows):
        count[key] += len(rows)
        w = min(max(1 / count[key], alpha) * len(rows), 1.0)
        mean[key] += (rows.mean(0) - mean[key]) * w

    for step in range(7):
        ids = torch.randint(0, 4 if step < 4 else vocab, (2, 4), generator=g)  # tokens 4, 5 first seen later
        x = torch.randn(2, 4, d, generator=g)
        expected = mean[ids].clone()
        expected[count[ids] == 0] = mean[rest]
        expected[:, 0] = mean[first]
        residual = coder.codec.decode(coder.encode(x, ids, update=True))
        torch.testing.assert_close(residual.double(), x.double() - expected, rtol=1e-5, atol=1e-5)
        for t in ids[:, 1:].unique().tolist():
            fold(t, x[:, 1:][ids[:, 1:] == t].double())
        fold(first, x[:, 0].double())
        fold(rest, x[:, 1:].reshape(-1, d).double())
    torch.testing.assert_close(coder.table.rows.double(), mean, rtol=1e-5, atol=1e-6)
    assert torch.equal(coder.table.count, count.long())
    with pytest.raises(ValueError, match="two shared rows"):
        ReferenceCoder(get_codec("none"), TokenTable(2), backoff=True)


def test_backoff_lowers_the_error_of_sinks_and_unseen_tokens():
    """Rows that are their token's embedding plus noise, a first position offset by a large sink vector shared by
    every sequence, and a channel mean: on a held-out message with a quarter of its tokens never seen in the 20
    training messages, backing off (5-level codebook) leaves under half the error of the plain token table, and
    both sides' tables stay bit-identical."""
    g = torch.Generator().manual_seed(0)
    d, vocab = 64, 60
    emb, sink, offset = torch.randn(vocab, d, generator=g), 30 * torch.randn(d, generator=g), 5 * torch.randn(d)

    def message(high):
        ids = torch.randint(0, high, (4, 16), generator=g)
        x = offset + emb[ids] + 0.1 * torch.randn(4, 16, d, generator=g)
        x[:, 0] += sink
        return x, ids

    make = lambda backoff: ReferenceCoder(get_codec("codebook", **CODEBOOK),  # noqa: E731
                                          TokenTable(vocab + 2 * backoff), backoff=backoff)
    plain, sender, receiver = make(False), make(True), make(True)
    for _ in range(20):
        x, ids = message(40)
        plain.encode(x, ids, update=True)
        receiver.decode(sender.encode(x, ids, update=True), ids, update=True)
        assert sender.digest() == receiver.digest()
    x, ids = message(vocab)
    assert (ids >= 40).float().mean() >= 0.25
    err = lambda c: float((c.decode(c.encode(x, ids, update=False), ids, update=False) - x).pow(2).sum())  # noqa: E731
    assert err(sender) < 0.5 * err(plain), (err(sender), err(plain))


def test_shared_channel_weights_lower_the_error_and_keep_both_sides_equal():
    """Token-keyed means with one shared table of squared residuals (``TokenReference(scale=True)``): residual
    channels whose spread spans 100x (std 0.1 to 10) around per-token means, 50 tokens so that most keys are new
    for a while; from the second message on the weighed coder's error energy is under 0.7x the plain coder's
    (about (mean sqrt v)^2 / mean v = 0.43 for these spreads), both sides' tables stay bit-identical, and the
    state (with the squares) round-trips to the same digest and the same next payload."""
    g = torch.Generator().manual_seed(0)
    d = 64
    std = torch.logspace(-1, 1, d)[torch.randperm(d, generator=g)]
    emb = 3 * torch.randn(50, d, generator=g)
    codec = get_codec("codebook", bits=2, group="token", rotate="hadamard")
    scaled = lambda: ScaledReferenceCoder(codec, TokenTable(50), TokenTable(1), shared=True)  # noqa: E731
    plain = [ReferenceCoder(codec, TokenTable(50)) for _ in range(2)]
    sender, receiver = scaled(), scaled()
    errors = {"plain": 0.0, "weighed": 0.0}
    for step in range(6):
        ids = torch.randint(0, 50, (4, 16), generator=g)
        x = emb[ids] + torch.randn(4, 16, d, generator=g) * std
        y_plain = plain[1].decode(plain[0].encode(x, ids, update=True), ids, update=True)
        y = receiver.decode(sender.encode(x, ids, update=True), ids, update=True)
        assert sender.digest() == receiver.digest()
        if step:
            errors["plain"] += float((y_plain - x).pow(2).sum())
            errors["weighed"] += float((y - x).pow(2).sum())
    assert errors["weighed"] < 0.7 * errors["plain"], errors
    assert sender.squares.rows.shape == (1, d)
    restored = scaled()
    restored.load_state_dict(copy.deepcopy(sender.state_dict()))
    assert restored.digest() == sender.digest() != plain[0].digest()
    ids = torch.randint(0, 50, (4, 16), generator=g)
    x = emb[ids] + torch.randn(4, 16, d, generator=g) * std
    a, b = sender.encode(x, ids, update=True), restored.encode(x, ids, update=True)
    assert torch.equal(a.header, b.header) and all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))
    with pytest.raises(ValueError, match="without its squares"):
        scaled().load_state_dict(plain[0].state_dict())
    with pytest.raises(ValueError, match="one row, not 50"):
        ScaledReferenceCoder(codec, TokenTable(50), TokenTable(50), shared=True)


def test_token_checks():
    with pytest.raises(ValueError, match="outside"):
        check_tokens(torch.tensor([[0, 7]]), 7, (1, 2), "ids")
    with pytest.raises(ValueError, match="expected integer"):
        check_tokens(torch.zeros(1, 2), 7, (1, 2), "ids")
    with pytest.raises(ValueError, match="expected integer"):
        check_tokens(torch.zeros(2, 1, dtype=torch.int64), 7, (1, 2), "ids")
    with pytest.raises(ValueError, match="alpha"):
        TokenReference(10, alpha=0.0)
    with pytest.raises(ValueError, match="vocab"):
        TokenReference(0)
    coder = ReferenceCoder(get_codec("none"), TokenTable(10))
    with pytest.raises(ValueError, match="for token ids"):
        coder.encode(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.int64), update=True)


@pytest.mark.parametrize("flags", [
    (CODED | REFERENCE | REQUIRES_GRAD,),  # a reference-coded tensor without token ids
    (CODED | REFERENCE, LOSSLESS | TOKEN_IDS, LOSSLESS | TOKEN_IDS),  # two token ids positions
    (CODED | TOKEN_IDS,),  # token ids travel losslessly
    (LOSSLESS | REFERENCE, LOSSLESS | TOKEN_IDS),  # only a coded tensor has a reference
])
def test_reference_flags_are_checked(flags):
    meta = Message((LOSSLESS,), 1, 0).to_meta()[:4] + list(flags)
    with pytest.raises(ValueError, match="corrupt message meta"):
        Message.from_meta(meta, len(flags))


def test_reference_flags_round_trip():
    m = Message((CODED | REFERENCE | REQUIRES_GRAD, LOSSLESS, LOSSLESS | TOKEN_IDS), 2, 1)
    back = Message.from_meta(m.to_meta(), 3)
    assert back == m and back.token_ids == 2 and back.referenced(0) and not back.referenced(1)
    assert back.kind(0) == CODED and back.kind(2) == LOSSLESS


def _model():
    return tiny_bert(VOCAB, LENGTH, HIDDEN)


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 40, (8, LENGTH), generator=g)  # 35 distinct tokens: rows repeat across messages
    mask = torch.ones(8, LENGTH, dtype=torch.int64)
    mask[2, 5:] = 0
    ids[mask == 0] = 0
    return ids, mask


def _stages(model):
    layers = encoder_layers(model, carry_ids=True)  # embeddings, 4 encoder layers, head
    return [torch.nn.Sequential(*layers[:2]), torch.nn.Sequential(*layers[2:4]), torch.nn.Sequential(*layers[4:])]


def run_lossless(rank):
    """Codec ``none`` with the reference on stages [embeddings + 1 layer | 2 layers | 1 layer + head] on ranks
    [0, 1, 0], 2 micro-batches, two SGD steps: losses and the first step's gradients equal to the unsplit
    model's (the residual adds back to the tensor within float rounding); each boundary's forward bytes are
    the residual's, the packed mask's and the packed ids' payloads, its backward bytes the gradient's."""
    model = _model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(_stages(model), [0, 1, 0], chunks=2, loss_fn=F.cross_entropy, timeout=30,
                    boundary=BoundarySpec(token_reference=TokenReference(VOCAB)))
    (ids, mask), y = _inputs(), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    loss = pipe.train_step((ids, mask), y)
    out = ref(input_ids=ids, attention_mask=mask).logits
    expected = F.cross_entropy(out, y)
    expected.backward()
    assert abs(loss - float(expected)) < 1e-5
    ref_params = dict(ref.named_parameters())
    mine = {n: p for n, p in model.named_parameters() if p.grad is not None}
    assert mine
    for name, p in mine.items():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)

    none, ints = get_codec("none"), get_codec("intpack")
    hidden_bytes = none.encode(torch.zeros(4, LENGTH, HIDDEN)).nbytes
    forward = 2 * (hidden_bytes + ints.encode(mask[:4]).nbytes + ints.encode(ids[:4]).nbytes)
    for rec in pipe.meter.records():
        if rec["wire_bytes"]:  # the sending side of this boundary and direction
            assert rec["wire_bytes"] == (2 * hidden_bytes if rec["direction"] == "backward" else forward), rec


def run_coded(rank, scale=False, backoff=False):
    """The 5-level codebook with the reference (``scale``, ``backoff``: its options): three training steps, then
    an evaluation step; the two ranks of each boundary hold equal tables after training and after evaluation
    (which leaves them unchanged), the tables go into ``state_dict`` and come back from it, and each forward
    message costs the codebook's payload of the residual plus the ids (the weights cost no byte)."""
    codec = ("codebook", CODEBOOK)
    pipe = Pipeline(_stages(_model()), [0, 1, 0], chunks=2, loss_fn=F.cross_entropy, timeout=30, act_codec=codec,
                    grad_codec=codec,
                    boundary=BoundarySpec(token_reference=TokenReference(VOCAB, scale=scale, backoff=backoff)))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    (ids, mask), y = _inputs(), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    for _ in range(3):
        opt.zero_grad()
        pipe.train_step((ids, mask), y)
        opt.step()

    def digests():
        mine = pipe.reference_digests()
        local = torch.tensor([[int(mine[n][0][i:i + 15], 16) for i in range(0, 60, 15)]
                              for n in ("stage0->stage1", "stage1->stage2")])
        everyone = [torch.zeros_like(local) for _ in range(2)]
        dist.all_gather(everyone, local)
        assert torch.equal(everyone[0], everyone[1])
        return local

    trained = digests()
    saved = pipe.state_dict()["reference"]
    assert set(saved) == {"stage0->stage1", "stage1->stage2"}  # rank 0 sends one, receives the other; rank 1 too
    pipe.eval_step((ids, mask))
    assert torch.equal(digests(), trained)
    before = pipe.reference_digests()
    empty = {"rows": None, "count": None}
    assert all(state["0"]["rows"].shape == (VOCAB + 2 * backoff, HIDDEN) for state in saved.values())
    if scale:
        assert all(state["0"]["squares"]["rows"].shape == (1, HIDDEN) for state in saved.values())
        empty["squares"] = {"rows": None, "count": None}
    pipe.load_state_dict({**pipe.state_dict(), "reference": {name: {"0": empty} for name in saved}})
    assert pipe.reference_digests() != before  # emptied
    pipe.load_state_dict({**pipe.state_dict(), "reference": saved})
    assert pipe.reference_digests() == before  # and restored from the checkpoint's tables
    coded = get_codec("codebook", **CODEBOOK).encode(torch.randn(4, LENGTH, HIDDEN)).nbytes
    ints = get_codec("intpack")
    forward = 3 * 2 * (coded + ints.encode(mask[:4]).nbytes + ints.encode(ids[:4]).nbytes)
    for rec in pipe.meter.records():
        if rec["wire_bytes"] and rec["direction"] == "forward":
            assert rec["wire_bytes"] == forward, rec


def run_coded_scaled(rank):
    run_coded(rank, scale=True, backoff=True)


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    return spawn_checks({"lossless": run_lossless, "coded": run_coded, "scaled": run_coded_scaled}, 2,
                        tmp_path_factory.mktemp("token_reference"))


def test_client_server_pipeline_with_the_reference_matches_the_unsplit_model(outcome):
    assert_ranks_ok(outcome, "lossless", 2)


def test_both_ranks_build_the_same_tables_and_evaluation_leaves_them(outcome):
    assert_ranks_ok(outcome, "coded", 2)


def test_weighed_channels_keep_both_ranks_tables_equal(outcome):
    assert_ranks_ok(outcome, "scaled", 2)
