"""CIFAR-10 / CIFAR-100 from local files in any of their public layouts.

Layouts (found automatically by :func:`find_cifar`, in this order):

1. the official python tarball ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``
   (``data_dir`` itself or inside ``data_dir``), read without extracting;
2. its extracted folder ``cifar-10-batches-py`` / ``cifar-100-python`` (or ``data_dir``
   itself holding the batch files);
3. an image folder ``train/<class>/*.{png,jpg}`` + ``test/<class>/*`` (``data_dir``
   itself, or ``data_dir/cifar10-images`` / ``data_dir/cifar100-images``), read by
   :mod:`dgpipe.data.imagefolder`.

When none is there and ``download=True``, the official tarball is downloaded from
https://www.cs.toronto.edu/~kriz/cifar.html into ``data_dir`` (tqdm progress bar); when
that fails (no internet) a :class:`FileNotFoundError` lists every path tried and how to
get the data.

Security: the official batches are Python pickles. They are only unpickled from local
files whose md5 matched the official sum (or the sum the caller passes), never from
anything received over a network connection of this program, and through an unpickler
that only admits the few globals a CIFAR batch needs (numpy array reconstruction).
Reference: A. Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", 2009.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import tarfile
import urllib.request
from pathlib import Path

import numpy as np

from .imagefolder import image_folder_classes, is_image_folder, load_image_folder
from .subset import choose_subset

BASE_URL = "https://www.cs.toronto.edu/~kriz/"


@dataclasses.dataclass(frozen=True)
class CifarSpec:
    """Where and how one CIFAR variant is stored (official names and md5 sums)."""

    title: str
    num_classes: int
    archive: str  # the official python tarball, downloaded from ``url``
    archive_md5: str
    folder: str  # the tarball's top folder
    splits: dict  # split -> batch file names
    meta: str  # meta file name
    names_key: bytes  # class names in the meta file
    labels_key: bytes  # labels in a batch file
    md5: dict  # batch or meta file name -> official md5
    images_folder: str  # name of an image-folder copy (``shared/data/cifar10-images``)
    url: str = ""  # default: BASE_URL + archive

    def __post_init__(self) -> None:
        if not self.url:
            object.__setattr__(self, "url", BASE_URL + self.archive)


CIFAR = {
    "cifar10": CifarSpec(
        "CIFAR-10", 10, "cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a", "cifar-10-batches-py",
        splits={"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]},
        meta="batches.meta", names_key=b"label_names", labels_key=b"labels",
        md5={
            "data_batch_1": "c99cafc152244af753f735de768cd75f",
            "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
            "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
            "data_batch_4": "634d18415352ddfa80567beed471001a",
            "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
            "test_batch": "40351d587109b95175f43aff81a1287e",
            "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
        },
        images_folder="cifar10-images",
    ),
    "cifar100": CifarSpec(
        "CIFAR-100", 100, "cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85", "cifar-100-python",
        splits={"train": ["train"], "test": ["test"]},
        meta="meta", names_key=b"fine_label_names", labels_key=b"fine_labels",
        md5={
            "train": "16019d7e3df5f24257cddd939b257f8d",
            "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
            "meta": "7973b15100ade9c7d40fb424638fde48",
        },
        images_folder="cifar100-images",
    ),
}


def cifar_key(name: str) -> str:
    """Canonical name (``"cifar10"`` / ``"cifar100"``) of ``name`` ("CIFAR-10" ...); ValueError otherwise."""
    key = name.lower().replace("-", "")
    if key not in CIFAR:
        raise ValueError(f"unknown CIFAR dataset {name!r}; use one of {sorted(CIFAR)}")
    return key


def cifar_spec(name: str) -> CifarSpec:
    """The :class:`CifarSpec` of ``"cifar10"`` or ``"cifar100"``; ValueError otherwise."""
    return CIFAR[cifar_key(name)]


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")


def md5_of(data_or_path: bytes | str | os.PathLike) -> str:
    """Hex md5 of a bytes object or of a file (read in 1 MiB chunks)."""
    digest = hashlib.md5()
    if isinstance(data_or_path, bytes):
        digest.update(data_or_path)
    else:
        with open(data_or_path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _verify(actual: str, expected: str, where: str) -> None:
    if actual != expected:
        raise ValueError(
            f"md5 mismatch for {where}: got {actual}, expected {expected} (official sum). "
            "The file is damaged or not the official CIFAR release: delete it and download it again "
            "from https://www.cs.toronto.edu/~kriz/cifar.html"
        )


class _CifarUnpickler(pickle.Unpickler):
    """Unpickler admitting only what an official CIFAR batch holds: dicts, lists, bytes,
    ints and numpy arrays."""

    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"CIFAR batch refers to {module}.{name}, which a CIFAR batch never needs")
        if module == "numpy.core.multiarray":
            module = "numpy._core.multiarray"  # numpy >= 2 name; avoids the deprecation shim
        return super().find_class(module, name)


def _unpickle(data: bytes) -> dict:
    # Only called on bytes whose md5 was verified against the expected sum (see module doc).
    return _CifarUnpickler(io.BytesIO(data), encoding="bytes").load()


def _to_arrays(spec: CifarSpec, batches: list[dict], meta: dict) -> tuple[np.ndarray, np.ndarray, list[str]]:
    images = np.concatenate([np.asarray(b[b"data"], dtype=np.uint8) for b in batches])
    # Each row is 3072 bytes: the red, green and blue 32x32 planes, row-major.
    images = np.ascontiguousarray(images.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    labels = np.concatenate([np.asarray(b[spec.labels_key], dtype=np.int64) for b in batches])
    classes = [n.decode() if isinstance(n, bytes) else str(n) for n in meta[spec.names_key]]
    return images, labels, classes


def read_cifar_archive(
    path: str | os.PathLike, name: str, split: str, md5: str | None = None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Read one split from the official python tarball, without extracting it to disk.

    Args:
        path: the ``.tar.gz`` file.
        name: ``"cifar10"`` or ``"cifar100"``.
        split: ``"train"`` or ``"test"``.
        md5: expected md5 of the tarball; default the official sum.

    Returns:
        ``(images uint8 (N, 32, 32, 3), labels int64 (N,), classes list[str])``.

    Raises:
        ValueError: md5 mismatch (names the path), or a batch file missing from the tarball.
    """
    spec = cifar_spec(name)
    _check_split(split)
    _verify(md5_of(path), md5 or spec.archive_md5, str(path))
    with tarfile.open(path, "r:gz") as tar:

        def member(file: str) -> dict:
            try:
                handle = tar.extractfile(f"{spec.folder}/{file}")
            except KeyError:
                handle = None
            if handle is None:
                raise ValueError(f"{path} has no regular file {spec.folder}/{file}")
            return _unpickle(handle.read())

        batches = [member(f) for f in spec.splits[split]]
        meta = member(spec.meta)
    return _to_arrays(spec, batches, meta)


