"""A language-model run's checkpoint as a Hugging Face model folder (``dgpipe-lm export``), and the model it holds.

:func:`load_run` finds the newest step of a ``--save`` directory that every rank of the run completed
(:mod:`dgpipe.train.checkpoint`: each rank's file checked against its SHA-256), rebuilds the run's model from the
arguments recorded in its ``meta.json`` -- the same pretrained weights or configuration, tokenizer and LoRA
adapters -- and loads every stage's weights into it (the stages name their layers by their index in the whole
model, so the ranks' states join into one). :func:`export` writes it with ``save_pretrained``: ``config.json``,
``model.safetensors``, ``generation_config.json`` and the tokenizer's files, the LoRA adapters merged into the
weights (``peft``'s ``merge_and_unload``), tied embeddings kept tied -- or, with ``adapter_only``, the peft
adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) that loads on top of the base model.
The weights are written in float32 (weights a ``--precision bf16`` run stored in bf16 are widened exactly).

A run with boundary bottlenecks (``--bottleneck``) has layers that no transformers architecture holds: the export
refuses it, and :func:`load_run` gives its stages as the run cut them, each bottleneck pair at its boundary
(:attr:`Run.stages`), which split generation runs (``dgpipe-lm generate --checkpoint``) where the run was cut
client/server; anchored pairs and a residual subspace (``--bottleneck-anchor``, ``--bottleneck-subspace``) are
rebuilt with their token tables. A token reference or codec state is link state, not model, and is left out.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dgpipe.models import Stage
from dgpipe.models.bottleneck import insert_bottlenecks
from dgpipe.models.causal_lm import CausalEmbeddings, build_causal_lm, causal_lm_layers, resolve_lm
from dgpipe.models.subspace import constrain_layers, residual_subspace, subspace_pairs

from . import checkpoint
from .lm import LMOptions, lm_tokenizer, random_config
from .lora import lora_config

__all__ = ["Run", "load_run", "run_context", "export"]


@dataclass
class Run:
    """A run's model rebuilt from its checkpoint.

    Attributes:
        model: the ``AutoModelForCausalLM`` with the run's weights (its LoRA adapters injected, unmerged).
        peft_model: the ``peft.PeftModel`` around it with ``--lora``, else None.
        tokenizer: the run's tokenizer.
        step: the checkpoint's optimizer step.
        args: the run's arguments (``meta.json``'s ``args``).
        stages: with boundary bottlenecks, the run's stages (``nn.Sequential`` of the model's layers, the encoder
            of each pair ending the stage before its boundary and the decoder starting the one after it), else
            None.
    """

    model: nn.Module
    peft_model: Any
    tokenizer: Any
    step: int
    args: dict[str, Any]
    stages: list[nn.Sequential] | None = None


def _complete_step(directory: str) -> tuple[int, dict[str, Any], list[dict[str, Any]]]:
    """The newest step every rank completed: ``(step, meta, rank states)``.

    Raises:
        ValueError: no checkpoint, or none complete (each step's reason)."""
    found = checkpoint.steps(directory)
    if not found:
        raise ValueError(f"{directory}: no checkpoint (step-* folders written by --save)")
    reasons = []
    for step in reversed(found):
        folder = checkpoint.step_dir(directory, step)
        try:
            meta = checkpoint.read_meta(folder)
            states = [checkpoint.load_rank(folder, r) for r in range(meta["world_size"])]
        except ValueError as e:
            reasons.append(f"step {step}: {e}")
            continue
        return step, meta, states
    raise ValueError(f"{directory}: no complete checkpoint ({'; '.join(reasons)})")


def _stage_states(meta: dict[str, Any], states: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' stage weights joined into one ``Stage(*layers)`` state dict."""
    if meta["mode"] == "dataparallel":
        return {k: v for state in states for k, v in state["engine"]["model"].items()}
    return {k: v for weights in _saved_stages(states).values() for k, v in weights.items()}


def _run_parts(directory: str) -> tuple[int, dict[str, Any], list[dict[str, Any]], LMOptions, Any, Any]:
    """``(step, meta, rank states, options, tokenizer, model config)`` of the newest complete checkpoint.

    Raises:
        ValueError: see :func:`load_run` (all but weights that do not fit)."""
    step, meta, states = _complete_step(directory)
    args = meta["args"]
    names = [f.name for f in dataclasses.fields(LMOptions)]
    if any(n not in args for n in ("model", "model_config", "block_length")):
        raise ValueError(f"{directory}: not a language-model run (dgpipe-lm)")
    opts = LMOptions(**{n: args[n] for n in names if n in args})
    tokenizer = lm_tokenizer(opts, args.get("data_dir"))
    config = random_config(opts, len(tokenizer))
    if config is None:
        from transformers import AutoConfig

        source = resolve_lm(str(opts.model))
        extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
        config = AutoConfig.from_pretrained(source.path, **extra)
    return step, meta, states, opts, tokenizer, config


def run_context(directory: str) -> tuple[Any, int | None, int | None]:
    """The tokenizer of the newest complete checkpoint's run, its model's context (tokens), and -- for a run with
    boundary bottlenecks -- the decoder blocks its client held at each end (``--client-layers``: where its pairs
    sit), else None; without building the model: what ``dgpipe-lm generate --checkpoint`` checks before any
    process starts.

    Raises:
        ValueError: see :func:`load_run`; a run with bottlenecks that was not cut client/server (split generation
            runs a client and a server)."""
    _, meta, _, opts, tokenizer, config = _run_parts(directory)
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if opts.bottleneck is None:
        return tokenizer, context, None
    args = meta["args"]
    if args.get("partition") != "client-server" or meta.get("mode") != "pipeline":
        raise ValueError(f"{directory}: the run's bottlenecks sit at the boundaries of a {args.get('partition')} "
                         "partition; split generation takes a run cut client/server (--partition client-server)")
    return tokenizer, context, int(args["client_layers"])


def load_run(directory: str) -> Run:
    """The model of the newest complete checkpoint under ``directory`` (see the module docstring).

    Raises:
        ValueError: no complete checkpoint; not a language-model run; weights that do not fit the rebuilt model
            (names the first keys).
    """
    step, meta, states, opts, tokenizer, config = _run_parts(directory)
    args = meta["args"]
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(int(args["seed"]))  # the model as the run initialised it: a subspace's fixed table is that
        model = build_causal_lm(resolve_lm(str(opts.model)) if opts.model_config is None else config)
    peft_model = None
    if opts.lora:
        from peft import get_peft_model

        peft_model = get_peft_model(model, lora_config(opts))
        model = peft_model.get_base_model()
    anchored = opts.bottleneck_anchor or opts.bottleneck_subspace is not None
    layers = causal_lm_layers(model, carry_ids=anchored)
    if opts.bottleneck is not None:
        saved = _saved_stages(states)
        stages = _bottleneck_stages(layers, model.config, opts, int(args["seed"]), saved)
        parts = [(stage, saved[i]) for i, stage in zip(sorted(saved), stages)]
    else:
        stages, parts = None, [(Stage(*layers), _stage_states(meta, states))]
    for module, state in parts:
        missing, unexpected = module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{directory}, step {step}: the weights do not fit the run's model (missing "
                             f"{', '.join(missing[:3]) or 'none'}; unexpected {', '.join(unexpected[:3]) or 'none'})")
        for p in module.parameters():  # weights stored in 16 bits (--precision bf16) widen exactly
            p.data = p.data.float()
    for stage in stages or []:
        stage.eval()
    return Run(model.eval(), peft_model, tokenizer, step, args, stages)


def _saved_stages(states: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """``{stage index: its weights}`` of a pipeline run's ranks (dgpipe's runtime or torch's schedules)."""
    out = {}
    for state in states:
        engine = state["engine"]
        for index, weights in (engine["stages"] if "stages" in engine else engine).items():
            out[int(index)] = weights
    return out


def _bottleneck_stages(layers: list[nn.Module], config: Any, opts: LMOptions, seed: int,
                       saved: dict[int, dict[str, Any]]) -> list[nn.Sequential]:
    """The run's stages rebuilt from what each saved stage holds: the model's layers by their index, and a pair of
    the saved width at each boundary whose stage saved an encoder
    (:func:`~dgpipe.models.bottleneck.insert_bottlenecks`),
    anchored on the model's token embedding (``--bottleneck-anchor``) or, with ``--bottleneck-subspace``, the run's
    residual subspace rebuilt from its seed and the layers constrained to it (:mod:`dgpipe.models.subspace`: its
    fixed table from the embedding as initialised, or one table per stage); the weights are loaded afterwards."""
    stages, widths = [], {}
    for i in sorted(saved):
        indices = sorted({int(k.split(".")[0]) for k in saved[i] if k.split(".")[0].isdigit()})
        stages.append(nn.Sequential(OrderedDict((str(j), layers[j]) for j in indices)))
        if "bottleneck_encoder.proj.weight" in saved[i]:
            widths[i] = int(saved[i]["bottleneck_encoder.proj.weight"].shape[0])
    first = layers[0]
    assert isinstance(first, CausalEmbeddings)  # causal_lm_layers' first layer
    if opts.bottleneck_subspace is None:
        anchor = first.embed_tokens if opts.bottleneck_anchor else None
        return insert_bottlenecks(stages, widths, int(config.hidden_size), init="orthonormal", anchor=anchor)
    fixed = opts.bottleneck_subspace == "fixed"
    subspace = residual_subspace(first.embed_tokens, int(config.vocab_size), next(iter(widths.values())), seed, fixed)
    constrain_layers(layers, subspace, embeddings=fixed)
    tables = None if fixed else [first.embed_tokens] + [copy.deepcopy(first.embed_tokens) for _ in stages[1:]]
    return subspace_pairs(stages, subspace, tables)


def _plain(model: Any) -> Any:
    """``model`` itself, or -- for weights transformers read from a GGUF file, which it marks quantized and will not
    save although they are de-quantized float32 -- the same weights in a model built from the config without the
    GGUF quantization record."""
    if getattr(model, "hf_quantizer", None) is None:
        return model
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


def export(directory: str, out: str, adapter_only: bool = False, overwrite: bool = False) -> Run:
    """Write the run under ``directory`` to ``out`` as a Hugging Face model folder (or, with ``adapter_only``, a peft
    adapter folder); returns the loaded run.

    Raises:
        ValueError: ``out`` exists and is not empty without ``overwrite``; ``adapter_only`` for a run without LoRA;
            see :func:`load_run`.
    """
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise ValueError(f"{out} exists and is not empty; choose a new folder or pass --overwrite")
    run = load_run(directory)
    if run.stages is not None:
        raise ValueError(f"{directory}: the run has boundary bottlenecks (--bottleneck {run.args.get('bottleneck')}), "
                         "layers no transformers architecture holds; export a run without them (dgpipe-lm generate "
                         "--checkpoint runs it split)")
    if adapter_only and run.peft_model is None:
        raise ValueError(f"--adapter-only: the run in {directory} trained no LoRA adapters (no --lora)")
    target.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        run.peft_model.save_pretrained(target)
    else:
        merged: Any = run.peft_model.merge_and_unload() if run.peft_model is not None else run.model
        merged = _plain(merged)
        merged.save_pretrained(target)
        run.model = merged
    run.tokenizer.save_pretrained(target)
    return run
