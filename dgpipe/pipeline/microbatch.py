"""Micro-batches of a mini-batch: its batch size, its split along dim 0 and detached outputs, for tensors and
tuples of tensors alike (the values a stage takes and returns)."""

from __future__ import annotations

import torch

__all__ = ["batch_size", "split_batch", "detach"]


def batch_size(value, what: str) -> int:
    """The batch size (dim 0) of ``value``, a tensor or a non-empty tuple of tensors that all share it.

    Raises:
        TypeError: ``value`` is not a tensor or a non-empty tuple/list of tensors.
        ValueError: the tensors' dim 0 differ, or one is a scalar.
    """
    tensors = [value] if isinstance(value, torch.Tensor) else list(value) if isinstance(value, (tuple, list)) else None
    if not tensors or any(not isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{what} must be a tensor or a non-empty tuple of tensors, got {type(value).__name__}")
    sizes = {t.size(0) if t.dim() > 0 else -1 for t in tensors}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(f"{what}: every tensor needs the same batch size in dim 0, got sizes {sorted(sizes)}")
    return sizes.pop()


def split_batch(value, n: int, device: torch.device) -> list:
    """``n`` micro-batches of ``value`` (tensor or tuple) along dim 0 (``Tensor.tensor_split``: sizes differ by at
    most one), on ``device``."""
    if isinstance(value, torch.Tensor):
        return list(value.to(device).tensor_split(n))
    parts = [t.to(device).tensor_split(n) for t in value]
    return [tuple(p[m] for p in parts) for m in range(n)]


def detach(value):
    """``value`` (tensor or tuple of tensors) detached from autograd."""
    return value.detach() if isinstance(value, torch.Tensor) else tuple(t.detach() for t in value)
