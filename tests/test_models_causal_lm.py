"""Decoder LMs as layer lists: the composition is the model, and the split model is the unsplit one.

In one process: for a tiny random Llama, Qwen2, Qwen3, Gemma 3 (alternating sliding-window and global
layers) and GPT-2, the layers of :func:`causal_lm_layers` compute the model's own logits, with and
without a (left) padding mask and with the token ids carried; tied embeddings stay one parameter.

Spawned (gloo, 2 and 3 ranks): each family trained one step through dgpipe's runtime -- linear on 2
ranks, linear on 3 ranks, client/server [0, 1, 0] -- and through ``CompressedPipelineStage`` under
torch's 1F1B, uncompressed, gives the loss and every parameter gradient of the unsplit model run
micro-batch by micro-batch (float tolerance). In the linear placements the tied embeddings sit on
the first and the last rank, whose gradients the pipeline (and, under torch's schedule, the stage given them as
``tied``) sums. The wire bytes of each boundary and
direction equal the codec's payloads, uncompressed and (Llama, both placements) through an 8-bit codec.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpipe.compression import get_codec
from dgpipe.models import Stage, client_server_split
from dgpipe.models.causal_lm import (LM_PRESETS, build_causal_lm, causal_lm_layers, preset_config, resolve_lm,
                                     small_lm_config)
from dgpipe.pipeline import Pipeline, split_layers
from dgpipe.pipeline.tied import TiedParameters
from helpers import assert_ranks_ok, spawn_checks

VOCAB, LENGTH, BATCH, CHUNKS = 97, 16, 4, 2
FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gpt2")
RTOL, ATOL = 1e-4, 1e-6


def tiny(preset: str):
    torch.manual_seed(0)
    return build_causal_lm(preset_config(preset, VOCAB, LENGTH)).train()


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("preset", FAMILIES)
def test_layers_compute_the_models_logits(preset):
    model = tiny(preset).eval()
    x, _ = batch()
    mask = torch.ones_like(x)
    mask[0, :5] = 0  # left padding
    mask[1, :1] = 0
    with torch.no_grad():
        assert torch.equal(Stage(*causal_lm_layers(model))(x), model(x).logits)
        padded = model(x, attention_mask=mask).logits
        ours = Stage(*causal_lm_layers(model))((x, mask))
        carried = Stage(*causal_lm_layers(model, carry_ids=True))((x, mask))
    keep = mask.bool()
    torch.testing.assert_close(ours[keep], padded[keep], rtol=0, atol=0)
    assert torch.equal(carried, ours)
    layers = causal_lm_layers(model)
    assert len(layers) == model.config.num_hidden_layers + 2
    assert layers[0].embed_tokens.weight is layers[-1].lm_head.weight  # tied: one parameter


def test_gemma3_preset_alternates_sliding_window_and_global_layers():
    config = preset_config("tiny-gemma3", VOCAB, LENGTH)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert config.sliding_window < LENGTH  # the window bites at this length


def test_bad_models_and_configs_are_refused():
    from transformers import BertConfig, BertForMaskedLM

    with pytest.raises(ValueError, match="not a supported causal LM"):
        causal_lm_layers(BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32)))
    with pytest.raises(ValueError, match="unknown decoder family 'mamba'"):
        small_lm_config("mamba", VOCAB, LENGTH)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset_config("huge", VOCAB, LENGTH)
    with pytest.raises(ValueError, match="divide into heads"):
        small_lm_config("llama", VOCAB, LENGTH, hidden_size=64, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="no such GGUF file"):
        resolve_lm("/nonexistent/model.gguf")
    assert resolve_lm("some/hub-name").path == "some/hub-name"
    assert set(FAMILIES) <= set(LM_PRESETS)


def test_small_llama_preset_size():
    """The benchmark preset's size as its docstring states it (4,096-token vocabulary)."""
    model = build_causal_lm(preset_config("small-llama", 4096, 128))
    blocks = sum(p.numel() for layer in model.model.layers for p in layer.parameters())
    attention = 2 * 128 * 128 + 2 * 128 * 64  # q, o full width; k, v for 2 of 4 heads (grouped-query)
    mlp = 3 * 128 * 352  # gated: gate, up, down, 8/3 x 128 rounded to a multiple of 32
    assert blocks == 6 * (attention + mlp + 2 * 128) == 1_107_456
    assert model.model.embed_tokens.weight.numel() == 4096 * 128


# -- split equals unsplit, across processes -------------------------------------------------------------------


