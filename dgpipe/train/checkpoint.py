"""Checkpoints of a multi-process run: one file per rank plus a small JSON index.

Layout of a checkpoint directory (``--save DIR``)::

    DIR/rank0.pt, DIR/rank1.pt, ...   each rank's stages, optimizer, schedule, epoch, step
    DIR/meta.json                     written by rank 0 once every rank has saved

Each rank writes only what it holds, so a checkpoint of a multi-machine run lies on
the machines that ran it. Files are written to a temporary name and renamed, so an
interrupted save leaves the previous checkpoint intact. Rank files are read with
``torch.load(weights_only=True)``: tensors and plain containers only, nothing that
could run code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "META_NAME", "rank_path", "save_rank", "write_meta", "read_meta", "load_rank"]

#: Version of the layout; :func:`read_meta` refuses others.
FORMAT = 1
META_NAME = "meta.json"
_META_FIELDS = {"format": int, "world_size": int, "mode": str, "epoch": int, "step": int}


def rank_path(directory: str | os.PathLike, rank: int) -> Path:
    """``directory/rank{rank}.pt``."""
    return Path(directory) / f"rank{rank}.pt"


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_rank(directory: str | os.PathLike, rank: int, state: dict[str, Any]) -> Path:
    """Write one rank's state (tensors and plain containers) atomically; returns the file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = rank_path(directory, rank)
    _atomic(path, lambda tmp: torch.save(state, tmp))
    return path


def write_meta(directory: str | os.PathLike, *, world_size: int, mode: str, epoch: int, step: int,
               args: dict[str, Any]) -> Path:
    """Write ``meta.json`` (call on rank 0 after every rank's :func:`save_rank`).

    Args:
        epoch: epochs completed; a resumed run starts with the next one.
        step: optimizer steps completed (the LR schedule's position).
        args: the run's arguments, for the record.
    """
    meta = {"format": FORMAT, "world_size": world_size, "mode": mode, "epoch": epoch, "step": step, "args": args}
    path = Path(directory) / META_NAME
    _atomic(path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8"))
    return path


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """Read and check ``meta.json``.

    Raises:
        ValueError: no checkpoint there (names the path tried), or a malformed index.
    """
    path = Path(directory) / META_NAME
    if not path.is_file():
        raise ValueError(f"--resume {directory}: no checkpoint there ({path} not found); "
                         "pass a directory written by --save")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg})") from None
    for key, kind in _META_FIELDS.items():
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"{path}: field {key!r} missing or not {kind.__name__}")
    if meta["format"] != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta['format']}, this dgpipe reads {FORMAT}")
    return meta


def load_rank(directory: str | os.PathLike, rank: int, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load one rank's state written by :func:`save_rank`.

    Raises:
        FileNotFoundError: this rank's file is missing (e.g. resumed on another machine).
    """
    path = rank_path(directory, rank)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file of rank {rank} not found: {path}")
    return torch.load(path, map_location=map_location, weights_only=True)
