"""The language-model job: text corpora packed into blocks, its metric, its CLI's errors and one run.

Data: blocks and their next-token targets against slicing done here, the trained BPE (deterministic,
cached, lossless on the corpus), the token cache. Metric: the validation loss of the job's reduced
evaluation outputs equals the mean token cross-entropy computed directly. CLI: every bad input named
in the job's contract is a one-line error before any process starts. End to end: a tiny Llama
pretrained for 4 steps on a slice of the real wiki-excerpt corpus, client/server, 8-bit codes vs
uncompressed (``--compare-to none``): per-step records, evaluations every 2 steps, the summary, the
table with the loss in nats and percent, the perplexity and the per-step projection with latency.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dgpipe.data.text import TokenBlocks, load_tokenizer, read_corpus, tokenize_corpus, train_bpe
from dgpipe.train import compare, loop
from dgpipe.train.runlog import read_records
from helpers import ROOT, corpus_slice, load_cli, one_line_error

WIKI = ROOT.parent / "shared" / "data" / "text" / "wiki-excerpt"
GPT2 = ROOT.parent / "shared" / "data" / "tokenizers" / "gpt2"
LM = load_cli("test_lm_dgpipe")
pytestmark = [pytest.mark.usefixtures("no_torchrun"),
              pytest.mark.skipif(not WIKI.is_dir(), reason=f"real text corpus not found at {WIKI}")]


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    """Tokenizers and token streams cached in a temporary folder (the spawned ranks inherit it)."""
    folder = tmp_path_factory.getbasetemp() / "dgpipe-cache"
    monkeypatch.setenv("DGPIPE_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first 40,000 / 8,000 characters of wiki-excerpt's train / valid splits."""
    return corpus_slice(WIKI, tmp_path_factory.mktemp("wiki"), {"train": 40_000, "valid": 8_000, "test": 8_000})


def test_blocks_predict_every_next_token_once():
    ids = torch.arange(23)
    blocks = TokenBlocks(ids, 5)
    assert len(blocks) == 4  # (23 - 1) // 5
    for k in range(4):
        x, y = blocks[k]
        assert torch.equal(x, ids[5 * k:5 * k + 5]) and torch.equal(y, ids[5 * k + 1:5 * k + 6])
    assert len(TokenBlocks(ids, 5, limit=2)) == 2
    with pytest.raises(IndexError):
        blocks[4]
    with pytest.raises(ValueError, match="do not fill one block of 30"):
        TokenBlocks(ids, 30)


def test_bpe_is_deterministic_lossless_and_cached(corpus, cache):
    text = read_corpus(str(corpus), "train")
    a, b = train_bpe(text, 600), train_bpe(text, 600)
    assert a.get_vocab() == b.get_vocab() and len(a) == 600
    assert a.convert_tokens_to_ids("<|endoftext|>") == 0 == a.pad_token_id
    sample = text[:2000]
    assert a.decode(a(sample, add_special_tokens=False)["input_ids"]) == sample  # byte-level: nothing is lost
    tok = load_tokenizer("bpe:600", str(corpus))
    assert list((cache / "tokenizers").iterdir()) and tok.get_vocab() == a.get_vocab()
    ids = tokenize_corpus(str(corpus), "valid", tok)
    assert tok.decode(ids.tolist()) == read_corpus(str(corpus), "valid")
    assert torch.equal(tokenize_corpus(str(corpus), "valid", tok), ids)  # from the cache
    assert len(list((cache / "tokens").iterdir())) == 1


@pytest.mark.skipif(not GPT2.is_dir(), reason="GPT-2 tokenizer folder not found")
def test_gpt2_tokenizer_folder():
    assert load_tokenizer(str(GPT2))("Hello world")["input_ids"] == [15496, 995]


def test_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="no .*valid.txt"):
        (tmp_path / "train.txt").write_text("some text")
        read_corpus(str(tmp_path), "valid")
    with pytest.raises(ValueError, match="bpe:N"):
        load_tokenizer("bpe:lots", str(tmp_path))


def test_validation_loss_is_the_mean_token_cross_entropy():
    from dgpipe.train.lm import LMJob

    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(6, 9, 13, generator=g), torch.randint(0, 13, (6, 9), generator=g)
    from dgpipe.models.causal_lm import CausalLMHead

    job = LMJob.__new__(LMJob)
    job.head = CausalLMHead(torch.nn.Identity(), torch.nn.Identity())  # a head that gives its logits itself
    reduced = torch.cat([job.eval_outputs(logits[:4], targets[:4]), job.eval_outputs(logits[4:], targets[4:])])
    metrics = job.metrics(reduced, targets)
    want = F.cross_entropy(logits.reshape(-1, 13), targets.reshape(-1)).item()
    assert metrics["val_loss"] == pytest.approx(want, rel=1e-6)
    assert metrics["val_ppl"] == pytest.approx(math.exp(want), rel=1e-6)


