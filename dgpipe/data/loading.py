"""The one DataLoader recipe shared by the vision and GLUE loaders.

Every batch a loader yields is a pure function of ``(seed, epoch, rank, batch index)``:
its examples come from :class:`EpochBatchSampler` (torch's ``DistributedSampler`` cut
into batches, reshuffled per epoch by ``set_epoch``), and random augmentation draws from
the per-batch seed :func:`batch_seed` that the sampler hands along with the indices.
Nothing depends on how many worker processes ran, whether they were kept alive across
epochs, or on earlier epochs -- so a run resumed at an epoch boundary, or inside an epoch
(``set_epoch(epoch, start)``), sees exactly the batches of an uninterrupted one.

With ``sample_ids=True`` a loader yields ``(inputs, targets, ids)``: ``ids`` int64
``(B,)`` are the examples' indices in the loader's dataset (:class:`WithSampleIds`), what
a delta-coded pipeline keys its per-example caches with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, default_collate

__all__ = ["EpochBatchSampler", "WithSampleIds", "batch_seed", "make_dataloader"]


def batch_seed(seed: int, epoch: int, rank: int, batch: int) -> int:
    """The random seed of batch ``batch`` of ``rank`` in ``epoch``: an int in ``[0, 2**63)``.

    ``numpy.random.SeedSequence(seed, spawn_key=(epoch, rank, batch))`` (negative ``seed``
    taken modulo ``2**64``): nearby arguments give unrelated seeds.
    """
    sequence = np.random.SeedSequence(seed % (1 << 64), spawn_key=(epoch, rank, batch))
    return int(sequence.generate_state(1, np.uint64)[0] >> np.uint64(1))


class EpochBatchSampler(BatchSampler):
    """Batches of dataset indices for one rank, a function of ``(seed, epoch)`` only.

    Args:
        dataset: the map-style dataset (only its length is used).
        batch_size: indices per batch.
        shuffle: permute the indices every epoch (``DistributedSampler``'s permutation,
            seeded with ``seed + epoch``); else in order.
        seed: seed of the permutation and of the batch seeds.
        drop_last: drop the last incomplete batch (and, with ``world_size > 1``, the tail
            that does not divide evenly among the ranks, as ``DistributedSampler`` does).
        rank, world_size: this rank reads its ``1/world_size`` share of every epoch.
        batch_seeds: yield ``[(index, s), ...]`` with ``s = batch_seed(seed, epoch, rank, b)``
            for batch ``b``, so that a dataset can hand the seed of its batch to the collate
            function (see :class:`dgpipe.data.vision.AugmentCollate`); else plain indices.

    Call :meth:`set_epoch` before each epoch, as with ``DistributedSampler``; its ``start``
    resumes an epoch in the middle (batch ``b`` keeps its indices and seed).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        batch_seeds: bool = False,
    ) -> None:
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        super().__init__(sampler, batch_size, drop_last)
        self.seed, self.rank, self.batch_seeds, self.epoch, self.start = seed, rank, batch_seeds, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the order and batch seeds of ``epoch`` (0-based) for the next iteration, which
        yields the epoch's batches from index ``start`` on (a run resumed inside an epoch)."""
        self.epoch, self.start = epoch, start
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list]:
        for b, indices in enumerate(super().__iter__()):
            if b < self.start:
                continue
            if self.batch_seeds:
                s = batch_seed(self.seed, self.epoch, self.rank, b)
                indices = [(i, s) for i in indices]
            yield indices


class WithSampleIds:
    """Collate wrapper: items ``(index, item)`` -> ``(*collate(items), ids int64 (B,))``.

    Pairs with :class:`_IndexedDataset`, which hands every item its dataset index. Picklable
    (it runs in the workers) as long as the wrapped collate function is.

    Args:
        collate: the loader's collate function (``None``: torch's ``default_collate``).
    """

    def __init__(self, collate: Callable | None) -> None:
        self.collate = collate if collate is not None else default_collate

    def __call__(self, items: list[tuple[int, object]]) -> tuple:
        batch = self.collate([item for _, item in items])
        return (*batch, torch.tensor([i for i, _ in items], dtype=torch.int64))


class _IndexedDataset(Dataset):
    """``dataset[key]`` as ``(index, item)``; ``key`` is an index or an ``(index, seed)`` pair."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        return (key[0] if isinstance(key, tuple) else key), self.dataset[key]


def make_dataloader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int = 0,
    drop_last: bool | None = None,
    num_workers: int = 0,
    collate_fn: Callable | None = None,
    rank: int = 0,
    world_size: int = 1,
    batch_seeds: bool = False,
    sample_ids: bool = False,
) -> DataLoader:
    """A DataLoader whose batches depend only on ``seed`` and the epoch (see the module doc).

    Args:
        dataset: any map-style dataset (with ``batch_seeds``: one that takes
            ``(index, seed)`` pairs).
        batch_size: examples per batch (per rank when ``world_size > 1``).
        shuffle: reshuffle every epoch, seeded with ``seed`` and the epoch.
        drop_last: drop the last incomplete batch (a pipeline needs batches divisible by
            its number of micro-batches); default: the same as ``shuffle`` (training).
        num_workers: worker processes; kept alive across epochs.
        collate_fn: batch builder (default: torch's ``default_collate``).
        rank, world_size: data parallelism: each rank reads its own ``1/world_size`` shard.
        batch_seeds: pair every index with its batch's seed (:class:`EpochBatchSampler`).
        sample_ids: yield ``(*batch, ids)`` with the examples' dataset indices (int64 ``(B,)``).

    Call ``loader.batch_sampler.set_epoch(epoch)`` at the start of every epoch.

    Raises:
        ValueError: ``batch_size < 1`` or ``rank`` not in ``[0, world_size)``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    batches = EpochBatchSampler(dataset, batch_size, shuffle=shuffle, seed=seed,
                                drop_last=shuffle if drop_last is None else drop_last, rank=rank,
                                world_size=world_size, batch_seeds=batch_seeds)
    if sample_ids:
        dataset, collate_fn = _IndexedDataset(dataset), WithSampleIds(collate_fn)
    return DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=num_workers,
        collate_fn=collate_fn,
        # Worker seeds come from here, not from torch's global generator (the model's).
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=num_workers > 0,
    )
