"""Each rank's peak memory while it trains: the resident set of its process on CPU, the allocator's peak on CUDA.

:func:`reset_peak` starts the window (after the model is built and partitioned, so that loading the whole
pretrained model on every rank does not count) and :func:`peak_bytes` reads its peak:

- CUDA: ``torch.cuda.reset_peak_memory_stats`` / ``torch.cuda.max_memory_allocated`` of the rank's device
  (tensors only);
- CPU on Linux: the process's resident set high-water mark ``VmHWM`` of ``/proc/self/status``, reset by
  writing ``5`` to ``/proc/self/clear_refs`` (proc(5)); it counts everything the process holds -- the
  Python interpreter and libraries (:func:`resident_bytes` before the model gives that floor), weights,
  optimizer state, activations, buffers;
- CPU elsewhere (macOS): ``getrusage``'s ``ru_maxrss``, which cannot be reset: the peak since the process
  started, model loading included (:data:`RESETTABLE` is False).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource
import sys
from pathlib import Path

import torch

__all__ = ["RESETTABLE", "resident_bytes", "reset_peak", "peak_bytes", "memory_kind"]

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")
#: Whether the CPU peak can be reset (Linux): else :func:`peak_bytes` on CPU is the process's lifetime peak.
RESETTABLE = _STATUS.is_file() and _CLEAR.exists()


def _status_kib(field: str) -> int | None:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def resident_bytes() -> int:
    """This process's resident set now (bytes; where ``/proc`` is missing, its peak so far)."""
    kib = _status_kib("VmRSS") if _STATUS.is_file() else None
    return kib * 1024 if kib is not None else _lifetime_peak()


def _lifetime_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS: bytes; Linux: KiB


def memory_kind(device: torch.device) -> str:
    """What :func:`peak_bytes` measures on ``device``: ``"cuda_allocated"``, ``"rss"`` or ``"rss_lifetime"``."""
    if device.type == "cuda":
        return "cuda_allocated"
    return "rss" if RESETTABLE else "rss_lifetime"


def _release_free_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc's ``malloc_trim``), so that the
    resident set counts what the process holds rather than what it freed (e.g. the other ranks' share of a model
    every rank loaded whole)."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:
        trim(0)


def reset_peak(device: torch.device) -> None:
    """Start the peak's window now, after releasing freed memory (a no-op on CPU without :data:`RESETTABLE`)."""
    _release_free_memory()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif RESETTABLE:
        try:
            _CLEAR.write_text("5")
        except OSError:  # a sandbox that forbids it: the peak then covers the whole process
            pass


def peak_bytes(device: torch.device) -> int:
    """The peak (bytes) since :func:`reset_peak`, on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kib = _status_kib("VmHWM") if RESETTABLE else None
    return kib * 1024 if kib is not None else _lifetime_peak()
