"""Image classification batches for training: a Dataset over a decoded uint8 array and
a DataLoader that augments whole batches inside its worker processes."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from .cifar import cifar_key, load_cifar
from .loading import make_dataloader
from .transforms import CIFAR_STATS, ImageTransform


class ImageArrayDataset(Dataset):
    """Images decoded once into memory.

    Args:
        images: uint8 ``(N, H, W, 3)`` (e.g. from :func:`~dgpipe.data.cifar.load_cifar`).
        labels: int64 ``(N,)``.
        classes: class names, ``labels`` index into them.

    Items are ``(uint8 tensor (H, W, 3), int64 label)``; the loader's collate function turns
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

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class AugmentCollate:
    """Collate function: stack uint8 images and labels, then apply ``transform`` to the batch.

    Returns ``(float32 (B, 3, S, S), int64 (B,))``. Picklable, so it runs in the workers.
    Randomness: inside a DataLoader worker, torch's global generator (which the loader
    seeds differently per worker from its own generator); in the main process
    (``num_workers=0``), a generator of its own seeded with ``seed``. Either way the
    augmentation is reproducible.
    """

    def __init__(self, transform: ImageTransform, seed: int = 0) -> None:
        self.transform = transform
        self.seed = seed
        self._generator: torch.Generator | None = None

    def __call__(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.stack([image for image, _ in items])
        labels = torch.stack([label for _, label in items])
        generator = None
        if get_worker_info() is None:
            if self._generator is None:
                self._generator = torch.Generator().manual_seed(self.seed)
            generator = self._generator
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
    download: bool = True,
    drop_last: bool | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> DataLoader:
    """A DataLoader over one CIFAR split, yielding ``(images float32 (B, 3, S, S), labels int64 (B,))``.

    Args:
        name: ``"cifar10"`` or ``"cifar100"``; data found as in :func:`~dgpipe.data.cifar.load_cifar`.
        data_dir, split, subset, seed, cache_dir, download: passed to ``load_cifar``.
        batch_size: images per batch (per rank when ``world_size > 1``).
        image_size: output side ``S`` (bilinear resize; 32 native, 224 as in the original runs).
        augment: random crop (padding 4) and flip; default on for ``"train"``.
        num_workers: DataLoader worker processes (0: in the calling process).
        drop_last: drop a last incomplete batch; default on for ``"train"`` (a pipeline
            needs batches divisible by its micro-batch count).
        rank, world_size: data parallelism, see :func:`~dgpipe.data.loading.make_dataloader`.

    The training order is shuffled by a generator seeded with ``seed`` (so it does not depend
    on the model's initialisation), and each worker's augmentation RNG derives from it.
    ``loader.dataset.classes`` holds the class names.

    Raises:
        FileNotFoundError / ValueError: as ``load_cifar``; ``batch_size < 1``.
    """
    train = split == "train"
    dataset = ImageArrayDataset(*load_cifar(name, data_dir, split, subset, seed, cache_dir, download))
    mean, std = CIFAR_STATS[cifar_key(name)]
    transform = ImageTransform(train if augment is None else augment, image_size, mean, std)
    return make_dataloader(
        dataset,
        batch_size,
        shuffle=train,
        seed=seed,
        drop_last=train if drop_last is None else drop_last,
        num_workers=num_workers,
        collate_fn=AugmentCollate(transform, seed),
        rank=rank,
        world_size=world_size,
    )
