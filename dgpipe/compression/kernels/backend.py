"""What runs a compiled codec kernel, and what happens when one fails: the switch, the libraries, the threads,
the failure record. Which implementation a step takes is chosen in :mod:`.dispatch`; this module imports
no kernel module (the kernels import it).

Switch: on by default; ``DGPIPE_FUSED=0`` in the environment or :func:`set_enabled`
turns the accelerated implementations off (the benchmarks measure both in one run).

Libraries: the C kernels (``codes.c``, ``rows.c``) are built with the package as the optional extensions
``_codes`` and ``_rows`` and loaded with ctypes (:func:`library`). Where they were not built (no C compiler at
install time), the first use says so once (:data:`MISSING`, a ``RuntimeWarning``) and the steps run the
reference.

Failures: a compiled kernel is identified by a key (its name and the constants it is
specialised on, e.g. ``("encode_uniform", 6)``). If one fails to build or run -- Triton
missing, a Triton compile or launch error, a C kernel that returns an error -- :func:`run` issues one
``RuntimeWarning`` naming it, the step falls back to the reference for that call, and
that kernel alone stays off for the rest of the process (:func:`failed_kernels`); every
other kernel keeps running.

Threads: a compiled kernel runs on ``torch.get_num_threads()`` threads, as an eager torch op
would (the kernels release the GIL). Its work is cut into runs of whole chunks, up to
:data:`PARTS_PER_THREAD` per thread and none under :data:`MIN_CHUNKS_PER_THREAD` chunks
(:func:`parts`), and the threads take the runs in turn (:func:`run`), so that a thread slowed by
another one on its core -- torch's OpenMP workers spin for milliseconds after each parallel op --
takes fewer. The parts are disjoint, so payloads do not depend on the number of threads (tested).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from .bitpack import CHUNK

__all__ = ["MISSING", "library", "typed", "MIN_VALUES", "MIN_CHUNKS_PER_THREAD", "PARTS_PER_THREAD", "ENV", "enabled",
           "set_enabled", "parts", "run", "failure", "failed_kernels", "empty"]

MIN_VALUES = 2 * CHUNK
"""Smallest tensor (values) the accelerated kernels take; below it the reference is as fast."""

MIN_CHUNKS_PER_THREAD = 32
"""Fewest chunks (of :data:`.bitpack.CHUNK` values) a thread is given: smaller parts cost more to hand out than to
run."""

PARTS_PER_THREAD = 4
"""Runs a kernel's work is cut into per thread, where there are several threads (module docstring)."""

ENV = "DGPIPE_FUSED"

_state = {"enabled": os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")}
_kernels: dict[tuple, Callable] = {}
_failed: set[tuple] = set()
_pool: dict = {}
_libraries: dict = {}

MISSING = ("dgpipe: the compiled CPU kernels (extensions dgpipe.compression.kernels._codes and _rows) were not "
           "built when dgpipe was installed, most likely for want of a C compiler; the codec steps run the "
           "reference torch path instead (same bytes, slower). Install gcc or clang and reinstall dgpipe to "
           "build them.")
"""The notice, given once per process, where an extension is missing."""


def typed(lib: ctypes.CDLL, signatures: dict[str, list]) -> ctypes.CDLL:
    """``lib`` with its functions typed: ``signatures`` maps a function's name to its ctypes argument types;
    each returns a C int."""
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def library(name: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The compiled extension ``dgpipe.compression.kernels.<name>`` (a plain C library) loaded with ctypes and
    :func:`typed` by ``signatures``, or None where it was not built: then :data:`MISSING`, once per process.

    Raises:
        OSError: the extension exists but does not load.
    """
    if name not in _libraries:
        spec = importlib.util.find_spec(f"{__package__}.{name}")
        _libraries[name] = typed(ctypes.CDLL(spec.origin), signatures) if spec is not None and spec.origin else None
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


def parts(chunks: int) -> list[tuple[int, int]]:
    """Chunk ranges ``[c0, c1)`` a kernel over ``chunks`` chunks is cut into: one where it runs on one
    thread, else up to :data:`PARTS_PER_THREAD` per thread of ``torch.get_num_threads()`` (the intra-op
    threads an eager torch op would use), none under :data:`MIN_CHUNKS_PER_THREAD` chunks. More than one
    exactly where more than one thread would take part."""
    t = max(1, min(torch.get_num_threads(), chunks // MIN_CHUNKS_PER_THREAD))
    k = 1 if t == 1 else min(t * PARTS_PER_THREAD, chunks // MIN_CHUNKS_PER_THREAD)
    return [(chunks * i // k, chunks * (i + 1) // k) for i in range(k)]


def _workers(k: int) -> ThreadPoolExecutor:
    """A pool of at least ``k`` threads (the kernels release the GIL), created on first use and after a fork."""
    pool = _pool.get("pool")
    if pool is None or _pool["size"] < k:
        if pool is not None:
            pool.shutdown(wait=False)
        pool = _pool["pool"] = ThreadPoolExecutor(max_workers=k, thread_name_prefix="dgpipe-kernels")
        _pool["size"] = k
    return pool


if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=_pool.clear)


def failure(key: tuple, error: Exception, what: str = "codec kernel") -> bool:
    """Record that kernel ``key`` failed: one ``RuntimeWarning`` naming it, then it stays off. Returns False."""
    _failed.add(key)
    name = key[0] + (f"[{', '.join(map(str, key[1:]))}]" if len(key) > 1 else "")
    warnings.warn(f"dgpipe: {what} {name} unavailable ({type(error).__name__}: {error}); "
                  "its step runs the reference torch path", RuntimeWarning, stacklevel=4)
    return False


def run(key: tuple, build: Callable[[], Callable], calls: list[tuple]) -> bool:
    """Run compiled kernel ``key`` (built by ``build`` on first use) on each argument tuple of ``calls``:
    up to ``torch.get_num_threads()`` threads (the calling one and the pool's) take the calls in turn.

    Returns:
        True if it ran; False if it is off after a failure, or fails now (:func:`failure`: one warning,
        off for the rest of the process; the caller runs the reference).

    The calls of one kernel cover disjoint parts of its input and output (:func:`parts`), so the
    result does not depend on the number of threads or on which thread took which call.
    """
    if key in _failed:
        return False
    try:
        kernel = _kernels.get(key)
        if kernel is None:
            kernel = _kernels[key] = build()
        todo, lock = iter(calls), threading.Lock()

        def drain() -> None:
            while True:
                with lock:
                    args = next(todo, None)
                if args is None:
                    return
                kernel(*args)

        helpers = min(torch.get_num_threads(), len(calls)) - 1
        others = [_workers(helpers).submit(drain) for _ in range(helpers)]
        try:
            drain()
        finally:
            for f in others:
                f.result()
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
