"""Codecs: tensor -> :class:`Payload` -> tensor. Imports nothing else from dgpipe.

See :mod:`dgpipe.compression.base` for the protocol and the wire header.
"""

from .base import Codec, Payload, available_codecs, get_codec, parse_header, register_codec
from . import cast  # noqa: F401  (registers none, fp16, bf16)
from . import intpack  # noqa: F401  (registers intpack: lossless integer and bool tensors)
from . import lowrank, quantize, sortquant, sparsify  # noqa: F401  (registers quant, sortquant, topk, randomk, lowrank)
from .feedback import ErrorFeedback
from .delta import DeltaCache, DeltaCoder, DeltaSpec
from . import codebook  # noqa: F401  (registers codebook)
from . import atomo, dgc, onebit, qsgd, terngrad  # noqa: F401  (registers the gradient codecs)

__all__ = ["Codec", "DeltaCache", "DeltaCoder", "DeltaSpec", "ErrorFeedback", "Payload", "available_codecs", "get_codec", "parse_header", "register_codec"]
