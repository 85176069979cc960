"""Write the instruction data of the LM fine-tuning benchmarks: ``benchmarks/data/wiki-chat/{train,valid}.jsonl``.

Two kinds of request over the Wikipedia articles of ``../shared/data/text/wiki-excerpt`` (CC BY-SA, so the
conversations are too), each a user turn and the assistant's answer in the ``messages`` format of
:mod:`dgpipe.data.chat`:

- *continue*: "Continue this passage from the Wikipedia article on <title>: <two sentences>" -> the next two
  sentences of the article;
- *title*: "Which Wikipedia article begins like this? <first sentence>" -> "<title>.".

The training conversations come from the corpus's training articles, the held-out ones from its validation
articles (other topics), so the held-out loss measures the skill rather than the articles. Deterministic: the
same files every run (seeded sampling).

    python benchmarks/make_chat_data.py [--corpus ../shared/data/text/wiki-excerpt] [--out benchmarks/data/wiki-chat]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def articles(text: str) -> list[tuple[str, list[str]]]:
    """``(title, sentences)`` of every ``= Title =`` article with at least 6 sentences of prose."""
    out = []
    for block in re.split(r"^= (.+?) =$", text, flags=re.M)[1:]:
        out.append(block)
    pairs = []
    for title, body in zip(out[0::2], out[1::2]):
        prose = " ".join(line.strip() for line in body.splitlines() if len(line.split()) > 8 and "=" not in line)
        sentences = [s.strip() for s in SENTENCE.split(prose) if 20 <= len(s.strip()) <= 300]
        if len(sentences) >= 6:
            pairs.append((title.strip(), sentences))
    return pairs


def conversations(text: str, per_article: int, rng: random.Random) -> list[dict]:
    """``per_article`` continuation requests and one title request per article."""
    rows = []
    for title, sentences in articles(text):
        rows.append({"messages": [
            {"role": "user", "content": f"Which Wikipedia article begins like this? {sentences[0]}"},
            {"role": "assistant", "content": f"{title}."}]})
        for start in rng.sample(range(len(sentences) - 3), min(per_article, len(sentences) - 3)):
            passage, answer = " ".join(sentences[start:start + 2]), " ".join(sentences[start + 2:start + 4])
            rows.append({"messages": [
                {"role": "user", "content": f"Continue this passage from the Wikipedia article on {title}: {passage}"},
                {"role": "assistant", "content": answer}]})
    rng.shuffle(rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(ROOT.parent.parent / "shared/data/text/wiki-excerpt"))
    ap.add_argument("--out", default=str(ROOT / "data/wiki-chat"))
    ap.add_argument("--per-article", type=int, default=8, help="continuation requests per training article")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, per_article in (("train", args.per_article), ("valid", 24)):
        text = (Path(args.corpus) / f"{split}.txt").read_text(encoding="utf-8")
        rows = conversations(text, per_article, random.Random(f"wiki-chat-{split}"))
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                            encoding="utf-8")
        print(f"{out / split}.jsonl: {len(rows)} conversations")


if __name__ == "__main__":
    main()
