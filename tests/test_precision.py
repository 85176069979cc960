"""Mixed precision, activation checkpointing, loss scaling and the peak-memory reading (``--precision``,
``--activation-checkpointing``; :mod:`dgpipe.train.precision`, :mod:`dgpipe.train.memory`).

Spawned (gloo, 2 ranks): a tiny Llama with LoRA adapters under bf16 autocast, its frozen base stored in bf16, with
activation checkpointing, trained one step client/server uncompressed: the loss and every adapter gradient equal
the same prepared stages run one after another in one process, bfloat16 values (2 bytes each, exactly) cross the
boundaries, and the loss is within bf16's rounding of the float32 model's. In one process: checkpointing gives the
same gradients while the autograd graph keeps a fraction of the activations; fp16's loss scale skips a step whose
gradients overflow and halves, and an fp16 run logs the float32 run's losses (the scale divided out) with 16 bits a value
uncompressed; bits a value count 2-byte values; the CPU peak follows an allocation.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dgpipe.models import Stage, client_server_split
from dgpipe.models.causal_lm import build_causal_lm, causal_lm_layers, preset_config
from dgpipe.pipeline import Pipeline
from dgpipe.train import memory
from dgpipe.train.precision import LossScale, prepare_stages
from dgpipe.train.runlog import direction_bits, read_records
from helpers import ROOT, assert_ranks_ok, corpus_slice, load_cli, spawn_checks

peft = pytest.importorskip("peft", reason="needs peft (pip install -e .)")

VOCAB, LENGTH, BATCH, CHUNKS, WIDTH = 97, 16, 4, 2, 64


def tiny(lora: bool = True):
    from dgpipe.train.lora import add_adapters

    torch.manual_seed(0)
    model = build_causal_lm(preset_config("tiny-llama", VOCAB, LENGTH)).train()
    return add_adapters(model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False)) if lora else model


def batch():
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def prepared(model):
    return prepare_stages(client_server_split(causal_lm_layers(model), 1, (1, 1)), "bf16", True)


def check_bf16_split_equals_unsplit(rank: int) -> None:
    model = tiny()
    stages = prepared(model)
    assert all(p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16) for p in model.parameters())
    pipe = Pipeline(stages, [0, 1, 0], chunks=CHUNKS, loss_fn=lm_loss)
    x, y = batch()
    loss = pipe.train_step(x, y)
    reference_model = tiny()
    reference = Stage(*prepared(reference_model))  # the same three stages, one after another, in one process
    want = 0.0
    for xm, ym in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
        part = lm_loss(reference(xm), ym) / CHUNKS
        part.backward()
        want += float(part)
    assert loss == pytest.approx(want, rel=1e-6)
    names = {id(p): n for n, p in model.named_parameters()}
    ref = dict(reference_model.named_parameters())
    adapters = [p for s, r in zip(stages, [0, 1, 0]) if r == rank for p in s.parameters() if p.requires_grad]
    assert adapters
    for p in adapters:
        assert float(p.grad.abs().sum()) > 0, names[id(p)]
        torch.testing.assert_close(p.grad, ref[names[id(p)]].grad, rtol=1e-5, atol=1e-7, msg=names[id(p)])
    values = BATCH * LENGTH * WIDTH  # hidden states of one step, each way, at each of the two boundaries
    sent = [r for r in pipe.meter.records() if r["raw_bytes"]]  # the sending side counts the raw bytes
    assert {r["direction"] for r in sent} == {"forward", "backward"}
    for r in sent:
        assert r["raw_bytes"] == 2 * values, r  # bfloat16 on the wire
    fp32 = tiny()
    with torch.no_grad():
        full = float(lm_loss(fp32(x).logits, y))
    assert abs(loss - full) < 0.02 * full  # bf16's ~3 significant digits, not another model


CHECKS = {"bf16_split_equals_unsplit": check_bf16_split_equals_unsplit}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return spawn_checks(CHECKS, 2, tmp_path_factory.mktemp("precision"))


def test_bf16_lora_with_checkpointing_split_equals_unsplit(outcomes):
    assert_ranks_ok(outcomes, "bf16_split_equals_unsplit", 2)


def _saved_bytes(stage: Stage, x) -> tuple[int, list[torch.Tensor]]:
    """Bytes the autograd graph keeps for the backward pass of ``stage(x)`` (outside checkpointed regions),
    and the gradients of its parameters."""
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
    lm_loss(out, batch()[1]).backward()
    return saved, [p.grad.clone() for p in stage.parameters()]


def test_checkpointing_recomputes_instead_of_storing():
    x, _ = batch()
    plain = prepare_stages([Stage(*causal_lm_layers(tiny(lora=False)))], "fp32", False)[0]
    recomputed = prepare_stages([Stage(*causal_lm_layers(tiny(lora=False)))], "fp32", True)[0]
    kept, grads = _saved_bytes(plain, x)
    kept_ckpt, grads_ckpt = _saved_bytes(recomputed, x)
    assert kept > 10 * max(kept_ckpt, 1)  # only the loss's own inputs stay outside the layers
    for a, b in zip(grads, grads_ckpt):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    recomputed.eval()
    with torch.no_grad():
        torch.testing.assert_close(recomputed(x), plain.eval()(x), rtol=0, atol=0)


def test_fp16_loss_scale_skips_an_overflowing_step_and_halves():
    weight = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([weight], lr=1.0)
    scale = LossScale(True, init_scale=1024.0, growth_interval=2)
    weight.grad = torch.tensor([1024.0, 2048.0, math.inf])
    assert not scale.step(opt, torch.device("cpu"))
    assert scale.scale == 512.0 and torch.equal(weight.detach(), torch.ones(3)) and scale.skipped == 1
    for _ in range(2):
        weight.grad = torch.tensor([512.0, 512.0, 0.0])
        assert scale.step(opt, torch.device("cpu"))
    assert torch.equal(weight.detach(), torch.tensor([-1.0, -1.0, 1.0]))  # two steps of the unscaled gradient 1
    assert scale.scale == 1024.0  # doubled after growth_interval good steps
    assert LossScale(False).scale == 1.0


def test_bits_a_value_count_16_bit_values():
    def epoch(value_bytes):
        return {"event": "epoch", "value_bytes": value_bytes, "boundaries": [
            {"direction": "forward", "wire_bytes": 300, "raw_bytes": 400},
            {"direction": "backward", "wire_bytes": 100, "raw_bytes": 400}]}
    assert direction_bits([epoch(2)]) == {"forward": 12.0, "backward": 4.0}  # 200 values
    assert direction_bits([epoch(4)]) == {"forward": 24.0, "backward": 8.0}  # 100 values


@pytest.mark.skipif(not memory.RESETTABLE, reason="the CPU peak resets through /proc (Linux)")
def test_cpu_peak_follows_an_allocation_and_resets():
    cpu = torch.device("cpu")
    memory.reset_peak(cpu)
    before = memory.peak_bytes(cpu)
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written
    assert memory.peak_bytes(cpu) >= before + 60 * 2**20
    del block
    memory.reset_peak(cpu)
    assert memory.peak_bytes(cpu) < before + 32 * 2**20
    assert memory.memory_kind(cpu) == "rss"


WIKI = ROOT.parent / "shared" / "data" / "text" / "wiki-excerpt"


@pytest.mark.usefixtures("no_torchrun")
@pytest.mark.skipif(not WIKI.is_dir(), reason=f"real text corpus not found at {WIKI}")
def test_fp16_run_reports_the_unscaled_loss_and_16_bit_values(tmp_path, monkeypatch):
    monkeypatch.setenv("DGPIPE_CACHE", str(tmp_path / "cache"))
    corpus = corpus_slice(WIKI, tmp_path / "wiki", {"train": 20_000, "valid": 4_000, "test": 4_000})
    lm = load_cli("test_lm_dgpipe")
    losses = {}
    for precision in ("fp32", "fp16"):
        log = tmp_path / f"{precision}.jsonl"
        assert lm.main(["--data-dir", str(corpus), "--model-config", "tiny-llama", "--tokenizer", "bpe:400",
                        "--block-length", "32", "--batch-size", "4", "--chunk", "2", "--max-steps", "2",
                        "--eval-subset", "4", "--num-workers", "0", "--no-progress", "--precision", precision,
                        "--log-file", str(log)]) == 0
        records = read_records(log)
        losses[precision] = [r["loss"] for r in records if r["event"] == "step"]
        epoch = next(r for r in records if r["event"] == "epoch")
        assert epoch["value_bytes"] == (4 if precision == "fp32" else 2)
        assert direction_bits(records)["backward"] == pytest.approx(32 if precision == "fp32" else 16, rel=0.02)  # + headers
    # the loss scale (2^16) is divided out: the same losses as float32, to half precision's rounding
    assert losses["fp16"] == pytest.approx(losses["fp32"], rel=1e-2)


def test_bf16_on_a_gpu_without_it_is_refused(monkeypatch):
    from dgpipe.train.precision import check_precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ValueError, match="this GPU has no bfloat16 arithmetic; use --precision fp16"):
        check_precision("bf16", ["cpu", "cuda:0"])
    check_precision("bf16", ["cpu", "cpu"])  # CPU autocast has bfloat16
    check_precision("fp16", ["cpu", "cuda:0"])
