"""Text corpora for language modelling: read, tokenize, pack into fixed-length blocks, cache.

A corpus is either a local folder with ``train.txt``, ``valid.txt`` and ``test.txt`` (the layout of
``../shared/data/text/*``, WikiText and most LM corpora) or, online, a Hugging Face dataset named
``NAME[:CONFIG]`` with a ``text`` column and train/validation/test splits. The splits are the
corpus's own, so the held-out set is fixed: every run, seed and codec is scored on the same tokens.

Each split is tokenized as one stream (the text's newlines kept, no special tokens added) and
packed by concatenation and chunking (as GPT-2 and nanoGPT train): block ``k`` of length ``L`` is
``ids[kL : kL + L]`` and its targets the next tokens ``ids[kL + 1 : kL + L + 1]``, so every token
but the first is predicted exactly once (:class:`TokenBlocks`). Token streams are cached on disk,
keyed by the text's and the tokenizer's SHA-256 (:func:`tokenize_corpus`).

Tokenizers: the model's own or any ``AutoTokenizer`` folder (e.g. ``../shared/data/tokenizers/gpt2``),
or ``bpe:N`` -- a byte-level BPE vocabulary of ``N`` tokens trained on the training split with the
``tokenizers`` library (:func:`train_bpe`), which keeps a small model's compute in its blocks
rather than in a 50k-wide output layer.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["SPLITS", "default_cache_dir", "read_corpus", "train_bpe", "load_tokenizer", "tokenize_corpus",
           "TokenBlocks"]

#: The corpus splits and their file names (a Hugging Face dataset's ``valid`` split is ``validation``).
SPLITS = ("train", "valid", "test")
_HF_SPLITS = {"train": "train", "valid": "validation", "test": "test"}


def default_cache_dir() -> Path:
    """``$DGPIPE_CACHE``, else ``$XDG_CACHE_HOME/dgpipe``, else ``~/.cache/dgpipe``."""
    if os.environ.get("DGPIPE_CACHE"):
        return Path(os.environ["DGPIPE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgpipe"


def read_corpus(corpus: str, split: str) -> str:
    """The text of one split.

    Args:
        corpus: a folder holding ``<split>.txt`` files, or (online) a Hugging Face dataset
            ``NAME[:CONFIG]`` with a ``text`` column (e.g. ``Salesforce/wikitext:wikitext-2-raw-v1``).
        split: ``"train"``, ``"valid"`` or ``"test"``.

    Raises:
        ValueError: unknown split; a folder without the split's file (names the path); a name that is
            neither a folder nor a loadable dataset.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    folder = Path(corpus)
    if folder.is_dir():
        path = folder / f"{split}.txt"
        if not path.is_file():
            raise ValueError(f"corpus {corpus}: no {path} (a corpus folder holds train.txt, valid.txt, test.txt)")
        return path.read_text(encoding="utf-8")
    if folder.suffix == ".txt" or os.sep in corpus and not folder.exists():
        raise ValueError(f"corpus {corpus}: no such folder (a corpus folder holds train.txt, valid.txt, test.txt)")
    name, _, config = corpus.partition(":")
    try:
        import datasets

        rows = datasets.load_dataset(name, config or None, split=_HF_SPLITS[split])
        return "\n".join(rows["text"])
    except Exception as e:  # the hub is unreachable, the name unknown, no text column, ...
        raise ValueError(f"corpus {corpus}: not a local folder, and datasets.load_dataset failed ({e})") from None


def train_bpe(text: str, vocab_size: int):
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on ``text`` (GPT-2's scheme: the 256
    bytes as the base alphabet, so no text is out of vocabulary).

    Deterministic for a given text and size. ``<|endoftext|>``, the one special token, is id 0 and
    serves as BOS, EOS and padding. Sennrich et al., "Neural Machine Translation of Rare Words with Subword
    Units", ACL 2016; byte-level as in GPT-2.

    Returns:
        a ``transformers.PreTrainedTokenizerFast``.

    Raises:
        ValueError: ``vocab_size`` below the 256 bytes plus the special token, or an empty text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257 + 1:
        raise ValueError(f"a byte-level BPE needs more than 257 tokens (256 bytes + <|endoftext|>), got {vocab_size}")
    if not text:
        raise ValueError("cannot train a tokenizer on an empty text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", model_max_length=1 << 30)


def _bpe_size(spec: str) -> int | None:
    """``"bpe:N"`` -> N; None for any other tokenizer spec."""
    if not spec.startswith("bpe:"):
        return None
    try:
        return int(spec[4:])
    except ValueError:
        raise ValueError(f"tokenizer {spec!r}: write bpe:N with N the vocabulary size, e.g. bpe:4096") from None