def reference(preset: str, x, y, chunks: int = CHUNKS):
    """Loss and gradients (by parameter name) of the unsplit model, micro-batch by micro-batch."""
    model = tiny(preset)
    loss = 0.0
    for xm, ym in zip(x.chunk(chunks), y.chunk(chunks)):
        part = lm_loss(model(xm).logits, ym) / chunks
        part.backward()
        loss += float(part)
    return loss, {n: p.grad for n, p in model.named_parameters()}


def _names(model):
    return {id(p): n for n, p in model.named_parameters()}


def _check_grads(model, params, want):
    names = _names(model)
    checked = 0
    for p in params:
        torch.testing.assert_close(p.grad, want[names[id(p)]], rtol=RTOL, atol=ATOL, msg=names[id(p)])
        checked += 1
    assert checked


PLACEMENTS = {2: {"linear": [0, 1], "client-server": [0, 1, 0]}, 3: {"linear": [0, 1, 2]}}


def _dgpipe_check(preset: str, kind: str, world: int, lossy: bool = False):
    def check(rank: int) -> None:
        model = tiny(preset)
        layers = causal_lm_layers(model)
        placement = PLACEMENTS[world][kind]
        stages = (client_server_split(layers, 1, (1, 1)) if kind == "client-server"
                  else split_layers(layers, [2] * (world - 1) + [len(layers) - 2 * (world - 1)]))
        codec = get_codec("quant", bits=8) if lossy else get_codec("none")  # lossy: the bytes, not the numbers
        pipe = Pipeline(stages, placement, chunks=CHUNKS, loss_fn=lm_loss, act_codec=codec)
        x, y = batch()
        loss = pipe.train_step(x, y)
        if not lossy:
            want_loss, want = reference(preset, x, y)
            assert abs(loss - want_loss) < 1e-5 * abs(want_loss)
            _check_grads(model, pipe.parameters(), want)
        # every boundary and direction: exactly the codec's payloads for (B / CHUNKS, L, H) float32
        payload = codec.encode(torch.randn(BATCH // CHUNKS, LENGTH, model.config.hidden_size)).nbytes
        sending = {b.name: (b.src, b.dst) for b in pipe._bounds.values()}
        for r in pipe.meter.records():
            src, dst = sending[r["name"]]
            sender = src if r["direction"] == "forward" else dst
            assert r["wire_bytes"] == (CHUNKS * payload if rank == sender else 0), r
        tied = TiedParameters(stages, placement, rank)
        across = kind == "linear" and model.config.tie_word_embeddings
        assert bool(tied) == across  # embeddings on the first rank, LM head on the last
    check.__name__ = f"dgpipe_{preset}_{kind}_{world}" + ("_8bit" if lossy else "")
    return check


def _torch_1f1b_check(preset: str, world: int):
    def check(rank: int) -> None:
        from torch.distributed.pipelining import Schedule1F1B

        from dgpipe.pipelining import CompressedPipelineStage
        from dgpipe.pipelining import PositionalStage

        model = tiny(preset)
        layers = causal_lm_layers(model)
        stages = split_layers(layers, [2] * (world - 1) + [len(layers) - 2 * (world - 1)])
        stage = CompressedPipelineStage(PositionalStage(stages[rank]), rank, world, torch.device("cpu"),
                                        act_codec="none", grad_codec="none",
                                        tied=TiedParameters(stages, list(range(world)), rank))
        schedule = Schedule1F1B(stage, BATCH, loss_fn=lm_loss)  # 1F1B needs as many micro-batches as stages
        x, y = batch()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        want_loss, want = reference(preset, x, y, BATCH)
        if rank == world - 1:
            assert abs(float(torch.stack(losses).mean()) - want_loss) < 1e-5 * abs(want_loss)
        _check_grads(model, list(stages[rank].parameters()), want)
    check.__name__ = f"torch1f1b_{preset}_{world}"
    return check


CHECKS = {2: [_dgpipe_check(p, k, 2) for p in FAMILIES for k in PLACEMENTS[2]] + [_torch_1f1b_check(p, 2) for p in FAMILIES]
         + [_dgpipe_check("tiny-llama", k, 2, lossy=True) for k in PLACEMENTS[2]],
          3: [_dgpipe_check(p, "linear", 3) for p in FAMILIES] + [_torch_1f1b_check(p, 3) for p in FAMILIES]}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return {w: spawn_checks({c.__name__: c for c in checks}, w, tmp_path_factory.mktemp(f"lm{w}"))
            for w, checks in CHECKS.items()}


@pytest.mark.parametrize("check", [(w, c.__name__) for w, checks in CHECKS.items() for c in checks],
                         ids=lambda wc: wc[1])
def test_split_equals_unsplit(outcomes, check):
    world, name = check
    assert_ranks_ok(outcomes[world], name, world)
