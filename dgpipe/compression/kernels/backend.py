"""What runs a compiled codec kernel, and what happens when one fails: the switch, the libraries, the threads,
the failure record. Which implementation a step takes is chosen in :mod:`.dispatch`; this module imports
no kernel module (the kernels import it).

Switch: on by default; ``DGPIPE_FUSED=0`` in the environment or :func:`set_enabled`
turns the accelerated implementations off (the benchmarks measure both in one run).

Libraries: the C kernels (``codes.c``, ``rows.c``) are built with the package as the optional extensions
``_codes`` and ``_rows`` and loaded with ctypes (:func:`library`, :func:`prepare`). Where they were not built (no
C compiler at install time), the first use says so once (:data:`MISSING`, a ``RuntimeWarning``) and the steps run
the reference.

Failures: a compiled kernel is identified by a key (its name and the constants it is
specialised on, e.g. ``("encode_uniform", 6)``). If one fails to build or run -- Triton
missing, a Triton compile or launch error, a C kernel that returns an error -- :func:`run` issues one
``RuntimeWarning`` naming it, the step falls back to the reference for that call, and
that kernel alone stays off for the rest of the process (:func:`failed_kernels`); every
other kernel keeps running.

Threads: a compiled kernel runs on up to ``torch.get_num_threads()`` threads, as an eager torch op
would, and on the same ones: torch's OpenMP workers (``team.h``: the C side enters the OpenMP runtime torch
runs on through its ``GOMP_parallel``, whose address :func:`openmp_runtime` finds in the process), not a pool
of dgpipe's own beside them. Its work is cut into parts of whole chunks (or rows), up to
:data:`PARTS_PER_THREAD` per thread and none under :data:`MIN_CHUNKS_PER_THREAD` chunks (:func:`team`), and
the threads take the parts in turn, so that a thread slowed by another one on its core takes fewer. The parts
are disjoint, so payloads do not depend on the number of threads (tested). Where torch runs no OpenMP
runtime (a build with another thread pool), the parts run on the calling thread.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import warnings
from typing import Callable

import numpy as np
import torch

from .bitpack import CHUNK

__all__ = ["MISSING", "library", "prepare", "openmp_runtime", "MIN_VALUES", "MIN_CHUNKS_PER_THREAD", "PARTS_PER_THREAD",
           "ENV", "enabled", "set_enabled", "team", "run", "failure", "failed_kernels", "empty"]

MIN_VALUES = 2 * CHUNK
"""Smallest tensor (values) the accelerated kernels take; below it the reference is as fast."""

MIN_CHUNKS_PER_THREAD = 32
"""Fewest chunks (of :data:`.bitpack.CHUNK` values) a thread is given: smaller parts cost more to hand out than to
run."""

PARTS_PER_THREAD = 4
"""Parts a kernel's work is cut into per thread, where there are several threads (module docstring)."""

ENV = "DGPIPE_FUSED"

_state = {"enabled": os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")}
_kernels: dict[tuple, Callable] = {}
_failed: set[tuple] = set()
_libraries: dict = {}

MISSING = ("dgpipe: the compiled CPU kernels (extensions dgpipe.compression.kernels._codes and _rows) were not "
           "built when dgpipe was installed, most likely for want of a C compiler; the codec steps run the "
           "reference torch path instead (same bytes, slower). Install gcc or clang and reinstall dgpipe to "
           "build them.")
"""The notice, given once per process, where an extension is missing."""


_OPENMP_NAMES = ("libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so", "libomp.dylib", "libiomp5.dylib")
"""Names the OpenMP runtimes torch's wheels bring are loaded by (GCC's, LLVM's, Intel's; Linux and macOS)."""


def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs its intra-op work on, as loaded in this process (found, never loaded:
    ``RTLD_NOLOAD``), where it exports ``GOMP_parallel`` (GCC's libgomp; LLVM's and Intel's runtimes export it
    for compatibility); None where torch's parallel backend is not OpenMP or no such runtime is loaded.

    Candidates: the libraries in torch's own folders (``torch/lib``, ``torch.libs``), then the names torch links
    a system runtime by; the first one loaded is torch's (another package's copy of a runtime is loaded under a
    name of its own)."""
    if "_openmp" in _libraries:
        return _libraries["_openmp"]
    found = None
    if "parallel backend: OpenMP" in torch.__config__.parallel_info() and hasattr(os, "RTLD_NOLOAD"):
        here = os.path.dirname(torch.__file__)
        folders = (os.path.join(here, "lib"), os.path.join(os.path.dirname(here), "torch.libs"))
        candidates = [f for d in folders for f in sorted(glob.glob(os.path.join(d, "*omp*")))]
        for name in (*candidates, *_OPENMP_NAMES):
            try:
                lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
            except OSError:
                continue
            if hasattr(lib, "GOMP_parallel"):
                found = lib
                break
    _libraries["_openmp"] = found
    return found


def prepare(lib: ctypes.CDLL, signatures: dict[str, list]) -> ctypes.CDLL:
    """``lib`` with its functions typed -- ``signatures`` maps a function's name to its ctypes argument types;
    each returns a C int -- and, where it has ``dgpipe_use_team`` (``team.h``), given the ``GOMP_parallel`` of
    :func:`openmp_runtime` (or NULL: its kernels then run on the calling thread)."""
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    if hasattr(lib, "dgpipe_use_team"):
        runtime = openmp_runtime()
        address = ctypes.cast(runtime.GOMP_parallel, ctypes.c_void_p) if runtime is not None else None
        lib.dgpipe_use_team.argtypes, lib.dgpipe_use_team.restype = [ctypes.c_void_p], None
        lib.dgpipe_use_team(address)
    return lib


def library(name: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The compiled extension ``dgpipe.compression.kernels.<name>`` (a plain C library) loaded with ctypes and
    made ready by :func:`prepare` with ``signatures``, or None where it was not built: then :data:`MISSING`,
    once per process.

    Raises:
        OSError: the extension exists but does not load.
    """
    if name not in _libraries:
        spec = importlib.util.find_spec(f"{__package__}.{name}")
        _libraries[name] = prepare(ctypes.CDLL(spec.origin), signatures) if spec is not None and spec.origin else None
        if _libraries[name] is None and not _libraries.get("told"):
            _libraries["told"] = True
            warnings.warn(MISSING, RuntimeWarning, stacklevel=3)
    return _libraries[name]


