"""Image-folder datasets: ``root/<split>/<class>/*.{png,jpg,jpeg}``.

This is how ``shared/data/cifar10-images`` holds the real CIFAR-10 (32x32 JPGs) and how
Food-101-style datasets come. Only the chosen files are decoded (a subset never decodes
the whole folder), in parallel threads with Pillow, into one ``uint8`` array
``(N, H, W, 3)``; that array can be cached on disk as ``.npy`` so later runs skip decoding.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .subset import choose_subset

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def is_image_folder(root: str | os.PathLike) -> bool:
    """True when ``root/train`` holds at least one class folder (the layout this module reads)."""
    train = Path(root) / "train"
    return train.is_dir() and any(p.is_dir() for p in train.iterdir())


def image_folder_classes(root: str | os.PathLike) -> list[str]:
    """Class names of an image folder: the sorted sub-folder names of ``root/train``."""
    return sorted(p.name for p in (Path(root) / "train").iterdir() if p.is_dir())


def list_image_folder(root: str | os.PathLike, split: str) -> tuple[list[Path], np.ndarray, list[str]]:
    """List the images of one split without decoding any.

    Returns:
        ``(paths, labels, classes)``: image paths sorted by (class, file name), int64 labels
        (index into ``classes``), and the class names (sorted folder names of ``root/train``).

    Raises:
        FileNotFoundError: ``root/split`` is missing or holds no image.
        ValueError: the split's class folders differ from ``root/train``'s.
    """
    root = Path(root)
    split_dir = root / split
    if not split_dir.is_dir():
        raise FileNotFoundError(f"image folder split not found: {split_dir} (expected {root}/{split}/<class>/*.jpg)")
    classes = image_folder_classes(root)
    found = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
    if found != classes:
        raise ValueError(
            f"class folders of {split_dir} ({len(found)}) differ from those of {root / 'train'} ({len(classes)}): "
            f"only in {split}: {sorted(set(found) - set(classes))}, missing: {sorted(set(classes) - set(found))}"
        )
    paths, labels = [], []
    for label, name in enumerate(classes):
        with os.scandir(split_dir / name) as entries:
            files = sorted(e.name for e in entries if e.is_file() and e.name.lower().endswith(IMAGE_SUFFIXES))
        paths.extend(split_dir / name / f for f in files)
        labels.extend([label] * len(files))
    if not paths:
        raise FileNotFoundError(f"no {'/'.join(IMAGE_SUFFIXES)} image under {split_dir}/<class>/")
    return paths, np.asarray(labels, dtype=np.int64), classes


def decode_images(paths: list[Path], size: int | None = None, threads: int | None = None) -> np.ndarray:
    """Decode image files into one RGB array.

    Args:
        paths: image files (any format Pillow reads; converted to RGB).
        size: when given, every image is resized to ``size x size`` (Pillow bilinear) while
            decoding; when ``None`` all images must already share one size.
        threads: decoding threads (Pillow releases the GIL while decoding); default
            ``min(8, cpu_count)``.

    Returns:
        uint8 array ``(N, H, W, 3)``.

    Raises:
        ValueError: images differ in size and ``size`` is None (names the first odd file).
    """
    from PIL import Image

    def load(path: Path) -> np.ndarray:
        with Image.open(path) as img:
            img = img.convert("RGB")
            if size is not None and img.size != (size, size):
                img = img.resize((size, size), Image.Resampling.BILINEAR)
            return np.asarray(img, dtype=np.uint8)

    threads = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        arrays = list(pool.map(load, paths))
    if not arrays:
        return np.zeros((0, size or 0, size or 0, 3), dtype=np.uint8)
    shape = arrays[0].shape
    for path, arr in zip(paths, arrays):
        if arr.shape != shape:
            raise ValueError(
                f"{path} is {arr.shape[1]}x{arr.shape[0]} but {paths[0]} is {shape[1]}x{shape[0]}; "
                "pass a decode size (e.g. decode_size=64) to resize every image while decoding"
            )
    return np.stack(arrays)


def _cache_key(paths: list[Path], size: int | None) -> str:
    digest = hashlib.sha1(f"size={size}\n".encode())
    for path in paths:
        st = path.stat()
        digest.update(f"{path.resolve()}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def load_image_folder(
    root: str | os.PathLike,
    split: str,
    subset: int | None = None,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    decode_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Read one split of an image folder, decoding only the chosen subset.

    Args:
        root: folder holding ``train/<class>/*`` and ``test/<class>/*``.
        split: ``"train"`` or ``"test"`` (any sub-folder name works).
        subset: keep only this many images, chosen class-stratified with ``seed``
            (:func:`~dgpipe.data.subset.choose_subset`); ``None`` keeps all.
        seed: seed of the subset choice.
        cache_dir: when given, the decoded array is stored there as
            ``imagefolder-<key>.npy``, the key hashing the chosen
            files' paths, sizes, modification times and ``decode_size``; a later call with
            the same key loads it instead of decoding (``np.load``, no pickle).
        decode_size: resize every image to this square size while decoding (needed when
            image sizes differ).

    Returns:
        ``(images uint8 (N, H, W, 3), labels int64 (N,), classes list[str])``.

    Raises:
        FileNotFoundError / ValueError: see :func:`list_image_folder`, :func:`decode_images`
        and :func:`choose_subset`.
    """
    paths, labels, classes = list_image_folder(root, split)
    keep = choose_subset(labels, subset, seed)
    paths = [paths[i] for i in keep]
    labels = labels[keep]
    if cache_dir is None:
        return decode_images(paths, decode_size), labels, classes
    cache_dir = Path(cache_dir)
    cache = cache_dir / f"imagefolder-{_cache_key(paths, decode_size)}.npy"
    if cache.is_file():
        images = np.load(cache, allow_pickle=False)
        if images.dtype == np.uint8 and len(images) == len(paths):
            return images, labels, classes
    images = decode_images(paths, decode_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, images, allow_pickle=False)
    os.replace(tmp, cache)  # atomic: concurrent ranks never read a half-written cache
    return images, labels, classes
