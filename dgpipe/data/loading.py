"""The one DataLoader recipe shared by the vision and GLUE loaders."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def make_dataloader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int = 0,
    drop_last: bool = False,
    num_workers: int = 0,
    collate_fn: Callable | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> DataLoader:
    """A DataLoader whose order depends only on ``seed`` (and the epoch).

    Args:
        dataset: any map-style dataset.
        batch_size: examples per batch (per rank when ``world_size > 1``).
        shuffle: reshuffle every epoch, from a generator seeded with ``seed`` (worker RNGs,
            e.g. for augmentation, derive from the same generator).
        drop_last: drop the last incomplete batch (a pipeline needs batches divisible by
            its number of micro-batches).
        num_workers: worker processes; kept alive across epochs.
        collate_fn: batch builder (default: torch's ``default_collate``).
        rank, world_size: data parallelism: each rank reads its own ``1/world_size`` shard
            through a ``DistributedSampler``; call ``loader.sampler.set_epoch(epoch)`` at the
            start of every epoch.

    Raises:
        ValueError: ``batch_size < 1`` or ``rank`` not in ``[0, world_size)``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    sampler = None
    if world_size > 1:
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle and sampler is None,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=num_workers > 0,
    )
