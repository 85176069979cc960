"""Boundary codecs, each a validated choice of steps (:mod:`..steps`, :mod:`..kernels`) and a header.

- :mod:`.cast`: ``none``, ``fp16``, ``bf16`` (lossless or a cast);
- :mod:`.intpack`: ``intpack``, integer and bool tensors bit-packed losslessly;
- :mod:`.quantize`: ``quant``, uniform min-max quantization per tensor or group;
- :mod:`.sortquant`: ``sortquant``, equal-count buckets by rank, a uniform grid in each;
- :mod:`.codebook`: ``codebook``, per-group RMS scale and Lloyd-Max levels;
- :mod:`.subspace`: ``subspace``, a few dominant directions as 16-bit factors, the residual by ``codebook``.

Importing this package registers them (:func:`..base.register_codec`).
"""

from . import cast, codebook, intpack, quantize, sortquant, subspace  # noqa: F401  (registers the codecs)