def _error(argv, capsys) -> str:
    return one_line_error(LM.main, argv, capsys)


@pytest.mark.parametrize("argv, message", [
    ([], "--data-dir: give a corpus folder"),
    (["--data-dir", "/nonexistent/corpus", "--model-config", "tiny-llama"], "corpus /nonexistent/corpus: no such folder"),
    (["--model-config", "tiny-mamba"], "--model-config tiny-mamba: unknown preset"),
    (["--model-config", "tiny-llama", "--model", "x"], "give --model NAME_OR_PATH"),
    (["--model", "/tmp/no-such-model.gguf"], "no such GGUF file"),
    (["--model-config", "tiny-llama", "--block-length", "1"], "--block-length 1 is too short"),
    (["--model-config", "tiny-llama", "--block-length", "100000"], "do not fill one block of 100000"),
    (["--model-config", "tiny-llama", "--skip-padding"], "--skip-padding: the language model's blocks are packed"),
    (["--model-config", "tiny-llama", "--client-layers", "3"], "--client-layers 3"),
    (["--model-config", "tiny-llama", "--link-delay", "-5"], "--link-delay must be >= 0 milliseconds"),
    (["--model-config", "tiny-llama", "--eval-every", "0"], "--eval-every must be positive"),
    (["--model-config", "tiny-llama", "--bottleneck", "0"], "bottleneck width '0' = 0 channels: must be in [1, 64]"),
    (["--model-config", "tiny-llama", "--bottleneck", "1/128"], "bottleneck width '1/128' = 0 channels"),
    (["--model-config", "tiny-llama", "--bottleneck", "65"], "must be in [1, 64] (the model's width)"),
    (["--model-config", "tiny-llama", "--bottleneck", "2:8"], "boundary 2 is not one of 0..1"),
    (["--model-config", "tiny-llama", "--mode", "dataparallel", "--bottleneck", "8"], "this partition has none"),
    (["--model-config", "tiny-llama", "--bottleneck-anchor"], "shape the bottlenecks of --bottleneck D"),
    (["--model-config", "tiny-llama", "--bottleneck-subspace"], "shape the bottlenecks of --bottleneck D"),
    (["--model-config", "tiny-llama", "--bottleneck", "0:8", "--bottleneck-subspace"],
     "--bottleneck-subspace trains a model from scratch (--model-config) with one width at every boundary"),
    (["--model-config", "tiny-llama", "--bottleneck", "8", "--bottleneck-subspace", "--bottleneck-anchor"],
     "anchored and started by the subspace itself"),
    (["--model-config", "tiny-llama", "--lora", "4", "--lora-targets", "foo_proj"],
     "--lora-targets foo_proj: Target modules {'foo_proj'} not found in the base model"),
    (["--model-config", "tiny-llama", "--lora-alpha", "16"], "shape the adapters of --lora R: add it"),
    (["--model-config", "tiny-llama", "--lora", "-1"], "--lora takes a rank >= 1"),
    (["--model-config", "tiny-llama", "--lora", "4", "--lora-dropout", "1"], "--lora-dropout one in [0, 1)"),
    (["--model-config", "tiny-llama", "--distill"], "--distill trains the bottlenecks and adapters"),
])
def test_bad_input_is_one_line_before_any_process(argv, message, corpus, monkeypatch, capsys):
    monkeypatch.setattr(loop, "run", lambda *a, **k: pytest.fail("a process was started"))
    if "--data-dir" not in argv and argv:
        argv = ["--data-dir", str(corpus), *argv]
    assert message in _error(argv, capsys)


def test_gguf_without_the_gguf_package(corpus, monkeypatch, capsys, tmp_path):
    import importlib.util

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    assert "which transformers reads with the gguf package: pip install gguf" in _error(
        ["--data-dir", str(corpus), "--model", str(gguf)], capsys)


def test_block_length_past_the_models_context(corpus, tmp_path, capsys):
    from dgpipe.models.causal_lm import preset_config

    preset_config("tiny-llama", 600, 64).save_pretrained(tmp_path / "cfg")
    assert "--block-length 128 is past the model's context of 64 tokens" in _error(
        ["--data-dir", str(corpus), "--model-config", str(tmp_path / "cfg"), "--tokenizer", "bpe:600"], capsys)


def test_family_that_is_not_a_decoder(corpus, tmp_path, capsys):
    from transformers import BertConfig

    BertConfig(vocab_size=700).save_pretrained(tmp_path / "bert")
    assert "the model's family 'bert' is not supported" in _error(
        ["--data-dir", str(corpus), "--model-config", str(tmp_path / "bert"), "--tokenizer", "bpe:600"], capsys)


