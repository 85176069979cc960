"""A tokenizer that needs no model hub: for tests, CI smoke runs and offline machines."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4 in this order


def offline_tokenizer(texts: Iterable[str], vocab_size: int = 2000, token_type_ids: bool = False):
    """Build a small lower-cased WordPiece tokenizer from ``texts`` and wrap it for transformers.

    What it is: a BERT-style tokenizer (BERT normaliser and pre-tokeniser of the
    ``tokenizers`` library, WordPiece model) wrapped as
    ``transformers.PreTrainedTokenizerFast``. Its vocabulary is built deterministically
    from word counts: the special tokens ``[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4``,
    then every character seen (as a word start and as a ``##`` continuation), then the most
    frequent words (ties broken alphabetically) up to ``vocab_size``. A frequent word is
    one token; any other word is spelled in characters, so nothing but unseen characters
    becomes ``[UNK]``. The same texts always give the same tokenizer, so every rank can
    build its own. A single text becomes ``[CLS] a [SEP]``, a pair ``[CLS] a [SEP] b
    [SEP]``. It has no pretrained meaning: use it only with a randomly initialised model
    whose config has ``vocab_size=len(tokenizer)`` and ``pad_token_id=tokenizer.pad_token_id``
    (see :func:`dgpipe.models.encoder.small_encoder_config`).

    Args:
        texts: corpus to count words in (e.g. the task's own training sentences); not empty.
        vocab_size: vocabulary size; exceeded only when the special tokens and the
            characters alone need more.
        token_type_ids: also return ``token_type_ids`` (0 for the first text, 1 for the
            second), as BERT-family tokenizers do; off by default, as for RoBERTa (whose
            checkpoints have a single token type).

    Returns:
        a ``PreTrainedTokenizerFast``.

    Raises:
        ValueError: no non-empty text.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        if text:
            counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    if not counts:
        raise ValueError("offline_tokenizer needs a non-empty list of training texts")
    chars = sorted({c for word in counts for c in word})
    vocab = [*SPECIAL_TOKENS, *chars, *("##" + c for c in chars)]
    words = sorted((w for w in counts if len(w) > 1), key=lambda w: (-counts[w], w))
    vocab += words[: max(0, vocab_size - len(vocab))]

    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab.index("[CLS]")), ("[SEP]", vocab.index("[SEP]"))],
    )
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_type_ids else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=names,
        model_max_length=1 << 20,
    )
