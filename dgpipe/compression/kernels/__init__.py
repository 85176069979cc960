"""Kernels: one function per codec step, each with a plain-torch reference and accelerated backends.

A codec calls each step once and gets its result; which implementation runs it --
the reference torch ops, compiled CPU loops (C) or GPU programs (Triton) -- is
chosen here once per tensor (:func:`.dispatch.choose`: device, size), the ``n % CHUNK``
tail of a compiled kernel's output is completed here, and a kernel that fails is
switched off alone, with one warning (:func:`.backend.run`). Every backend gives the
same bytes: ``tests/test_golden_payloads.py`` pins them.

==========================  ==========================================  ===================
step                        function                                     module
==========================  ==========================================  ===================
bit-packing                 :func:`pack_bits`, :func:`unpack_bits`       :mod:`.bitpack`
uniform grid                :func:`uniform_codes`, :func:`uniform_values`, :mod:`.uniform`
                            :func:`uniform_message`, :func:`finite_grid`
bucket boundaries/extrema   :func:`bucket_grid`                          :mod:`.buckets`
bucket codes                :func:`bucket_codes`, :func:`bucket_values`  :mod:`.buckets`
codebook assignment         :func:`level_codes`, :func:`level_values`    :mod:`.levels`
RMS scale per group         :func:`row_rms`                              :mod:`.levels`
token-grouped codebook      :func:`level_rows`,                          :mod:`.levels`
message in one pass         :func:`level_rows_values`
Hadamard butterflies        :func:`fwht`                                 :mod:`.fwht`
==========================  ==========================================  ===================

Backends: :mod:`.compiled` (``codes.c``) and :mod:`.rows` (``rows.c``: the token-grouped codebook in one pass
per row), compiled C built at install time, on CPU; :mod:`.triton_codes`, :mod:`.triton_rows` (the token-grouped
codebook in one launch) and :mod:`.triton_buckets` (sort quantization; a sampled split's message in two) on
CUDA. :mod:`.dispatch` chooses among them; :mod:`.backend` holds the switch (``DGPIPE_FUSED=0`` or
:func:`set_enabled`), the C libraries, how a kernel's work is cut for torch's OpenMP threads (``team.h`` runs the
parts) and the per-kernel failure record; :mod:`.deferred` the decoders' checks that a device leaves to the
runtime's next wait.
"""

from .backend import MIN_VALUES, enabled, failed_kernels, set_enabled
from .bitpack import CHUNK, pack_bits, packed_nbytes, unpack_bits
from .buckets import BucketGrid, BucketIndex, bucket_codes, bucket_grid, bucket_values
from .fwht import fwht
from .levels import level_codes, level_rows, level_rows_values, level_values, nearest_level, row_rms
from .uniform import finite_grid, finite_range, grid_levels, uniform_codes, uniform_message, uniform_values

__all__ = [
    "MIN_VALUES", "CHUNK", "enabled", "set_enabled", "failed_kernels", "pack_bits", "unpack_bits", "packed_nbytes",
    "BucketGrid", "BucketIndex", "bucket_grid", "bucket_codes", "bucket_values", "fwht", "nearest_level",
    "level_codes", "level_values", "row_rms", "level_rows", "level_rows_values", "finite_grid", "finite_range",
    "grid_levels", "uniform_codes", "uniform_values", "uniform_message",
]
