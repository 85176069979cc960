"""A tokenizer that needs no model hub: for tests, CI smoke runs and offline machines."""

from __future__ import annotations

from collections.abc import Iterable

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4 in this order


def offline_tokenizer(texts: Iterable[str], vocab_size: int = 2000, token_type_ids: bool = False):
    """Train a small lower-cased WordPiece tokenizer on ``texts`` and wrap it for transformers.

    What it is: a BERT-style tokenizer (BERT normaliser and pre-tokeniser, WordPiece with
    ``##`` continuation pieces) trained on the fly with the ``tokenizers`` library, wrapped
    as ``transformers.PreTrainedTokenizerFast``. Special tokens ``[PAD]=0, [UNK]=1,
    [CLS]=2, [SEP]=3, [MASK]=4``; a single text becomes ``[CLS] a [SEP]``, a pair
    ``[CLS] a [SEP] b [SEP]``. It has no pretrained meaning: use it only with a randomly
    initialised model whose config has ``vocab_size=len(tokenizer)`` and
    ``pad_token_id=tokenizer.pad_token_id`` (see
    :func:`dgpipe.models.encoder.small_encoder_config`).

    Args:
        texts: training corpus (e.g. the task's own training sentences); not empty.
        vocab_size: upper bound on the vocabulary (a small corpus may give fewer).
        token_type_ids: also return ``token_type_ids`` (0 for the first text, 1 for the
            second), as BERT-family tokenizers do; off by default, as for RoBERTa (whose
            default ``type_vocab_size`` is 1).

    Returns:
        a ``PreTrainedTokenizerFast``.

    Raises:
        ValueError: empty corpus or ``vocab_size`` too small for the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [t for t in texts if t]
    if not texts:
        raise ValueError("offline_tokenizer needs a non-empty list of training texts")
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
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
