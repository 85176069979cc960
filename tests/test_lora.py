"""LoRA adapters through ``peft`` on a split decoder LM (``dgpipe-lm --lora R``).

Spawned (gloo, 2 ranks): a tiny Llama and a tiny GPT-2 with adapters (both factors drawn at random, so that every
adapter gradient is nonzero) trained one step client/server through dgpipe's runtime, uncompressed, give the loss
and every adapter gradient of the same model unsplit, micro-batch by micro-batch; the frozen base weights get no
gradient, and the tied embeddings -- frozen -- are not summed across ranks. In one process: the flags' errors
before any process starts, and the job's model trains only the adapters.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgpipe.models import client_server_split
from dgpipe.models.causal_lm import build_causal_lm, causal_lm_layers, preset_config
from dgpipe.pipeline import Pipeline
from dgpipe.pipeline.tied import TiedParameters
from helpers import assert_ranks_ok, spawn_checks

peft = pytest.importorskip("peft", reason="needs peft (pip install -e .)")

VOCAB, LENGTH, BATCH, CHUNKS = 97, 16, 4, 2


def tiny(preset: str):
    from dgpipe.train.lora import add_adapters

    torch.manual_seed(0)
    model = build_causal_lm(preset_config(preset, VOCAB, LENGTH)).train()
    return add_adapters(model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False))


def batch():
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _check(preset: str):
    def check(rank: int) -> None:
        model = tiny(preset)
        stages = client_server_split(causal_lm_layers(model), 1, (1, 1))
        pipe = Pipeline(stages, [0, 1, 0], chunks=CHUNKS, loss_fn=lm_loss)
        x, y = batch()
        loss = pipe.train_step(x, y)
        reference = tiny(preset)
        want = 0.0
        for xm, ym in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
            part = lm_loss(reference(xm).logits, ym) / CHUNKS
            part.backward()
            want += float(part)
        assert abs(loss - want) < 1e-5 * abs(want)
        names = {id(p): n for n, p in model.named_parameters()}
        ref = dict(reference.named_parameters())
        mine = {id(p): p for s, r in zip(stages, [0, 1, 0]) if r == rank for p in s.parameters()}
        adapters = [p for p in mine.values() if "lora_" in names[id(p)]]
        assert adapters and all(p.requires_grad for p in adapters)
        for p in mine.values():
            name = names[id(p)]
            if "lora_" in name:
                assert float(p.grad.abs().sum()) > 0, name
                torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-6, msg=name)
            else:
                assert not p.requires_grad and p.grad is None, name
        assert not TiedParameters(stages, [0, 1, 0], rank).shared
    check.__name__ = f"lora_{preset}"
    return check


CHECKS = {c.__name__: c for c in (_check("tiny-llama"), _check("tiny-gpt2"))}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return spawn_checks(CHECKS, 2, tmp_path_factory.mktemp("lora"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_split_equals_unsplit_with_adapters(outcomes, name):
    assert_ranks_ok(outcomes, name, 2)
