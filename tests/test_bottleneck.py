"""Boundary bottlenecks (dgpipe.models.bottleneck): an encoder (H -> d) at the end of a stage and a decoder
(d -> H) at the start of the next.

In one process: widths and their errors; the identity pair leaves a model's logits bit for bit; an orthonormal
pair is a projection; the principal-component start reconstructs states with the error Eckart-Young predicts
(the trailing singular values of the centred states, computed here on their own).

Spawned (gloo, 2 ranks): a tiny Llama with bottlenecks of 16 channels (H = 64) trained one step through dgpipe's
runtime (client/server [0, 1, 0]) and through ``CompressedPipelineStage`` under torch's 1F1B, uncompressed, gives
the loss and every gradient of the same bottleneck model run unsplit, micro-batch by micro-batch; the wire carries
16 channels each way; with d = H the identity pairs give the original model's loss; anchored pairs (the token
embedding shared by the client's and the server's stages) likewise, the ids crossing forward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dgpipe.compression import get_codec
from dgpipe.models import client_server_split
from dgpipe.models.bottleneck import (BottleneckDecoder, BottleneckEncoder, bottleneck_pair, fit_bottlenecks,
                                      fit_principal_components, insert_bottlenecks, parse_width, parse_widths)
from dgpipe.models.causal_lm import causal_lm_layers
from dgpipe.pipeline import Pipeline, split_layers
from dgpipe.pipeline.tied import TiedParameters
from helpers import (assert_grads_match, assert_ranks_ok, lm_loss, spawn_checks, tiny_llama, token_batch,
                     unsplit_reference)

VOCAB, LENGTH, BATCH, CHUNKS, H, D = 97, 16, 4, 2, 64, 16


def tiny():
    return tiny_llama(VOCAB, LENGTH)


def batch():
    return token_batch(VOCAB, BATCH, LENGTH)


def test_widths_and_their_errors():
    assert parse_width("16", 64) == 16 and parse_width("1/16", 576) == 36 and parse_width(64, 64) == 64
    assert parse_widths("1/4", 64, 2) == {0: 16, 1: 16} and parse_widths("1:8", 64, 2) == {1: 8}
    for bad, message in (("0", r"must be in \[1, 64\]"), ("65", r"must be in \[1, 64\]"), ("x", "give channels D"),
                         ("1/128", r"= 0 channels")):
        with pytest.raises(ValueError, match=message):
            parse_width(bad, 64)
    with pytest.raises(ValueError, match="boundary 2 is not one of 0..1"):
        parse_widths("2:8", 64, 2)
    with pytest.raises(ValueError, match="this partition has none"):
        parse_widths("8", 64, 0)
    with pytest.raises(ValueError, match="an identity bottleneck has the model's width 64, not 8"):
        bottleneck_pair(64, 8, "identity")
    with pytest.raises(ValueError, match="the partition's boundaries are 0..1"):
        insert_bottlenecks([nn.Identity()] * 3, {2: 8}, 64)


def test_identity_pairs_leave_the_logits_bit_for_bit():
    model = tiny().eval()
    x, _ = batch()
    stages = insert_bottlenecks(client_server_split(causal_lm_layers(model), 1, (1, 1)), H, H)
    assert [list(dict(s.named_children()))[0] for s in stages][1:] == ["bottleneck_decoder"] * 2
    assert isinstance(stages[0][-1], BottleneckEncoder) and isinstance(stages[1][0], BottleneckDecoder)
    with torch.no_grad():
        assert torch.equal(nn.Sequential(*stages)(x), model(x).logits)


def test_anchored_pairs_rebuild_the_token_embedding():
    """An anchored pair codes the residual stream less the token embedding of the ids (the value's last tensor):
    the identity pair leaves the logits (to rounding), and an orthonormal pair's reconstruction error is that of
    the embedding-free part alone -- a residual stream that is only the embedding crosses exactly."""
    model = tiny().eval()
    x, _ = batch()
    layers = causal_lm_layers(model, carry_ids=True)
    embed = layers[0].embed_tokens
    stages = insert_bottlenecks(client_server_split(layers, 1, (1, 1)), H, H, anchor=embed)
    with torch.no_grad():
        torch.testing.assert_close(nn.Sequential(*stages)(x), model(x).logits, rtol=1e-5, atol=1e-5)
        enc, dec = bottleneck_pair(H, 1, "orthonormal", anchor=embed)
        hidden = embed(x)
        torch.testing.assert_close(dec(enc((hidden, x)))[0], hidden, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="needs the token ids as the value's last tensor"):
        enc(hidden)


def test_orthonormal_pair_is_a_projection():
    enc, dec = bottleneck_pair(H, D, "orthonormal", torch.Generator().manual_seed(0))
    x = torch.randn(50, H)
    with torch.no_grad():
        p = dec(enc(x))
        torch.testing.assert_close(dec(enc(p)), p, rtol=0, atol=1e-5)  # idempotent
        assert float((p * (x - p)).sum(1).abs().max()) < 1e-4  # the error is orthogonal to what is kept


def test_principal_components_reconstruct_with_the_eckart_young_error():
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(1, -2, H)  # channels of falling variance, rotated, around a large mean
    rotation, _ = torch.linalg.qr(torch.randn(H, H, generator=g))
    states = (torch.randn(400, H, generator=g) * scales) @ rotation.T + 5.0
    enc, dec = bottleneck_pair(H, D, "orthonormal")
    kept = fit_principal_components(enc, dec, states)
    with torch.no_grad():
        error = float(((dec(enc(states)) - states).double() ** 2).sum())
    s = torch.linalg.svdvals((states - states.mean(0)).double())
    assert error == pytest.approx(float((s[D:] ** 2).sum()), rel=1e-3)
    assert kept == pytest.approx(float((s[:D] ** 2).sum() / (s**2).sum()), rel=1e-9)
    low_rank = states[:, :D] @ torch.randn(D, H, generator=g) + 3.0  # rank D around a mean: kept exactly
    assert fit_principal_components(enc, dec, low_rank) == pytest.approx(1.0)
    with torch.no_grad():
        torch.testing.assert_close(dec(enc(low_rank)), low_rank, rtol=0, atol=1e-3)


def test_fit_bottlenecks_starts_every_boundary_from_its_own_states():
    """Each pair is fitted on the states that reach it -- computed here layer by layer, through the pairs fitted
    before -- and reconstructs them with the Eckart-Young error of those states."""
    model = tiny().eval()
    x = torch.randint(0, VOCAB, (8, LENGTH), generator=torch.Generator().manual_seed(2))
    stages = insert_bottlenecks(client_server_split(causal_lm_layers(model), 1, (1, 1)), D, H, "orthonormal")
    kept = fit_bottlenecks(stages, x)
    assert set(kept) == {0, 1} and all(0.5 < k < 1 for k in kept.values())
    with torch.no_grad():
        value = x
        for i in (0, 1):
            for layer in list(stages[i].children())[i:-1]:  # after the decoder (applied below), up to the encoder
                value = layer(value)
            states = value.reshape(-1, H)
            enc, dec = stages[i][-1], stages[i + 1][0]
            error = float(((dec(enc(states)) - states).double() ** 2).sum())
            s = torch.linalg.svdvals((states - states.mean(0)).double())
            assert error == pytest.approx(float((s[D:] ** 2).sum()), rel=1e-3)
            assert kept[i] == pytest.approx(float((s[:D] ** 2).sum() / (s**2).sum()), rel=1e-6)
            value = dec(enc(value))  # the next stage starts from the reconstruction


# -- split equals unsplit, across processes ---------------------------------------------------------------------


def _stages(width: int, kind: str, anchored: bool = False):
    layers = causal_lm_layers(tiny(), carry_ids=anchored)
    cut = client_server_split(layers, 1, (1, 1)) if kind == "client-server" else split_layers(layers, [3, 3])
    return insert_bottlenecks(cut, width, H, "identity" if width == H else "orthonormal", seed=3,
                              anchor=layers[0].embed_tokens if anchored else None)


def _reference(width: int, kind: str, x, y, chunks: int, anchored: bool = False):
    """Loss and gradients (by position in the bottleneck model's parameters) of the same model unsplit."""
    return unsplit_reference(_stages(width, kind, anchored), x, y, chunks)


def _dgpipe_check(width: int, anchored: bool = False):
    def check(rank: int) -> None:
        stages = _stages(width, "client-server", anchored)
        codec = get_codec("none")
        pipe = Pipeline(stages, [0, 1, 0], chunks=CHUNKS, loss_fn=lm_loss, act_codec=codec)
        x, y = batch()
        loss = pipe.train_step(x, y)
        want_loss, reference = _reference(width, "client-server", x, y, CHUNKS, anchored)
        assert abs(loss - want_loss) < 1e-5 * abs(want_loss)
        assert_grads_match(stages, reference, [s for s, r in zip(stages, [0, 1, 0]) if r == rank])
        payload = codec.encode(torch.randn(BATCH // CHUNKS, LENGTH, width)).nbytes  # d channels each way
        ids = get_codec("intpack").encode(x[: BATCH // CHUNKS]).nbytes if anchored else 0  # forward: the ids too
        for r in pipe.meter.records():
            assert r["wire_bytes"] in (0, CHUNKS * (payload + (ids if r["direction"] == "forward" else 0))), r
        if anchored:  # the embedding is shared by the client's and the server's stages: its gradients summed
            assert TiedParameters(stages, [0, 1, 0], rank).shared
        if width == H:  # the identity pairs: the original model's loss
            model = tiny()
            want = sum(float(lm_loss(model(xm).logits, ym)) for xm, ym in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)))
            assert abs(loss - want / CHUNKS) < 1e-5 * abs(loss)
    check.__name__ = f"dgpipe_client_server_{width}" + ("_anchored" if anchored else "")
    return check


def check_torch_1f1b(rank: int) -> None:
    from torch.distributed.pipelining import Schedule1F1B

    from dgpipe.pipelining import CompressedPipelineStage
    from dgpipe.pipelining import PositionalStage

    stages = _stages(D, "linear")
    stage = CompressedPipelineStage(PositionalStage(stages[rank]), rank, 2, torch.device("cpu"), act_codec="none",
                                    grad_codec="none")
    schedule = Schedule1F1B(stage, BATCH, loss_fn=lm_loss)
    x, y = batch()
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    TiedParameters(stages, [0, 1], rank).sum_gradients()
    want_loss, reference = _reference(D, "linear", x, y, BATCH)
    if rank == 1:
        assert abs(float(torch.stack(losses).mean()) - want_loss) < 1e-5 * abs(want_loss)
    assert_grads_match(stages, reference, [stages[rank]])


CHECKS = {c.__name__: c for c in (_dgpipe_check(D), _dgpipe_check(H), _dgpipe_check(D, True), check_torch_1f1b)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return spawn_checks(CHECKS, 2, tmp_path_factory.mktemp("bottleneck"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_split_equals_unsplit(outcomes, name):
    assert_ranks_ok(outcomes, name, 2)