def test_pretrain_tiny_llama_compare_to_none(corpus, tmp_path, capfd):
    log = tmp_path / "runs" / "lm.jsonl"
    code = LM.main([
        "--data-dir", str(corpus), "--model-config", "tiny-llama", "--tokenizer", "bpe:600", "--block-length", "32",
        "--batch-size", "8", "--chunk", "2", "--max-steps", "4", "--eval-every", "2", "--eval-subset", "6",
        "--num-workers", "0", "--quant", "8", "--compare-to", "none", "--log-file", str(log), "--no-progress",
    ])
    assert code == 0
    out = capfd.readouterr().out
    records = read_records(log)
    assert [r["event"] for r in records] == ["step", "step", "eval", "step", "step", "epoch", "summary"]
    assert [r["step"] for r in records if "step" in r and r["event"] != "summary"] == [1, 2, 2, 3, 4, 4]
    summary = records[-1]
    assert summary["metric"] == "val_loss" and summary["steps"] == 4
    assert summary["metrics"]["val_ppl"] == pytest.approx(math.exp(summary["value"]))
    assert 4 < summary["value"] < 8  # about log(600) = 6.4 after 4 steps from a random start
    none = read_records(log.with_name("lm.none.jsonl"))[-1]
    assert 0.24 < summary["wire_bytes"] / none["wire_bytes"] < 0.27  # 8 of 32 bits, with headers
    row = next(line for line in out.splitlines() if line.startswith("quant8 "))
    delta = summary["value"] - none["value"]
    assert f"{delta:+.4f} ({100 * delta / none['value']:+.2f}%)" in row
    assert "s/step at 200 Mbit/s + 50 ms (proj.)" in out
    # the step's profile: client/server segments, 2 micro-batches, a message's bytes as metered
    profile = compare.run_profile(records)
    assert profile.ranks == (0, 1, 0) and profile.micro == 2
    assert all(s > 0 for s in profile.forward + profile.backward)
    epoch = next(r for r in records if r["event"] == "epoch")
    for direction, per_message in (("forward", profile.forward_bytes), ("backward", profile.backward_bytes)):
        entries = {b["name"]: b for b in epoch["boundaries"] if b["direction"] == direction}
        assert [(entries[n]["wire_bytes"] + entries[n]["frame_bytes"]) / (4 * 2) for n in
                ("stage0->stage1", "stage1->stage2")] == pytest.approx(per_message)
    link = compare.Link("x", 200e6, 0.05)
    step = compare.project(summary["train_seconds"], summary["wire_bytes"], 4, 2, link, profile) / 4
    assert f"{step:.3f} s" in row


def test_projection_without_a_profile_counts_latency_per_critical_message():
    link = compare.Link("x", 8e6, 0.01)
    want = 10.0 + 1.0 * compare.TCP_FRAMING + 5 * 6 * 0.01  # the bytes at the line rate less the TCP/IP headers
    assert compare.project(10.0, 1_000_000, 5, 3, link) == pytest.approx(want)
    assert compare.TCP_FRAMING == pytest.approx(1514 / 1448)
    assert compare.critical_messages(2) == 4


def test_bottleneck_bits_count_against_the_models_width(corpus, tmp_path):
    """A 16-channel bottleneck of the 64-wide tiny Llama with 8-bit codes: the log's raw bytes are those of the
    whole width (float32 x 64 per token, computed here from the run's tokens), so the bits a value are 8 x 16 / 64
    = 2 and the headers' share; the wire carries 16 channels."""
    from dgpipe.compression import get_codec
    from dgpipe.train.runlog import direction_bits

    log = tmp_path / "lm.jsonl"
    assert LM.main(["--data-dir", str(corpus), "--model-config", "tiny-llama", "--tokenizer", "bpe:600",
                    "--block-length", "32", "--batch-size", "8", "--chunk", "2", "--max-steps", "2", "--eval-subset",
                    "6", "--num-workers", "0", "--quant", "8", "--bottleneck", "16", "--log-file", str(log),
                    "--no-progress"]) == 0
    epoch = next(r for r in read_records(log) if r["event"] == "epoch")
    backward = [b for b in epoch["boundaries"] if b["direction"] == "backward"]
    assert {b["name"] for b in backward} == {"stage0->stage1", "stage1->stage2"}
    tokens = 2 * 8 * 32  # steps x blocks x tokens
    payload = get_codec("quant", bits=8).encode(torch.randn(4, 32, 16)).nbytes  # a micro-batch's 16 channels
    for b in backward:
        assert b["raw_bytes"] == tokens * 64 * 4
        assert b["wire_bytes"] == 2 * 2 * payload  # steps x micro-batches
    bits = direction_bits(read_records(log))  # per value of the width: 2 bits and the headers' share
    assert bits["backward"] == bits["forward"] == pytest.approx(8 * 2 * 2 * payload / (tokens * 64))
    assert 2.0 < bits["backward"] < 2.2


