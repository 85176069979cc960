"""Delta compression against per-example caches (AQ-SGD), one boundary tensor on one side of the link.

AQ-SGD (Wang et al., "Fine-tuning Language Models over Slow Networks using Activation
Compression with Guarantees", NeurIPS 2022) sends, for a training example ``i`` whose
boundary activation is ``a``, only the quantized change ``Q(a - m[i])`` against the
last reconstruction ``m[i]`` that *both* sides hold; both then set
``m[i] = m[i] + decode(Q(a - m[i]))``. The receiver's ``m[i]`` is therefore exactly the
sender's, the compression error does not accumulate, and while fine-tuning moves the
activations little between two visits of an example the change is far smaller than the
activation, so a few bits per value carry it well.

Here:

- :class:`DeltaCache` is the per-example store of one side: ``N`` rows of the boundary
  tensor's per-example shape (``float16`` by default; ``bfloat16``/``float32``/``float64``
  on request), zero until an example is first sent, in memory (CPU) or in a
  memory-mapped file. It is allocated from the first rows it sees; a later row with a
  larger per-example shape (a longer padded text batch) grows it, and a shorter one
  uses the leading part (padding positions are the model's business, not the cache's).
- :class:`DeltaCoder` wraps any codec (the *inner* codec) with one cache. The first
  visit of an example is coded against ``m[i] = 0``, i.e. the activation itself goes
  through the inner codec (direct compression); :meth:`DeltaCoder.refresh` stores an
  activation sent losslessly instead (a full-precision warm-up, which the paper also
  describes). The pipeline's default is no warm-up: one uncompressed epoch out of three
  would alone cost 32/3 ~ 10.7 bits per value over the run.

Arithmetic: the change is computed in ``torch.promote_types(activation dtype, cache
dtype)``, so with a ``float64`` cache and a lossless inner codec the reconstruction is
the activation bit for bit; with narrower caches it is within the rounding of that
dtype. Both sides compute ``m[i] + decode(payload)`` from identical operands, so their
caches stay bit-identical on the same device type.

Usage (one coder per side, same inner codec and cache options)::

    sender = DeltaCoder(get_codec("quant", bits=2), DeltaCache(n_examples))
    receiver = DeltaCoder(get_codec("quant", bits=2), DeltaCache(n_examples))
    payload = sender.encode(a, ids)        # a: (B, ...) floating, ids: int64 (B,)
    r = receiver.decode(payload, ids)    # r: a.dtype

The payload is the inner codec's payload of the change with one header field relabelled:
its ``dtype`` names the activation's dtype (what the receiver returns), not the change's;
the change's dtype is ``promote_types(that, cache dtype)``, which both sides know. So a
delta payload carries its dtype itself, in exactly the inner payload's bytes.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..base import Codec, Payload, code_from_dtype, dtype_from_code

__all__ = ["CACHE_DTYPES", "DEFAULT_MAX_BYTES", "DeltaSpec", "DeltaCache", "DeltaCoder", "check_ids"]

#: dtypes a cache may hold (name -> dtype): the CLI's choices.
CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}
#: Default largest in-memory cache, bytes (4 GiB); memory-mapped caches have no limit.
DEFAULT_MAX_BYTES = 4 << 30


@dataclass(frozen=True)
class DeltaSpec:
    """Which boundaries are delta-coded, and how their caches are kept.

    Attributes:
        examples: number of training examples ``N``; sample ids are in ``[0, N)``.
        boundaries: indices ``i`` of the boundaries ``stage{i}->stage{i+1}`` to delta-code;
            ``None``: every boundary.
        cache_dtype: dtype of the stored reconstructions.
        cache_dir: directory for memory-mapped cache files; ``None``: in memory.
        max_bytes: largest in-memory cache (bytes, per boundary tensor and side).

    Raises:
        ValueError: ``examples < 1``, a cache dtype not in :data:`CACHE_DTYPES`,
            ``max_bytes < 1``, or a negative boundary index.
    """

    examples: int
    boundaries: tuple[int, ...] | None = None
    cache_dtype: torch.dtype = torch.float16
    cache_dir: str | None = None
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.examples, bool) or not isinstance(self.examples, int) or self.examples < 1:
            raise ValueError(f"delta caches need the number of training examples (>= 1), got {self.examples!r}")
        if self.cache_dtype not in CACHE_DTYPES.values():
            raise ValueError(f"delta cache dtype must be one of {sorted(CACHE_DTYPES)}, got {self.cache_dtype}")
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"delta cache max_bytes must be a positive int, got {self.max_bytes!r}")
        if self.boundaries is not None:
            object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
            if any(b < 0 for b in self.boundaries):
                raise ValueError(f"delta boundaries are indices >= 0, got {self.boundaries}")

    def covers(self, boundary: int) -> bool:
        """Whether boundary ``stage{boundary}->stage{boundary+1}`` is delta-coded."""
        return self.boundaries is None or boundary in self.boundaries


def check_ids(ids: torch.Tensor, examples: int, rows: int | None = None, where: str = "sample_ids") -> None:
    """Check sample ids: 1-D int64, each in ``[0, examples)``, no repeats, ``rows`` of them.

    Raises:
        ValueError: naming ``where`` and the offending value.
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"{where} must be a 1-D int64 tensor of dataset indices, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    if rows is not None and ids.numel() != rows:
        raise ValueError(f"{where} has {ids.numel()} ids for {rows} rows")
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= examples:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{where}: id {bad} is out of range [0, {examples}) (the number of training examples)")
        if ids.unique().numel() != ids.numel():
            raise ValueError(f"{where} repeats an id within one batch; every row must be a distinct example")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without the host waiting for the device: a host tensor bound for a GPU goes through
    pinned memory, an asynchronous copy (torch keeps the pinned buffer until the copy is done)."""
    if t.device == device:
        return t
    if t.is_cpu and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class DeltaCache:
    """Per-example reconstructions of one boundary tensor on one side: ``(N, *row_shape)``.

    Args:
        examples: ``N``.
        dtype: stored dtype (one of :data:`CACHE_DTYPES`).
        path: file to memory-map (created or overwritten); ``None``: in CPU memory.
        max_bytes: largest in-memory size (bytes); not applied to a memory-mapped cache.
        name: what messages call it (e.g. ``"stage0->stage1 tensor 0, sender"``).
        report: called once per allocation with a line ``examples x values x bytes = size``.
        device: where an in-memory cache lives (default CPU). On the activations' GPU, coding reads and
            stores rows without a copy to or from the host, so nothing waits for the device (without a row
            mask: the kept rows' count is data).

    Rows are allocated on first use (:meth:`rows`), zero-filled.

    Raises:
        ValueError: a memory-mapped cache (``path``) on a device other than the CPU.
    """

    def __init__(self, examples: int, dtype: torch.dtype = torch.float16, path: str | os.PathLike | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, name: str = "delta cache",
                 report: Callable[[str], None] | None = None, device: torch.device | str = "cpu") -> None:
        self.examples, self.dtype, self.max_bytes, self.name, self.report = examples, dtype, max_bytes, name, report
        self.path = None if path is None else Path(path)
        self.device = torch.device(device)
        if self.path is not None and self.device.type != "cpu":
            raise ValueError(f"{name}: a memory-mapped delta cache lives in host memory, not on {self.device}")
        self.values: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held (0 before allocation)."""
        return 0 if self.values is None else self.values.numel() * self.values.element_size()

    def _allocate(self, row_shape: tuple[int, ...]) -> torch.Tensor:
        values = math.prod(row_shape)
        size = self.examples * values * self.dtype.itemsize
        where = f"memory-mapped file {self.path}" if self.path is not None else \
            "memory" if self.device.type == "cpu" else f"{self.device} memory"
        if self.path is None and size > self.max_bytes:
            raise ValueError(
                f"{self.name}: a delta cache of {self.examples} examples x {values} values x {self.dtype.itemsize} "
                f"bytes = {_human(size)} is over the in-memory limit of {_human(self.max_bytes)}; raise the limit "
                f"(max_bytes, CLI --delta-cache-limit) or keep the cache in a memory-mapped file in a directory "
                f"(cache_dir, CLI --delta-cache-dir DIR)")
        if self.path is None:
            out = torch.zeros((self.examples, *row_shape), dtype=self.dtype, device=self.device)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as f:  # a fresh, zero-filled (sparse) file of the right size
                f.truncate(size)
            numel = self.examples * values
            out = torch.from_file(str(self.path), shared=True, size=numel, dtype=self.dtype).view(self.examples,
                                                                                                 *row_shape)
        if self.report is not None:
            self.report(f"{self.name}: {self.examples} examples x {values} values x {self.dtype.itemsize} bytes "
                        f"= {_human(size)} in {where}")
        return out

    def _fit(self, row_shape: tuple[int, ...]) -> None:
        """Allocate, or grow to hold rows of ``row_shape`` (same number of dimensions)."""
        if self.values is None:
            self.values = self._allocate(row_shape)
            return
        have = tuple(self.values.shape[1:])
        if len(have) != len(row_shape):
            raise ValueError(f"{self.name}: rows of shape {row_shape} after rows of shape {have}; a delta-coded "
                             f"tensor must keep its number of dimensions")
        if all(r <= h for r, h in zip(row_shape, have)):
            return
        grown = tuple(max(r, h) for r, h in zip(row_shape, have))
        old = self.values
        if self.path is not None:  # the new file replaces the old one: copy through memory
            old = old.clone()
        self.values = self._allocate(grown)
        self.values[(slice(None), *(slice(0, h) for h in have))] = old

    def _region(self, ids: torch.Tensor, row_shape: tuple[int, ...]) -> tuple:
        return (_to_device(ids, self.device), *(slice(0, r) for r in row_shape))

    def rows(self, ids: torch.Tensor, row_shape: Sequence[int]) -> torch.Tensor:
        """The stored rows of examples ``ids`` (int64 ``(B,)``), cut to ``row_shape``:
        ``(B, *row_shape)`` in the cache dtype, on the cache's device (zeros for examples never stored)."""
        row_shape = tuple(int(r) for r in row_shape)
        self._fit(row_shape)
        return self.values[self._region(ids, row_shape)]

    def store(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` (``(B, *row_shape)``, any floating dtype and device) for examples ``ids``."""
        row_shape = tuple(rows.shape[1:])
        self._fit(row_shape)
        self.values[self._region(ids, row_shape)] = rows.detach().to(self.device, self.dtype)

    def digest(self) -> str:
        """SHA-256 (hex) of the stored bytes and shape: equal on both sides of a link."""
        h = hashlib.sha256()
        if self.values is not None:
            h.update(str(tuple(self.values.shape)).encode())
            h.update(self.values.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest()

    def state_dict(self) -> dict:
        """``{"values": tensor (N, *row_shape) or None}``: the cache's own tensor, not a copy (as
        ``torch.nn.Module.state_dict``); copy it before the cache changes if it must outlive that
        (the checkpoint writer snapshots it)."""
        return {"values": self.values}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (allocating, so the limit and the file apply).

        Raises:
            ValueError: a tensor of another dtype or number of examples.
        """
        values = state.get("values")
        if values is None:
            self.values = None
            return
        if not isinstance(values, torch.Tensor) or values.dtype != self.dtype or values.dim() < 1 \
                or values.shape[0] != self.examples:
            raise ValueError(f"{self.name}: saved cache {getattr(values, 'dtype', values)} "
                             f"{tuple(getattr(values, 'shape', ()))} does not fit {self.examples} examples of "
                             f"{self.dtype}; resume with the same training set and --delta-cache-dtype")
        self.values = None
        self._fit(tuple(values.shape[1:]))
        self.values.copy_(values)


class DeltaCoder:
    """Delta coding of one boundary tensor against one side's :class:`DeltaCache` (stateful).

    Args:
        inner: the codec of the change (stateless: forward activations only).
        cache: this side's cache.


    Attributes:
        stats: float64 ``(3,)`` sums over the values this side has encoded since the last
            :meth:`take_stats`: ``[sum a^2, sum (a - m)^2, sum (a - r)^2]`` -- the activations'
            energy, the energy of the change that was coded, and the reconstruction error.
    """

    stateful = True

    def __init__(self, inner: Codec, cache: DeltaCache) -> None:
        if not isinstance(inner, Codec) or inner.stateful:
            raise ValueError(f"delta coding needs a stateless inner codec, got {inner!r}")
        self.inner, self.cache = inner, cache
        self.stats = torch.zeros(3, dtype=torch.float64)

    def take_stats(self) -> torch.Tensor:
        """:attr:`stats` (on CPU: a read back where the cache is on a device), reset to zero."""
        out, self.stats = self.stats.cpu(), torch.zeros_like(self.stats)
        return out

    def _base(self, ids: torch.Tensor, row_shape, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        wide = torch.promote_types(dtype, self.cache.dtype)
        return self.cache.rows(ids, row_shape).to(device=device, dtype=wide)

    def encode(self, x: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor | None = None) -> Payload:
        """Sender: encode ``x - m[ids]`` with the inner codec and update ``m[ids]``.

        Args:
            x: ``(B, ...)`` floating activations of examples ``ids``.
            ids: int64 ``(B,)``, checked by the caller (:func:`check_ids`).
            keep: bool ``(B, L)``, or None: only the change of the rows ``x[keep]`` (``(kept, ...)``) is
                coded and sent; the other rows of ``m[ids]`` stay as they are (padding rows), and
                :attr:`stats` counts the kept rows.

        Returns:
            The inner codec's payload of the change (computed in ``promote_types(x.dtype,
            cache dtype)``), its header's ``dtype`` field relabelled to ``x.dtype``.

        Raises:
            ValueError: ``x`` not floating or not batched like ``ids`` (and ``keep``); what the inner codec
                raises.
        """
        if not x.is_floating_point() or x.dim() < 1 or x.shape[0] != ids.numel() or (
                keep is not None and x.shape[:keep.dim()] != keep.shape):
            raise ValueError(f"{self.cache.name}: delta coding needs a floating (B, ...) tensor with one row per "
                             f"id, got {x.dtype} {tuple(x.shape)} for {ids.numel()} ids"
                             + (f" and a {tuple(keep.shape)} row mask" if keep is not None else ""))
        m = self._base(ids, x.shape[1:], x.device, x.dtype)
        a = x.detach().to(m.dtype)
        change = a - m
        if keep is None:
            payload = self.inner.encode(change)
            r = m + self.inner.decode(payload)
            kept = (a, change, a - r)
        else:
            keep = keep.to(m.device)
            payload = self.inner.encode(change[keep])
            r = m.index_put((keep,), m[keep] + self.inner.decode(payload))
            kept = (a[keep], change[keep], (a - r)[keep])
        self.cache.store(ids, r)
        sums = torch.stack([t.double().square().sum() for t in kept])
        self.stats = _to_device(self.stats, sums.device) + sums  # where the values are: no read back
        return _relabel(payload, x.dtype)

    def decode(self, payload: Payload, ids: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Receiver: ``m[ids] + decode(payload)``, stored as the new ``m[ids]``, returned in the
        activation's dtype (the payload's header names it). With ``keep`` (bool ``(B, L)``) the payload
        holds the change of the kept rows only, as :meth:`encode` sent it; the other rows keep ``m[ids]``.

        Raises:
            ValueError: a corrupt payload (a non-floating dtype field included), or one whose
                rows do not match ``ids`` (or ``keep``).
        """
        h = payload.header
        if not isinstance(h, torch.Tensor) or h.dim() != 1 or h.numel() < 3:
            raise ValueError("corrupt header: a delta payload's header has no 'dtype' field")
        dtype = dtype_from_code(int(h[2]), "delta dtype")
        if not dtype.is_floating_point:
            raise ValueError(f"corrupt header: field 'delta dtype' is {dtype}, not a floating dtype")
        d = self.inner.decode(_relabel(payload, torch.promote_types(dtype, self.cache.dtype)))
        if keep is not None:
            n = int(keep.sum())
            if d.dim() < 1 or d.shape[0] != n or keep.shape[0] != ids.numel():
                raise ValueError(f"{self.cache.name}: delta payload of shape {tuple(d.shape)} for {n} kept rows of "
                                 f"{ids.numel()} ids")
            r = self._base(ids, (*keep.shape[1:], *d.shape[1:]), d.device, dtype)
            keep = keep.to(r.device)
            r = r.index_put((keep,), r[keep] + d.to(r.dtype))
        else:
            if d.dim() < 1 or d.shape[0] != ids.numel():
                raise ValueError(f"{self.cache.name}: delta payload of shape {tuple(d.shape)} for {ids.numel()} ids")
            r = self._base(ids, d.shape[1:], d.device, dtype)
            r = r + d.to(r.dtype)
        self.cache.store(ids, r)
        return r.to(dtype)

    def refresh(self, x: torch.Tensor, ids: torch.Tensor) -> None:
        """Store ``x`` itself as ``m[ids]`` (the activation travelled losslessly: warm-up)."""
        self.cache.store(ids, x)


def _relabel(payload: Payload, dtype: torch.dtype) -> Payload:
    """``payload`` with its header's ``dtype`` field set to ``dtype`` (the same payload if it is already)."""
    code = code_from_dtype(dtype)
    if int(payload.header[2]) == code:
        return payload
    header = payload.header.clone()
    header[2] = code
    return Payload(header, payload.tensors)