def load_tokenizer(spec: str, corpus: str | None = None, cache_dir: Path | None = None):
    """The tokenizer ``spec`` names.

    Args:
        spec: ``bpe:N`` (a byte-level BPE of ``N`` tokens trained on ``corpus``'s training split, saved
            under ``cache_dir`` the first time and loaded from there after, so every rank gets the same
            one), or a name/folder for ``AutoTokenizer.from_pretrained`` (a folder with only GPT-2's
            ``vocab.json`` and ``merges.txt``, as ``../shared/data/tokenizers/gpt2``: ``GPT2TokenizerFast``).
        corpus: the corpus (``bpe:N`` only).
        cache_dir: where trained tokenizers are kept (default :func:`default_cache_dir`).

    Raises:
        ValueError: a bad ``bpe:N``, or a tokenizer that cannot be loaded.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    size = _bpe_size(spec)
    if size is None:
        folder = Path(spec)
        try:
            if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file() and \
                    not (folder / "tokenizer_config.json").is_file():
                from transformers import GPT2TokenizerFast  # a bare GPT-2-style BPE folder: no config names a class

                return GPT2TokenizerFast.from_pretrained(spec)
            return AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as e:
            raise ValueError(f"tokenizer {spec}: cannot load it ({e}); give a tokenizer folder, a hub name "
                             "(online) or bpe:N") from None
    if corpus is None:
        raise ValueError(f"tokenizer {spec} is trained on a corpus: give one")
    text = read_corpus(corpus, "train")
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = (cache_dir or default_cache_dir()) / "tokenizers" / f"bpe{size}-{digest}.json"
    if not path.is_file():
        tokenizer = train_bpe(text, size)
        _atomic_write(path, tokenizer.backend_tokenizer.to_str().encode())
    return PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", model_max_length=1 << 30)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (ranks may race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _tokenizer_digest(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tokenize_corpus(corpus: str, split: str, tokenizer, cache_dir: Path | None = None) -> torch.Tensor:
    """Token ids of a whole split as one stream: int64 ``(n_tokens,)``.

    The text is encoded line by line (newlines kept, no special tokens) and concatenated. The
    result is cached as ``<cache_dir>/tokens/<text sha>-<tokenizer sha>.npy`` (int32; written
    atomically, so concurrent ranks are safe) and read from there next time.

    Raises:
        ValueError: see :func:`read_corpus`; a split with fewer than 2 tokens.
    """
    text = read_corpus(corpus, split)
    key = f"{hashlib.sha256(text.encode()).hexdigest()[:16]}-{_tokenizer_digest(tokenizer)}"
    path = (cache_dir or default_cache_dir()) / "tokens" / f"{key}.npy"
    if path.is_file():
        ids = np.load(path)
    else:
        lines = text.splitlines(keepends=True)
        encoded = tokenizer(lines, add_special_tokens=False)["input_ids"] if lines else []
        ids = np.fromiter((t for line in encoded for t in line), dtype=np.int64).astype(np.int32)
        with tempfile.TemporaryFile() as buf:
            np.save(buf, ids)
            buf.seek(0)
            _atomic_write(path, buf.read())
    if len(ids) < 2:
        raise ValueError(f"corpus {corpus}, split {split}: {len(ids)} tokens, too few to predict any")
    return torch.from_numpy(ids.astype(np.int64))


class TokenBlocks(Dataset):
    """Fixed-length blocks of a token stream: item ``k`` is ``(ids[kL : kL+L], ids[kL+1 : kL+L+1])``,
    two int64 ``(L,)`` tensors (inputs, next-token targets) -- the targets taken from ``labels`` instead where
    given (chat data: ``-100`` on the tokens not trained, :mod:`dgpipe.data.chat`).

    Args:
        ids: int64 ``(n,)`` token stream.
        length: block length ``L`` (tokens per example).
        limit: keep only the first ``limit`` blocks (a fixed subset), or all.
        labels: int64 ``(n,)`` targets aligned with ``ids``, or None (the ids themselves).

    Raises:
        ValueError: ``length < 1``, a stream shorter than one block plus one token, or labels of another length.
    """

    def __init__(self, ids: torch.Tensor, length: int, limit: int | None = None,
                 labels: torch.Tensor | None = None) -> None:
        if length < 1:
            raise ValueError(f"block length must be >= 1, got {length}")
        n = (len(ids) - 1) // length
        if n < 1:
            raise ValueError(f"{len(ids)} tokens do not fill one block of {length} (+1 target token); "
                             "use a shorter block length")
        if labels is not None and labels.shape != ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} do not match the ids {tuple(ids.shape)}")
        self.ids, self.length, self.n = ids, length, n if limit is None else min(n, limit)
        self.labels = ids if labels is None else labels

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= k < self.n:
            raise IndexError(k)
        start = k * self.length
        return self.ids[start:start + self.length], self.labels[start + 1:start + self.length + 1]
