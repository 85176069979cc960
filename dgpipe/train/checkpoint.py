"""Step checkpoints of a multi-process run: one file per rank per step, the newest K kept.

Layout of a checkpoint directory (``--save DIR``)::

    DIR/step-00000120/rank0.pt      rank 0's state after 120 optimizer steps
    DIR/step-00000120/rank0.json    its size and SHA-256, written after the file
    DIR/step-00000120/rank1.pt ...  the other ranks' (on their own machines)
    DIR/step-00000120/meta.json     rank 0: world size, mode, epoch, step, the run's arguments
    DIR/step-00000240/...

Each rank writes only what it holds, so a checkpoint of a multi-machine run lies on the
machines that ran it. :class:`Writer` snapshots the state (tensor copies) in the calling
thread and writes it from a background thread -- to a temporary name, fsynced, renamed --
so training goes on while the file is written; a rank's ``.json`` appears only once its
``.pt`` is complete. A step is complete when every rank's ``.pt`` matches its ``.json``;
:func:`agree` (a collective) finds the newest step complete on every rank, so a checkpoint
cut short by a crash, or a truncated or corrupt file, is passed over for the one before.
Rank files are read with ``torch.load(weights_only=True)``: tensors and plain containers
only, nothing that could run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FORMAT", "META_NAME", "CorruptCheckpoint", "step_dir", "steps", "latest_meta", "read_meta",
           "load_rank", "Writer", "agree", "discard_after", "config_difference", "RUNTIME_FIELDS"]

#: Version of the layout; :func:`read_meta` refuses others.
FORMAT = 2
META_NAME = "meta.json"
_STEP = re.compile(r"step-(\d{8,})")
_META_FIELDS = {"format": int, "world_size": int, "mode": str, "epoch": int, "step": int, "args": dict}

#: Run arguments that may differ between a checkpoint and the run resuming it: where files and
#: devices are, timeouts, progress output -- nothing that changes what is computed.
RUNTIME_FIELDS = frozenset({
    "log", "bandwidth", "save", "resume", "progress", "save_every", "keep_checkpoints", "backend", "devices",
    "timeout", "link_delay_ms", "data_dir", "num_workers", "delta_cache_dir", "delta_cache_limit",
})


class CorruptCheckpoint(ValueError):
    """A rank file that is missing, truncated or does not match its recorded SHA-256."""


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    """``directory/step-<step, 8 digits>``."""
    return Path(directory) / f"step-{step:08d}"


def steps(directory: str | os.PathLike) -> list[int]:
    """Steps that have a checkpoint folder under ``directory``, oldest first (``[]`` if none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir())


def _rank_files(folder: Path, rank: int) -> tuple[Path, Path]:
    return folder / f"rank{rank}.pt", folder / f"rank{rank}.json"


