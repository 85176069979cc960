"""Gradient compressors of the data-parallel baseline (:mod:`dgpipe.baseline`).

``onebit`` (1-bit SGD), ``qsgd``/``dithering`` (QSGD), ``terngrad`` (TernGrad), ``topk`` and
``randomk`` (:mod:`.sparsify`), ``dgc`` (Deep Gradient Compression), ``atomo`` (ATOMO) and
``lowrank`` (PowerSGD); :mod:`.core` holds what they share (seeded randomness, input checks).
Importing this package registers them (:func:`..base.register_codec`).
"""

from . import atomo, dgc, lowrank, onebit, qsgd, sparsify, terngrad  # noqa: F401  (registers the codecs)
