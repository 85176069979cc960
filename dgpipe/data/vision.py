"""Image classification batches for training: a Dataset over a decoded uint8 array and
a DataLoader that augments whole batches inside its worker processes.

A training batch's augmentation draws from a generator seeded with its batch seed
(:func:`~dgpipe.data.loading.batch_seed` of seed, epoch, rank and batch index), which
travels with the indices from the loader's sampler to the dataset items and on to the
collate function -- so it is the same in any worker process and after a resume.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .cifar import cifar_key, load_cifar
from .loading import make_dataloader
from .transforms import CIFAR_STATS, ImageTransform


class ImageArrayDataset(Dataset):
    """Images decoded once into memory.

    Args:
        images: uint8 ``(N, H, W, 3)`` (e.g. from :func:`~dgpipe.data.cifar.load_cifar`).
        labels: int64 ``(N,)``.
        classes: class names, ``labels`` index into them.

    Items are ``(uint8 tensor (H, W, 3), int64 label)``; read with an ``(index, seed)`` pair
    (:class:`~dgpipe.data.loading.EpochBatchSampler` with ``batch_seeds``) they are
    ``(image, label, seed)``. The loader's collate function (:class:`AugmentCollate`) turns
    a batch into float32 ``(B, 3, S, S)`` with :class:`~dgpipe.data.transforms.ImageTransform`.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, classes: list[str]) -> None:
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3 or len(images) != len(labels):
            raise ValueError(f"expected uint8 images (N, H, W, 3) and N labels, got {images.dtype} "
                             f"{images.shape} and {len(labels)} labels")
        self.images = torch.from_numpy(np.ascontiguousarray(images))
        self.labels = torch.as_tensor(labels, dtype=torch.int64)
        self.classes = list(classes)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int | tuple[int, int]) -> tuple:
        if isinstance(index, tuple):
            index, seed = index
            return self.images[index], self.labels[index], seed
        return self.images[index], self.labels[index]


class AugmentCollate:
    """Collate function: stack uint8 images and labels, then apply ``transform`` to the batch.

    Items ``(image uint8 (H, W, 3), label int64[, seed int])``; returns ``(float32
    (B, 3, S, S), int64 (B,))``. Stateless and picklable, so it runs in the workers.
    Randomness: a generator seeded with the items' seed (the batch seed, equal for all
    items of a batch), so a batch's augmentation depends on nothing but that seed;
    items without a seed draw from torch's global generator.
    """

    def __init__(self, transform: ImageTransform) -> None:
        self.transform = transform

    def __call__(self, items: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.stack([item[0] for item in items])
        labels = torch.stack([item[1] for item in items])
        generator = torch.Generator().manual_seed(items[0][2]) if len(items[0]) > 2 else None
        return self.transform(images, generator), labels


def make_loader(
    name: str,
    data_dir: str | os.PathLike,
    split: str,
    batch_size: int,
    *,
    image_size: int = 32,
    augment: bool | None = None,
    subset: int | None = None,
    seed: int = 0,
    num_workers: int = 2,
    cache_dir: str | os.PathLike | None = None,
    download: bool = False,
    drop_last: bool | None = None,
    rank: int = 0,
    world_size: int = 1,
    sample_ids: bool = False,
) -> DataLoader:
    """A DataLoader over one CIFAR split, yielding ``(images float32 (B, 3, S, S), labels int64 (B,))``.

    Args:
        name: ``"cifar10"`` or ``"cifar100"``; data found as in :func:`~dgpipe.data.cifar.load_cifar`.
        data_dir, split, subset, seed, cache_dir, download: passed to ``load_cifar``.
        batch_size: images per batch (per rank when ``world_size > 1``).
        image_size: output side ``S`` (bilinear resize; 32 native, 224 ImageNet's).
        augment: random crop (padding 4) and flip; default on for ``"train"``.
        num_workers: DataLoader worker processes (0: in the calling process).
        drop_last: drop a last incomplete batch; default on for ``"train"`` (a pipeline
            needs batches divisible by its micro-batch count).
        rank, world_size: data parallelism, see :func:`~dgpipe.data.loading.make_dataloader`.
        sample_ids: also yield the images' dataset indices (int64 ``(B,)``), see there.

    The training order and the augmentation of every batch are functions of ``seed``, the
    epoch (``loader.batch_sampler.set_epoch(epoch)``), ``rank`` and the batch index only
    (see :mod:`dgpipe.data.loading`), not of the model's initialisation or of the worker
    processes. ``loader.dataset.classes`` holds the class names.

    Raises:
        FileNotFoundError / ValueError: as ``load_cifar``; ``batch_size < 1``.
    """
    train = split == "train"
    dataset = ImageArrayDataset(*load_cifar(name, data_dir, split, subset, seed, cache_dir, download))
    mean, std = CIFAR_STATS[cifar_key(name)]
    transform = ImageTransform(train if augment is None else augment, image_size, mean, std)
    return make_dataloader(dataset, batch_size, shuffle=train, seed=seed, drop_last=drop_last, num_workers=num_workers,
                           collate_fn=AugmentCollate(transform), rank=rank, world_size=world_size,
                           batch_seeds=transform.train, sample_ids=sample_ids)
