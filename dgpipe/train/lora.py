"""LoRA adapters of the LM job (``--lora R``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-targets``) through
``peft``: the config the flags make, the flags checked against a model's modules, the adapters injected.

LoRA: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["check_lora", "lora_config", "add_adapters"]


def check_lora(opts: Any, model_config) -> None:
    """``--lora`` flags (``opts``: the LM job's options, :class:`~dgpipe.train.lm.LMOptions`) against the model's
    modules (a model built on the meta device: no weights allocated).

    Raises:
        ValueError: a rank below 0, an alpha <= 0, a dropout outside [0, 1), a LoRA flag without ``--lora``,
            or targets that match no module.
    """
    if not opts.lora:
        if opts.lora_alpha is not None or opts.lora_dropout or opts.lora_targets is not None:
            raise ValueError("--lora-alpha, --lora-dropout and --lora-targets shape the adapters of --lora R: add it")
        return
    if opts.lora < 0 or (opts.lora_alpha is not None and opts.lora_alpha <= 0) or not 0 <= opts.lora_dropout < 1:
        raise ValueError("--lora takes a rank >= 1, --lora-alpha an integer > 0 and --lora-dropout one in [0, 1)")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    try:
        add_adapters(model, lora_config(opts))
    except ValueError as e:
        first = str(e).strip().splitlines()[0]
        raise ValueError(f"--lora-targets {opts.lora_targets}: {first}") from None


def lora_config(opts: Any):
    """The ``peft.LoraConfig`` of ``--lora`` (a causal LM's adapters), or None without ``--lora``."""
    if not opts.lora:
        return None
    from peft import LoraConfig

    targets = None if opts.lora_targets is None else [t.strip() for t in opts.lora_targets.split(",") if t.strip()]
    config = LoraConfig(r=opts.lora, lora_dropout=opts.lora_dropout, target_modules=targets, task_type="CAUSAL_LM")
    if opts.lora_alpha is not None:
        config.lora_alpha = opts.lora_alpha
    return config


def add_adapters(model: nn.Module, config) -> nn.Module:
    """``model`` with the LoRA adapters of ``config`` (a ``peft.LoraConfig``) injected in place and every other
    weight frozen (``peft.get_peft_model``); returns the same model object, whose layers
    (:func:`~dgpipe.models.causal_lm.causal_lm_layers`) then carry the adapters.

    Raises:
        ValueError: targets that match no module of the model (peft's message).
    """
    from peft import get_peft_model

    peft_model = get_peft_model(model, config)
    return peft_model.get_base_model()
