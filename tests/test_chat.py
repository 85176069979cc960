"""Instruction data (:mod:`dgpipe.data.chat`): conversations rendered by a chat template, the loss on the
assistant's tokens only.

The trained tokens of a rendered conversation are exactly the assistant turns' text and end-of-turn markup,
checked against the rendering done here; ``prompt``/``response`` rows are a user and an assistant turn; the blocks'
targets are ``-100`` elsewhere and the LM job's loss and held-out score count the assistant's tokens alone
(against cross-entropy computed here); bad files are one-line errors before any process starts; a tiny Llama
trains on the benchmark's instruction set, client/server.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dgpipe.data.chat import CHATML, IGNORE, read_conversations, tokenize_chat, tokenize_conversation
from dgpipe.data.text import load_tokenizer
from dgpipe.train import loop
from dgpipe.train.runlog import read_summary
from helpers import ROOT, load_cli, one_line_error

GPT2 = ROOT.parent / "shared" / "data" / "tokenizers" / "gpt2"
CHAT = ROOT / "benchmarks" / "data" / "wiki-chat"
LM = load_cli("test_lm_dgpipe")
pytestmark = [pytest.mark.usefixtures("no_torchrun"),
              pytest.mark.skipif(not GPT2.is_dir(), reason=f"GPT-2 tokenizer not found at {GPT2}")]

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "Six, of course."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(GPT2))


def test_trained_tokens_are_the_assistant_turns(tokenizer):
    ids, trained = tokenize_conversation(tokenizer, MESSAGES, CHATML)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MESSAGES)
    assert tokenizer.decode(ids) == text
    kept = [i for i, t in zip(ids, trained) if t]
    assert tokenizer.decode(kept) == "Four.<|im_end|>\nSix, of course.<|im_end|>\n"
    assert trained[0] is False and trained[-1] is True


def _write(folder: Path, split: str, rows) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{split}.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_prompt_response_rows_and_the_blocks_targets(tokenizer, tmp_path):
    _write(tmp_path, "train", [{"prompt": "Say hi.", "response": "Hi!"}, {"messages": MESSAGES}])
    assert read_conversations(str(tmp_path), "train")[0] == [{"role": "user", "content": "Say hi."},
                                                             {"role": "assistant", "content": "Hi!"}]
    ids, labels = tokenize_chat(str(tmp_path), "train", tokenizer)
    first, _ = tokenize_conversation(tokenizer, [{"role": "user", "content": "Say hi."},
                                                 {"role": "assistant", "content": "Hi!"}], CHATML)
    assert ids.shape == labels.shape and torch.equal(ids[:len(first)], torch.tensor(first))
    kept = labels != IGNORE
    assert torch.equal(labels[kept], ids[kept]) and 0 < int(kept.sum()) < len(ids)
    assert tokenizer.decode(ids[kept]) == "Hi!<|im_end|>\nFour.<|im_end|>\nSix, of course.<|im_end|>\n"


def test_the_loss_and_the_score_count_the_assistants_tokens(tmp_path):
    from dgpipe.train.lm import LMJob

    from torch import nn

    from dgpipe.models.causal_lm import CausalLMHead

    job = LMJob.__new__(LMJob)
    job.config = type("C", (), {"job": type("O", (), {"distill": False})(),
                                "train": type("T", (), {"precision": "fp32"})()})()
    job.head = CausalLMHead(nn.Identity(), nn.Identity())  # logits = the states it is given
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    target[0, :3] = IGNORE
    target[2] = IGNORE
    kept = target != IGNORE
    want = F.cross_entropy(logits[kept], target[kept])
    assert float(job.loss(logits, target)) == pytest.approx(float(want), rel=1e-6)
    metrics = job.metrics(job.eval_outputs(logits, target), target)
    assert metrics["val_loss"] == pytest.approx(float(want), rel=1e-6)
    job.head.defer_logits = True  # the head's logits computed in the loss, a sequence at a time, recomputed
    states = logits.clone().requires_grad_()
    loss = job.loss(states, target)
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    loss.backward()
    reference = logits.clone().requires_grad_()
    F.cross_entropy(reference[kept], target[kept]).backward()
    torch.testing.assert_close(states.grad, reference.grad, rtol=1e-5, atol=1e-7)
    assert job.metrics(job.eval_outputs(logits, target), target)["val_loss"] == pytest.approx(float(want), rel=1e-6)
    assert metrics["val_ppl"] == pytest.approx(math.exp(float(want)), rel=1e-6)


def _error(argv, capsys) -> str:
    return one_line_error(LM.main, argv, capsys)


@pytest.mark.parametrize("rows, extra, message", [
    (["{not json"], [], "train.jsonl, line 1: not JSON"),
    ([{"text": "hello"}], [], "train.jsonl, line 1: no 'messages' list, nor 'prompt' and 'response' texts (fields: text)"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], [], "line 1: no assistant turn"),
    ([{"messages": [{"role": "robot", "content": "hi"}]}], [], "'messages' must be a non-empty list"),
    ([{"prompt": "a", "response": "b"}], ["--tokenizer", "bpe:400"], "holds chat data: give a tokenizer"),
])
def test_bad_chat_data_is_one_line_before_any_process(rows, extra, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop, "run", lambda *a, **k: pytest.fail("a process was started"))
    _write(tmp_path, "train", rows)
    _write(tmp_path, "valid", [{"prompt": "a", "response": "b"}])
    argv = ["--data-dir", str(tmp_path), "--model-config", "tiny-llama", *(extra or ["--tokenizer", str(GPT2)])]
    assert message in _error(argv, capsys)


def test_missing_held_out_split(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop, "run", lambda *a, **k: pytest.fail("a process was started"))
    _write(tmp_path, "train", [{"prompt": "a", "response": "b"}])
    err = _error(["--data-dir", str(tmp_path), "--model-config", "tiny-llama", "--tokenizer", str(GPT2)], capsys)
    assert "valid.jsonl" in err


@pytest.mark.skipif(not CHAT.is_dir(), reason="benchmarks/data/wiki-chat not written (benchmarks/make_chat_data.py)")
def test_tiny_llama_trains_on_the_instruction_set(tmp_path):
    log = tmp_path / "chat.jsonl"
    assert LM.main(["--data-dir", str(CHAT), "--model-config", "tiny-llama", "--tokenizer", str(GPT2),
                    "--block-length", "64", "--batch-size", "4", "--chunk", "2", "--max-steps", "2", "--eval-subset",
                    "4", "--num-workers", "0", "--no-progress", "--lora", "4", "--precision", "bf16",
                    "--activation-checkpointing", "--log-file", str(log)]) == 0
    summary = read_summary(log)
    assert 8 < summary["value"] < 12  # about log(50257) = 10.8 from a random start
    assert {m["kind"] for m in summary["memory"]} <= {"rss", "rss_lifetime"} and len(summary["memory"]) == 2
    assert all(m["peak_bytes"] > m["start_bytes"] > 0 for m in summary["memory"])


def test_one_file_holds_out_every_tenth_conversation(tmp_path, monkeypatch, capsys):
    from dgpipe.data.chat import is_chat_corpus

    rows = [{"prompt": f"question {k}", "response": f"answer {k}"} for k in range(1, 21)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert is_chat_corpus(str(path))
    train, valid = read_conversations(str(path), "train"), read_conversations(str(path), "valid")
    assert [c[0]["content"] for c in valid] == ["question 10", "question 20"]
    assert len(train) == 18 and all(c[0]["content"] not in ("question 10", "question 20") for c in train)
    assert read_conversations(str(path), "test") == valid
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:9]))
    monkeypatch.setattr(loop, "run", lambda *a, **k: pytest.fail("a process was started"))
    err = _error(["--data-dir", str(path), "--model-config", "tiny-llama", "--tokenizer", str(GPT2)], capsys)
    assert "9 conversations; a single file needs 10 or more" in err