def read_cifar_folder(
    folder: str | os.PathLike, name: str, split: str, md5: dict | None = None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Read one split from the extracted tarball folder (``cifar-10-batches-py`` ...).

    Args:
        folder: the folder holding the batch files and the meta file.
        name, split: as in :func:`read_cifar_archive`.
        md5: expected md5 per file name; default the official sums.

    Returns:
        ``(images uint8 (N, 32, 32, 3), labels int64 (N,), classes list[str])``.

    Raises:
        FileNotFoundError: a batch file is missing. ValueError: md5 mismatch (names the file).
    """
    spec = cifar_spec(name)
    _check_split(split)
    sums = md5 or spec.md5

    def read(file: str) -> dict:
        path = Path(folder) / file
        if not path.is_file():
            raise FileNotFoundError(f"missing CIFAR file {path}")
        data = path.read_bytes()
        _verify(md5_of(data), sums[file], str(path))
        return _unpickle(data)

    return _to_arrays(spec, [read(f) for f in spec.splits[split]], read(spec.meta))


def _candidates(spec: CifarSpec, data_dir: Path) -> list[tuple[str, Path, str]]:
    """(kind, path, description) of every place a layout may be, in order of preference."""
    return [
        ("archive", data_dir, "the official python tarball itself"),
        ("archive", data_dir / spec.archive, "official python tarball"),
        ("folder", data_dir / spec.folder, "extracted tarball folder"),
        ("folder", data_dir, "extracted tarball folder"),
        ("images", data_dir, "image folder train/<class>/*.png|jpg"),
        ("images", data_dir / spec.images_folder, "image folder train/<class>/*.png|jpg"),
    ]


def _present(kind: str, path: Path, spec: CifarSpec) -> bool:
    if kind == "archive":
        return path.is_file() and path.name.endswith((".tar.gz", ".tgz"))
    if kind == "folder":
        return (path / spec.meta).is_file()
    return is_image_folder(path)


def find_cifar(name: str, data_dir: str | os.PathLike) -> tuple[str, Path]:
    """Which layout ``data_dir`` holds, without reading or downloading anything.

    Returns:
        ``(kind, path)`` with kind ``"archive"``, ``"folder"`` or ``"images"``.

    Raises:
        FileNotFoundError: nothing found; the message lists every path tried and how to get
        the data (a CLI calls this before starting any process).
    """
    spec = cifar_spec(name)
    data_dir = Path(data_dir)
    for kind, path, _ in _candidates(spec, data_dir):
        if _present(kind, path, spec):
            return kind, path
    raise FileNotFoundError(_missing_message(spec, data_dir))


def _missing_message(spec: CifarSpec, data_dir: Path, reason: str = "") -> str:
    tried = "\n".join(
        f"  - {path}{'/' if kind != 'archive' else ''} ({what})"
        for kind, path, what in _candidates(spec, data_dir)[1:]
    )
    return (
        f"{spec.title} not found{reason}. Tried:\n{tried}\n"
        f"Get the data: download {spec.url} (md5 {spec.archive_md5}) into {data_dir}, "
        "or point --data-dir at an image folder with train/<class>/*.jpg and test/<class>/*.jpg "
        "(e.g. ../shared/data/cifar10-images)."
    )


def download_cifar(name: str, data_dir: str | os.PathLike, timeout: float = 30.0) -> Path:
    """Download the official tarball into ``data_dir`` (tqdm progress bar) and check its md5.

    Returns:
        path of the downloaded tarball.

    Raises:
        OSError (urllib.error.URLError ...): no connection. ValueError: md5 mismatch.
    """
    from tqdm.auto import tqdm

    spec = cifar_spec(name)
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    target = data_dir / spec.archive
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(spec.url, timeout=timeout) as response, open(part, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"download {spec.archive}") as bar:
                for chunk in iter(lambda: response.read(1 << 20), b""):
                    out.write(chunk)
                    bar.update(len(chunk))
        _verify(md5_of(part), spec.archive_md5, f"{spec.url} (downloaded to {part})")
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target


def load_cifar(
    name: str,
    data_dir: str | os.PathLike,
    split: str,
    subset: int | None = None,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    download: bool = False,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Load one CIFAR split from whichever layout ``data_dir`` holds (see module doc).

    Args:
        name: ``"cifar10"`` or ``"cifar100"``.
        data_dir: a folder (or the tarball itself); see :func:`find_cifar`.
        split: ``"train"`` (50,000 images) or ``"test"`` (10,000).
        subset: keep this many images, class-stratified and fixed by ``seed``; an image
            folder then decodes only those files.
        seed: seed of the subset choice.
        cache_dir: image folders only: where the decoded uint8 array is cached as ``.npy``.
        download: when nothing is found, download the official tarball into ``data_dir``.

    Returns:
        ``(images uint8 (N, 32, 32, 3), labels int64 (N,), classes list[str])``.

    Raises:
        FileNotFoundError: no data and no download possible (lists the paths tried).
        ValueError: md5 mismatch, bad split/subset, an image folder with the wrong number
        of classes.
    """
    spec = cifar_spec(name)
    _check_split(split)
    try:
        kind, path = find_cifar(name, data_dir)
    except FileNotFoundError:
        if not download:
            raise
        try:
            kind, path = "archive", download_cifar(name, data_dir)
        except OSError as err:
            reason = f" and the download failed ({err})"
            raise FileNotFoundError(_missing_message(spec, Path(data_dir), reason)) from err
    if kind == "images":
        found = len(image_folder_classes(path))
        if found != spec.num_classes:
            raise ValueError(f"{path}/train has {found} class folders but {spec.title} has {spec.num_classes}")
        return load_image_folder(path, split, subset, seed, cache_dir)
    reader = read_cifar_archive if kind == "archive" else read_cifar_folder
    images, labels, classes = reader(path, name, split)
    keep = choose_subset(labels, subset, seed)
    if subset is not None:
        images, labels = images[keep], labels[keep]
    return images, labels, classes
