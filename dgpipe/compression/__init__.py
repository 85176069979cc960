"""Codecs: tensor -> :class:`Payload` -> tensor. Imports nothing else from dgpipe.

Rooms (each package's docstring says more):

- :mod:`.base`: the codec protocol, the wire ``Payload`` and its integer header, the registry;
- :mod:`.spec`: :class:`CodecSpec`, a codec's name and options, checked once, built per use;
- :mod:`.codecs`: boundary codecs (none/fp16/bf16, intpack, quant, sortquant, codebook);
- :mod:`.steps`: what the codecs compose (rotation, grouping, grids, codebooks);
- :mod:`.kernels`: one function per step, a torch reference and compiled backends;
- :mod:`.wrappers`: stateful wrappers (error feedback, delta coding);
- :mod:`.gradients`: gradient compressors for the data-parallel baseline.
"""

from . import codecs, gradients  # noqa: F401  (registers every codec)
from .base import Codec, Payload, available_codecs, get_codec, parse_header, register_codec
from .kernels.deferred import raise_deferred
from .spec import CodecSpec
from .wrappers import DeltaCache, DeltaCoder, DeltaSpec, ErrorFeedback

__all__ = ["Codec", "CodecSpec", "DeltaCache", "DeltaCoder", "DeltaSpec", "ErrorFeedback", "Payload",
           "available_codecs", "get_codec", "parse_header", "raise_deferred", "register_codec"]
