"""Models as ordered lists of layers that a partition can cut.

:mod:`.mobilenet` (MobileNetV2 for CIFAR), :mod:`.encoder` (BERT/RoBERTa sequence
classifiers), :mod:`.causal_lm` (decoder LMs: Llama, Qwen2/Qwen3, Gemma 3, GPT-2), :mod:`.split`
(tuple-passing :class:`Stage`, client/server cut), :mod:`.bottleneck` (trained encoder/decoder pairs at stage
boundaries).
"""

from .bottleneck import fit_bottlenecks, insert_bottlenecks
from .causal_lm import build_causal_lm, causal_lm_layers, preset_config
from .encoder import (ATTENTION_MASK, OFFLINE_PACKAGES, build_encoder, encoder_layers, resolve_model,
                      small_encoder_config)
from .mobilenet import build_mobilenet, mobilenet_layers
from .split import Stage, as_stage, client_server_split

__all__ = [
    "Stage",
    "as_stage",
    "OFFLINE_PACKAGES",
    "build_causal_lm",
    "ATTENTION_MASK",
    "build_encoder",
    "causal_lm_layers",
    "build_mobilenet",
    "client_server_split",
    "encoder_layers",
    "fit_bottlenecks",
    "insert_bottlenecks",
    "mobilenet_layers",
    "preset_config",
    "resolve_model",
    "small_encoder_config",
]
