"""A residual stream in a shared subspace (dgpipe.models.subspace): the boundary pairs code it exactly.

In one process: a tiny Llama constrained to 16 of its 64 channels keeps every layer's residual stream at
``T[ids] + U c`` (the part outside the subspace, less the fixed table, is float rounding), so the pair's round trip
returns the states it was given; the constrained model's logits change when a weight's update leaves the subspace
only through the subspace; with k = H the constraint is the identity (the original model's logits); bad input.

Spawned (gloo, 2 ranks): the constrained model with its pairs trained one step through dgpipe's runtime
(client/server [0, 1, 0]) and through ``CompressedPipelineStage`` under torch's 1F1B gives the loss and every
gradient of the same model run unsplit; 16 channels cross each way and the ids forward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dgpipe.compression import get_codec
from dgpipe.models import client_server_split
from dgpipe.models.causal_lm import causal_lm_layers
from dgpipe.models.subspace import ResidualSubspace, constrain_layers, residual_subspace, subspace_pairs
from dgpipe.pipeline import Pipeline, split_layers
from dgpipe.pipeline.tied import TiedParameters
from helpers import (assert_grads_match, assert_ranks_ok, lm_loss, spawn_checks, tiny_llama, token_batch,
                     unsplit_reference)

VOCAB, LENGTH, BATCH, CHUNKS, H, K = 97, 16, 4, 2, 64, 16


def tiny():
    return tiny_llama(VOCAB, LENGTH)


def batch():
    return token_batch(VOCAB, BATCH, LENGTH)


def constrained(width: int = K, stage_tables: bool = False):
    """The tiny Llama's layers constrained to a subspace of ``width`` channels, and the subspace (with stage
    tables: the embeddings unconstrained)."""
    model = tiny()
    layers = causal_lm_layers(model, carry_ids=True)
    with torch.no_grad():  # a trained-looking embedding: not the table it started from
        layers[0].embed_tokens.weight.add_(0.05 * torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(2)))
    subspace = residual_subspace(layers[0].embed_tokens, VOCAB, width, seed=5)
    subspace.table.copy_(0.02 * torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(3)))
    constrain_layers(layers, subspace, embeddings=not stage_tables)
    return layers, subspace


def stage_tables(embedding: nn.Embedding, stages: int) -> list[nn.Module]:
    """The first stage's table is the embedding; each later one a copy, moved off it (as training would)."""
    tables = [embedding]
    for j in range(1, stages):
        table = nn.Embedding(VOCAB, H)
        with torch.no_grad():
            moved = 0.03 * torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(j))
            table.weight.copy_(embedding.weight + moved)
        tables.append(table)
    return tables


@torch.no_grad()
def test_every_layer_keeps_the_stream_in_the_subspace_and_the_pair_is_exact():
    layers, subspace = constrained()
    assert torch.allclose(subspace.basis.T @ subspace.basis, torch.eye(K), atol=1e-6)
    x, _ = batch()
    value = x
    stages = subspace_pairs(split_layers(layers, [4, 2]), subspace)
    encoder, decoder = stages[0][-1], stages[1][0]
    assert not any(p.requires_grad for p in [*encoder.parameters(), *decoder.parameters()])
    for layer in layers[:-1]:
        value = layer(value)
        hidden, ids = value[0], value[-1]
        residual = hidden - subspace(ids)
        outside = residual - subspace.project(residual)
        assert float(outside.abs().max()) < 1e-6 * float(residual.abs().max())
        assert float(residual.abs().max()) > 0.01  # the layers did write
        crossed = encoder(value)
        assert crossed[0].shape == (BATCH, LENGTH, K)
        torch.testing.assert_close(decoder(crossed)[0], hidden, rtol=0, atol=1e-6)


@torch.no_grad()
def test_with_stage_tables_each_stage_keeps_its_own_table_outside_the_subspace():
    """Stage tables: inside stage j the stream less stage j's table is in the subspace, and each pair's round trip
    (the encoder with its stage's table, the decoder with the next one's) hands the next stage its own table plus
    the same coordinates."""
    layers, subspace = constrained(stage_tables=True)
    tables = stage_tables(layers[0].embed_tokens, 3)
    stages = subspace_pairs(split_layers(layers, [2, 2, 2]), subspace, tables)
    x, _ = batch()
    value = x
    for j, stage in enumerate(stages[:-1]):
        inner = value
        for layer in list(stage.children())[:-1]:  # up to the encoder
            inner = layer(inner)
        hidden, ids = inner[0], inner[-1]
        residual = hidden - tables[j](ids)
        assert float((residual - subspace.project(residual)).abs().max()) < 1e-6 * float(residual.abs().max())
        value = stage[-1](inner)
        decoded = stages[j + 1][0](value)[0]
        torch.testing.assert_close(decoded, tables[j + 1](ids) + subspace.project(residual), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="2 token tables for 3 stages"):
        subspace_pairs(split_layers(layers, [2, 2, 2]), subspace, tables[:2])