def enabled() -> bool:
    """Whether the accelerated kernels are used (on unless ``DGPIPE_FUSED=0`` or :func:`set_enabled`)."""
    return _state["enabled"]


def set_enabled(flag: bool) -> bool:
    """Turn the accelerated kernels on or off for this process; returns the previous setting."""
    previous = _state["enabled"]
    _state["enabled"] = bool(flag)
    return previous


def team(units: int) -> tuple[int, int]:
    """``(parts, threads)`` of a kernel over ``units`` chunks (or rows): one part on one thread where one thread
    would do, else up to :data:`PARTS_PER_THREAD` parts per thread of ``torch.get_num_threads()`` (the intra-op
    threads an eager torch op would use), none under :data:`MIN_CHUNKS_PER_THREAD` units. The C side cuts
    ``[p0, p1)`` into ``parts`` ranges ``[p0 + span * k // parts, p0 + span * (k + 1) // parts)`` (``team.h``)."""
    t = max(1, min(torch.get_num_threads(), units // MIN_CHUNKS_PER_THREAD))
    k = 1 if t == 1 else min(t * PARTS_PER_THREAD, units // MIN_CHUNKS_PER_THREAD)
    return k, t


def failure(key: tuple, error: Exception, what: str = "codec kernel") -> bool:
    """Record that kernel ``key`` failed: one ``RuntimeWarning`` naming it, then it stays off. Returns False."""
    _failed.add(key)
    name = key[0] + (f"[{', '.join(map(str, key[1:]))}]" if len(key) > 1 else "")
    warnings.warn(f"dgpipe: {what} {name} unavailable ({type(error).__name__}: {error}); "
                  "its step runs the reference torch path", RuntimeWarning, stacklevel=4)
    return False


def run(key: tuple, build: Callable[[], Callable], args: tuple) -> bool:
    """Run compiled kernel ``key`` (built by ``build`` on first use) on ``args``: one call, which cuts its work
    into parts for torch's threads itself (:func:`team`; ``team.h``).

    Returns:
        True if it ran; False if it is off after a failure, or fails now (:func:`failure`: one warning,
        off for the rest of the process; the caller runs the reference).
    """
    if key in _failed:
        return False
    try:
        kernel = _kernels.get(key)
        if kernel is None:
            kernel = _kernels[key] = build()
        kernel(*args)
        return True
    except Exception as e:  # Triton missing, a compile or launch error: this kernel falls back for good
        return failure(key, e)


def failed_kernels() -> frozenset[tuple]:
    """Keys of the kernels switched off after a failure in this process."""
    return frozenset(_failed)


_NUMPY_DTYPES = {torch.uint8: np.uint8, torch.float32: np.float32}


def empty(n: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``n`` values (uint8 or float32) on ``like``'s device: allocated by numpy on
    CPU (cheaper per call), by torch elsewhere."""
    if like.is_cpu:
        return torch.from_numpy(np.empty(n, _NUMPY_DTYPES[dtype]))
    return torch.empty(n, dtype=dtype, device=like.device)
