"""Instruction (chat) data for fine-tuning a language model: conversations rendered by the tokenizer's chat
template, the loss on the assistant's tokens only.

A chat corpus is a folder holding ``train.jsonl`` and ``valid.jsonl`` (and/or ``test.jsonl``), or one ``.jsonl``
file whose every 10th conversation is held out; one conversation a line: ``{"messages": [{"role":
"system"|"user"|"assistant", "content": "..."}, ...]}`` (the format of Hugging Face chat datasets and of
``apply_chat_template``), or ``{"prompt": "...", "response": "..."}`` (a user
turn and the assistant's answer). Each conversation is rendered with the tokenizer's ``chat_template`` --
:data:`CHATML` for a tokenizer without one (a ``bpe:N`` vocabulary, GPT-2's) -- and tokenized once; the tokens of
each assistant turn (its text and its end-of-turn markup: what ``render(messages[:i + 1])`` adds to
``render(messages[:i], add_generation_prompt=True)``, located by the tokenizer's character offsets) are trained,
every other token's target is ``-100`` (ignored by ``torch.nn.functional.cross_entropy``). The conversations of a
split are packed one after another into blocks of ``L`` tokens as text is (:class:`~dgpipe.data.text.TokenBlocks`
with labels), so no padding and no mask crosses a boundary; the held-out split is scored the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["CHATML", "IGNORE", "HELD_OUT", "is_chat_corpus", "read_conversations", "tokenize_conversation",
           "tokenize_chat"]

#: The target of a token that is not trained (the default ``ignore_index`` of ``cross_entropy``).
IGNORE = -100

#: The ChatML template (OpenAI; the format of SmolLM2's and Qwen's templates), for tokenizers without their own.
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_ROLES = ("system", "user", "assistant")


#: A single chat file's held-out split: every ``HELD_OUT``-th conversation (the 10th, 20th, ...).
HELD_OUT = 10


def is_chat_corpus(corpus: str) -> bool:
    """Whether ``corpus`` is chat data -- a folder of ``.jsonl`` splits or one ``.jsonl`` file -- rather than text."""
    path = Path(corpus)
    return path.is_dir() and (path / "train.jsonl").is_file() or path.suffix == ".jsonl"


def _conversation(row: object, where: str) -> list[dict[str, str]]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a line must be a JSON object with 'messages' or 'prompt' and 'response'")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': {'|'.join(_ROLES)}, "
                             "'content': text}")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    elif isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    else:
        raise ValueError(f"{where}: no 'messages' list, nor 'prompt' and 'response' texts (fields: "
                         f"{', '.join(map(str, row)) or 'none'})")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant turn, nothing to train on")
    return messages


def read_conversations(corpus: str, split: str) -> list[list[dict[str, str]]]:
    """The conversations of ``<corpus>/<split>.jsonl``, each a list of ``{"role", "content"}`` messages; of a single
    ``.jsonl`` file, every :data:`HELD_OUT`-th conversation for ``valid`` or ``test`` and the others for ``train``.

    Raises:
        ValueError: a missing file, a line that is not JSON, or one without the fields (names the file and line);
            a single file with fewer than :data:`HELD_OUT` conversations.
    """
    path = Path(corpus)
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise ValueError(f"chat data {corpus}: no such file")
        every = _parse(path)
        if len(every) < HELD_OUT:
            raise ValueError(f"{path}: {len(every)} conversations; a single file needs {HELD_OUT} or more (every "
                             f"{HELD_OUT}th is held out)")
        held = [(k + 1) % HELD_OUT == 0 for k in range(len(every))]
        return [c for c, h in zip(every, held) if h == (split != "train")]
    path = path / f"{split}.jsonl"
    if not path.is_file():
        raise ValueError(f"chat corpus {corpus}: no {path} (a chat corpus folder holds train.jsonl and valid.jsonl "
                         "or test.jsonl)")
    return _parse(path)


def _parse(path: Path) -> list[list[dict[str, str]]]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {n}: not JSON ({e.msg})") from None
        out.append(_conversation(row, f"{path}, line {n}"))
    if not out:
        raise ValueError(f"{path}: no conversation")
    return out


def _render(tokenizer, messages, template: str, prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=prompt)


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], template: str
                          ) -> tuple[list[int], list[bool]]:
    """Token ids of one rendered conversation and, per token, whether it is an assistant token (trained).

    Raises:
        ValueError: a template whose rendering of the first turns is not a prefix of the whole conversation's
            (the assistant's tokens cannot then be located).
    """
    text = _render(tokenizer, messages, template, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], template, True)) if i else 0
        upto = _render(tokenizer, messages[:i + 1], template, False)
        if not text.startswith(upto):
            raise ValueError("the chat template does not render a conversation's first turns as a prefix of the "
                             "whole conversation; the assistant's tokens cannot be located")
        spans.append((start, len(upto)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(a <= first < b for a, b in spans) for first, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), trained


def tokenize_chat(corpus: str, split: str, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """A split's conversations as one packed stream: ``(ids, labels)``, int64 ``(n,)`` each; ``labels`` is
    ``ids`` on assistant tokens and :data:`IGNORE` elsewhere.

    Raises:
        ValueError: see :func:`read_conversations` and :func:`tokenize_conversation`; a tokenizer that is not a
            fast tokenizer (no character offsets).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("chat data needs a fast tokenizer (character offsets locate the assistant's tokens)")
    template = getattr(tokenizer, "chat_template", None) or CHATML
    ids: list[int] = []
    labels: list[int] = []
    for messages in read_conversations(corpus, split):
        tokens, trained = tokenize_conversation(tokenizer, messages, template)
        ids += tokens
        labels += [t if keep else IGNORE for t, keep in zip(tokens, trained)]
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(labels, dtype=torch.int64)
