"""The steps the boundary codecs compose (DESIGN: transform -> grouping -> levels -> rounding -> packing).

- :mod:`.hadamard`: the transform, a seeded random-sign Hadamard rotation;
- :mod:`.grouping`: how a tensor is cut into groups (tensor, token, channel, tile) and what
  its per-group metadata is sent as;
- :mod:`.grid`: the codec's input as float32, its options, and per-group uniform grids as sent;
- :mod:`.levels`: codebooks (Lloyd-Max levels of the normal distribution, or fitted).

The per-value work of each step -- rounding, level assignment, bit-packing, the Hadamard
butterflies -- is in :mod:`dgpipe.compression.kernels`.
"""