def _atomic_write(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` through a temporary file: fsynced, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_meta(folder: str | os.PathLike) -> dict[str, Any]:
    """Read and check ``folder/meta.json`` of one step.

    Raises:
        ValueError: missing, not JSON, a field missing or of the wrong type, another format.
    """
    path = Path(folder) / META_NAME
    if not path.is_file():
        raise ValueError(f"{path} not found")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object")
    for key, kind in _META_FIELDS.items():
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"{path}: field {key!r} missing or not {kind.__name__}")
    if meta["format"] != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta['format']}, this dgpipe reads {FORMAT}")
    return meta


def latest_meta(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The ``meta.json`` of the newest step under ``directory`` that has a readable one, or None.

    Rank 0's side only: before any process starts, this is what a resume is checked against.
    """
    for step in reversed(steps(directory)):
        try:
            return read_meta(step_dir(directory, step))
        except ValueError:
            continue
    return None


def config_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The settings in which a run (``current``: ``RunConfig.to_json()``) differs from the one that
    saved a checkpoint (``saved``: its ``meta["args"]``), as ``"name saved -> now, ..."``, or None.
    :data:`RUNTIME_FIELDS` are not compared."""
    keys = sorted((set(saved) | set(current)) - RUNTIME_FIELDS)
    diffs = [f"{k} {json.dumps(saved.get(k))} -> {json.dumps(current.get(k))}" for k in keys
             if saved.get(k) != current.get(k)]
    return ", ".join(diffs) or None


def load_rank(folder: str | os.PathLike, rank: int, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load one rank's state of one step, after checking the file against its recorded size and SHA-256.

    Raises:
        CorruptCheckpoint: the file or its record is missing, or they disagree (truncated, corrupt),
            or torch cannot read it.
    """
    data = _verified(Path(folder), rank)
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:  # a file that passed its digest but is not a torch checkpoint
        raise CorruptCheckpoint(f"{_rank_files(Path(folder), rank)[0]}: not readable ({e})") from None


def _verified(folder: Path, rank: int) -> bytes:
    path, record = _rank_files(folder, rank)
    if not path.is_file() or not record.is_file():
        raise CorruptCheckpoint(f"checkpoint file of rank {rank} not found or incomplete: {path}")
    try:
        expected = json.loads(record.read_text(encoding="utf-8"))
        size, digest = int(expected["bytes"]), str(expected["sha256"])
    except (ValueError, KeyError, TypeError):
        raise CorruptCheckpoint(f"{record}: not a checkpoint record") from None
    data = path.read_bytes()
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise CorruptCheckpoint(f"{path}: {len(data)} bytes that do not match its record ({size} bytes, "
                                f"sha256 {digest[:12]}...): truncated or corrupt")
    return data


def _snapshot(value: Any) -> Any:
    """A copy of a state tree whose tensors the training loop cannot change any more."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


class Writer:
    """Writes one rank's checkpoints in a background thread and keeps the newest ``keep``.

    Args:
        directory: the checkpoint directory (``--save``).
        rank: this process's rank.
        keep: step checkpoints of this rank kept on disk (>= 1); older ones are deleted once a
            newer one is complete.

    A write error surfaces as the exception of the next :meth:`save` or of :meth:`wait`.
    """

    def __init__(self, directory: str | os.PathLike, rank: int, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory, self.rank, self.keep = Path(directory), rank, keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Snapshot ``state`` (tensors and plain containers) now and write it as this rank's file of
        ``step`` in the background (after the previous write has finished). ``meta`` (rank 0:
        ``world_size``, ``mode``, ``epoch``, ``args``) is written as the step's ``meta.json``."""
        self.wait()
        snapshot = _snapshot(state)
        folder = step_dir(self.directory, step)
        folder.mkdir(parents=True, exist_ok=True)
        if meta is not None:
            record = {"format": FORMAT, "step": step, **meta}
            _atomic_write(folder / META_NAME, json.dumps(record, indent=1).encode())
        self._thread = threading.Thread(target=self._write, args=(folder, step, snapshot), daemon=True,
                                        name=f"dgpipe-checkpoint-rank{self.rank}")
        self._thread.start()

    def _write(self, folder: Path, step: int, state: dict[str, Any]) -> None:
        try:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            data = buffer.getbuffer()
            path, record = _rank_files(folder, self.rank)
            _atomic_write(path, data)
            digest = {"step": step, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            _atomic_write(record, json.dumps(digest).encode())
            self._prune()
        except BaseException as e:  # handed to the training thread by wait()
            self._error = e

    def _prune(self) -> None:
        """Delete this rank's files of all but the newest ``keep`` steps it completed, and a step's
        folder once it is empty (or holds only rank 0's ``meta.json``, with rank 0's files gone). The ranks
        prune at once: a folder another rank removes meanwhile is passed over."""
        mine = [s for s in steps(self.directory) if _rank_files(step_dir(self.directory, s), self.rank)[1].exists()]
        for s in mine[:-self.keep]:
            folder = step_dir(self.directory, s)
            for p in _rank_files(folder, self.rank):
                p.unlink(missing_ok=True)
            if self.rank == 0:
                (folder / META_NAME).unlink(missing_ok=True)
            try:
                empty = not any(folder.iterdir())
            except FileNotFoundError:  # another rank emptied and removed it first
                continue
            if empty:
                shutil.rmtree(folder, ignore_errors=True)

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk.

        Raises:
            the write's exception (e.g. ``OSError``: disk full), once.
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def discard_after(directory: str | os.PathLike, rank: int, step: int) -> None:
    """Delete this rank's files of the steps after ``step`` (what an interrupted attempt left past the
    checkpoint its successor resumes from), so that they never mix with the new attempt's."""
    for s in steps(directory):
        if s > step:
            folder = step_dir(directory, s)
            for p in (*_rank_files(folder, rank), *((folder / META_NAME,) if rank == 0 else ())):
                p.unlink(missing_ok=True)


def _all_min(value: int, device: torch.device) -> int:
    buf = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.MIN)
    return int(buf.item())


def written_anywhere(directory: str | os.PathLike, rank: int, device: torch.device) -> list[int]:
    """The steps under ``directory`` for which this rank finished writing its file (its record exists), if any
    rank finished one; else ``[]``. A collective: every rank calls it (``device``: where its collectives run)."""
    mine = [s for s in steps(directory) if _rank_files(step_dir(directory, s), rank)[1].is_file()]
    return mine if -_all_min(-len(mine), device) > 0 else []


def agree(directory: str | os.PathLike, rank: int, device: torch.device,
          map_location: str | torch.device = "cpu") -> tuple[int, dict[str, Any]] | None:
    """The newest step whose checkpoint every rank can load, and this rank's state of it; None
    when there is none. A collective: every rank calls it (``device``: where its collectives run).

    Steps are tried newest first; one whose file is missing, truncated or corrupt on any rank is
    passed over (and its reason printed by that rank) for the one before.
    """
    bound = None
    while True:
        candidates = [s for s in steps(directory) if bound is None or s <= bound]
        step = _all_min(candidates[-1] if candidates else -1, device)
        if step < 0:
            return None
        state, reason = None, None
        try:
            state = load_rank(step_dir(directory, step), rank, map_location)
        except CorruptCheckpoint as e:
            reason = str(e)
        if _all_min(int(state is not None), device):
            return step, state
        if reason is not None:
            print(f"rank {rank}: checkpoint of step {step} passed over: {reason}", flush=True)
        bound = step - 1
