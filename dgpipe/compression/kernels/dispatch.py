"""Which implementation runs a codec step, chosen once per tensor: the one dispatch of the kernel layer.

Every step of :mod:`dgpipe.compression.kernels` has a plain-torch reference and may have
accelerated implementations: compiled CPU loops (C, :mod:`.compiled`) and GPU programs
(Triton: :mod:`.triton_codes`, :mod:`.triton_buckets` for sort quantization, :mod:`.triton_rows` for the
token-grouped codebook). :func:`choose` picks one per tensor from its device and size, :func:`kernels_of` the
module of an operation's kernels:

- ``"triton"``: a CUDA tensor (or a CPU one after :func:`.triton_codes.run_on_cpu`, the
  interpreter the tests use) of at least :data:`.backend.MIN_VALUES` values, Triton importable;
- ``"c"``: a CPU tensor of at least :data:`.backend.MIN_VALUES` values (where the extension was not
  built, each C step says no and its caller runs the reference);
- ``"torch"``: everything else, and every tensor with the switch (:func:`.backend.enabled`) off.

All give the same bytes (golden payloads, ``tests/test_golden_payloads.py``). The kernel modules
import :mod:`.backend` (switch, threads, failures), never this module, so imports run one way:
steps -> dispatch -> kernels -> backend.
"""

from __future__ import annotations

import sys

import torch

from . import compiled
from .backend import MIN_VALUES, enabled

__all__ = ["choose", "triton_takes", "kernels_of"]


def triton_takes(t: torch.Tensor) -> bool:
    """Whether the Triton kernels take tensors on ``t``'s device: the switch on, a CUDA tensor (or a CPU one
    after :func:`.triton_codes.run_on_cpu`) and Triton importable. Importing it is deferred to the first
    CUDA tensor: it takes a while."""
    if not enabled() or (not t.is_cuda and "dgpipe.compression.kernels.triton_codes" not in sys.modules):
        return False
    from . import triton_codes

    return triton_codes.available(t)


def choose(t: torch.Tensor, n: int | None = None, least: int = MIN_VALUES) -> str:
    """The backend of a step on ``t``: ``"triton"``, ``"c"`` or ``"torch"`` (module docstring).

    Args:
        t: the step's main tensor (its values, or its packed code stream).
        n: the number of values when ``t`` is a code stream (default ``t.numel()``).
        least: the fewest values a compiled backend takes (:data:`.backend.MIN_VALUES`; the row kernels,
            one call per message, take any size).
    """
    if (t.numel() if n is None else n) < least or not enabled():
        return "torch"
    if triton_takes(t):
        return "triton"
    return "c" if t.is_cpu else "torch"


def kernels_of(backend: str, operation: str = "codes"):
    """The module of compiled kernels of ``backend`` for ``operation``: ``"c"``, :mod:`.compiled` (every
    operation); ``"triton"``, :mod:`.triton_buckets` for ``"buckets"`` (sort quantization's splits) and
    :mod:`.triton_codes` for the others (uniform codes, levels), imported on first use."""
    if backend == "triton":
        if operation == "buckets":
            from . import triton_buckets

            return triton_buckets
        from . import triton_codes

        return triton_codes
    return compiled