@pytest.mark.parametrize("width, first", [(64, "zero"), (16, "positive")])
def test_distillation_starts_at_zero_where_the_bottleneck_is_the_identity(corpus, tmp_path, width, first):
    """``--distill``: the loss is KL(teacher || model) against a frozen copy of the model as built. Through identity
    bottlenecks (the model's width) the model is its teacher: the first step's loss is 0; through 16 channels it is
    not. Only the pairs train, so the identity stays nearly exact."""
    log = tmp_path / "lm.jsonl"
    assert LM.main(["--data-dir", str(corpus), "--model-config", "tiny-llama", "--tokenizer", "bpe:600",
                    "--block-length", "32", "--batch-size", "8", "--chunk", "2", "--max-steps", "2", "--eval-subset",
                    "6", "--num-workers", "0", "--bottleneck", str(width), "--distill", "--log-file", str(log),
                    "--no-progress"]) == 0
    losses = [r["loss"] for r in read_records(log) if r["event"] == "step"]
    if first == "zero":
        assert losses[0] < 1e-6 and losses[1] < 1e-3
    else:
        assert losses[0] > 1e-2


def _step_losses(corpus, tmp_path, name, *flags) -> list[float]:
    log = tmp_path / f"{name}.jsonl"
    assert LM.main(["--data-dir", str(corpus), "--model-config", "tiny-llama", "--tokenizer", "bpe:600",
                    "--block-length", "32", "--batch-size", "8", "--chunk", "2", "--max-steps", "3", "--eval-subset",
                    "6", "--num-workers", "0", "--log-file", str(log), "--no-progress", *flags]) == 0
    return [r["loss"] for r in read_records(log) if r["event"] == "step"]


def test_a_full_width_residual_subspace_trains_as_the_model_without_it(corpus, tmp_path):
    """``--bottleneck-subspace`` at the model's width 64: the projection is the identity (to rounding), so three
    training steps give the losses of the same run without a bottleneck; at 16 channels they differ."""
    plain = _step_losses(corpus, tmp_path, "plain")
    full = _step_losses(corpus, tmp_path, "full", "--bottleneck", "64", "--bottleneck-subspace")
    assert full == pytest.approx(plain, rel=1e-4)
    narrow = _step_losses(corpus, tmp_path, "narrow", "--bottleneck", "16", "--bottleneck-subspace")
    assert narrow[0] == pytest.approx(plain[0], rel=1e-2)  # the stream starts at the same embedding
    assert abs(narrow[-1] - plain[-1]) > 1e-4


def test_a_residual_subspace_under_torchs_schedule_sends_its_channels_and_the_ids(corpus, tmp_path):
    """``--engine torch`` with a 16-channel subspace of the 64-wide model and 8-bit codes: each gradient message
    carries the codec's payload of 16 channels (torch's shape inference ran the stage on zero ids), and the loss
    falls."""
    from dgpipe.compression import get_codec

    losses = _step_losses(corpus, tmp_path, "torch", "--engine", "torch", "--partition", "linear", "--bottleneck", "16",
                          "--bottleneck-subspace", "--quant", "8", "--lr", "3e-3")
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    epoch = next(r for r in read_records(tmp_path / "torch.jsonl") if r["event"] == "epoch")
    payload = get_codec("quant", bits=8).encode(torch.randn(4, 32, 16)).nbytes
    backward = [b for b in epoch["boundaries"] if b["direction"] == "backward"]
    assert backward and all(b["wire_bytes"] == 3 * 2 * payload for b in backward)


def test_stage_tables_are_each_stages_own_trained_weights(corpus, tmp_path):
    """``--bottleneck-subspace stage``: the first stage's table is its embedding, every later stage saves its own
    (vocabulary x width) with its pair, trained apart from it; the fixed table of ``--bottleneck-subspace`` is saved
    nowhere."""
    from dgpipe.train.export import _complete_step, _saved_stages

    for kind in ("stage", "fixed"):
        _step_losses(corpus, tmp_path, kind, "--bottleneck", "16", "--bottleneck-subspace", kind, "--save",
                     str(tmp_path / kind))
        saved = _saved_stages(_complete_step(str(tmp_path / kind))[2])
        tables = {i: w for i, s in saved.items() for k, w in s.items() if k.endswith("anchor.weight")}
        if kind == "fixed":
            assert tables == {}
            continue
        embedding = next(w for k, w in saved[0].items() if k.endswith("embed_tokens.weight"))
        assert sorted(tables) == [0, 1, 2] and all(t.shape == embedding.shape for t in tables.values())
        assert torch.equal(tables[0], embedding)
        assert not torch.equal(tables[1], embedding) and not torch.equal(tables[1], tables[2])