def test_the_basis_and_table_stay_out_of_a_checkpoint():
    """Every rank rebuilds them from the seed and the model as initialised: a stage's state holds the frozen pairs'
    weights (the basis) but neither buffer."""
    layers, subspace = constrained()
    stages = subspace_pairs(split_layers(layers, [4, 2]), subspace)
    keys = [k for stage in stages for k in stage.state_dict()]
    assert "bottleneck_encoder.proj.weight" in keys
    assert not [k for k in keys if k.endswith((".table", ".basis"))]


def test_the_stream_outside_the_subspace_is_the_fixed_table():
    layers, subspace = constrained()
    x, _ = batch()
    hidden = layers[0](x)[0]
    # with the embedding moved off the table: T[ids] plus the move's projection, not the moved embedding itself
    want = subspace(x) + subspace.project(layers[0].embed_tokens(x) - subspace(x))
    torch.testing.assert_close(hidden, want)
    assert float((hidden - layers[0].embed_tokens(x)).abs().max()) > 1e-3


def test_the_full_width_subspace_is_the_original_model():
    model = tiny()
    layers = causal_lm_layers(model, carry_ids=True)
    x, _ = batch()
    want = model(x).logits
    constrain_layers(layers, residual_subspace(layers[0].embed_tokens, VOCAB, H, seed=5))
    value = x
    for layer in layers:
        value = layer(value)
    torch.testing.assert_close(value, want, rtol=1e-4, atol=1e-5)


def test_bad_input():
    model = tiny()
    with pytest.raises(ValueError, match=r"must be in \[1, 64\]"):
        residual_subspace(model.model.embed_tokens, VOCAB, 65, seed=0)
    with pytest.raises(ValueError, match="carry_ids=True"):
        constrain_layers(causal_lm_layers(model), residual_subspace(model.model.embed_tokens, VOCAB, 8, 0))
    with pytest.raises(ValueError, match="basis"):
        ResidualSubspace(torch.zeros(64, 8), torch.zeros(10, 32))


# -- split equals unsplit, across processes ---------------------------------------------------------------------


def _stages(kind: str, tables: bool = False):
    layers, subspace = constrained(stage_tables=tables)
    cut = client_server_split(layers, 1, (1, 1)) if kind == "client-server" else split_layers(layers, [3, 3])
    return subspace_pairs(cut, subspace, stage_tables(layers[0].embed_tokens, len(cut)) if tables else None)


def _reference(kind: str, x, y, chunks: int, tables: bool = False):
    return unsplit_reference(_stages(kind, tables), x, y, chunks)


def check_dgpipe_client_server(rank: int, tables: bool = False) -> None:
    stages = _stages("client-server", tables)
    codec = get_codec("none")
    pipe = Pipeline(stages, [0, 1, 0], chunks=CHUNKS, loss_fn=lm_loss, act_codec=codec)
    x, y = batch()
    loss = pipe.train_step(x, y)
    want_loss, reference = _reference("client-server", x, y, CHUNKS, tables)
    assert abs(loss - want_loss) < 1e-5 * abs(want_loss)
    assert_grads_match(stages, reference, [s for s, r in zip(stages, [0, 1, 0]) if r == rank])
    payload = codec.encode(torch.randn(BATCH // CHUNKS, LENGTH, K)).nbytes  # k channels each way
    ids = get_codec("intpack").encode(x[: BATCH // CHUNKS]).nbytes  # forward: the ids too
    for r in pipe.meter.records():
        assert r["wire_bytes"] in (0, CHUNKS * (payload + (ids if r["direction"] == "forward" else 0))), r


def check_torch_1f1b(rank: int) -> None:
    from torch.distributed.pipelining import Schedule1F1B

    from dgpipe.pipelining import CompressedPipelineStage, PositionalStage

    stages = _stages("linear")
    stage = CompressedPipelineStage(PositionalStage(stages[rank]), rank, 2, torch.device("cpu"), act_codec="none",
                                    grad_codec="none", tied=TiedParameters(stages, [0, 1], rank))
    schedule = Schedule1F1B(stage, BATCH, loss_fn=lm_loss)
    x, y = batch()
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    want_loss, reference = _reference("linear", x, y, BATCH)
    if rank == 1:
        assert abs(float(torch.stack(losses).mean()) - want_loss) < 1e-5 * abs(want_loss)
    assert_grads_match(stages, reference, [stages[rank]])


def check_dgpipe_client_server_stage_tables(rank: int) -> None:
    check_dgpipe_client_server(rank, tables=True)


CHECKS = {c.__name__: c for c in (check_dgpipe_client_server, check_dgpipe_client_server_stage_tables,
                                  check_torch_1f1b)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return spawn_checks(CHECKS, 2, tmp_path_factory.mktemp("subspace"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_split_equals_unsplit(outcomes, name):
    assert_ranks_ok(outcomes, name, 2)
