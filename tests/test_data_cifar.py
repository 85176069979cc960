"""CIFAR readers (official tarball/folder, image folder), transforms and the image loader."""

import dataclasses
import functools
import hashlib
import http.server
import io
import pickle
import tarfile
import threading
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from dgpipe.data import cifar as cifar_mod
from dgpipe.data import imagefolder
from dgpipe.data.cifar import find_cifar, load_cifar, read_cifar_archive, read_cifar_folder
from dgpipe.data.imagefolder import load_image_folder
from dgpipe.data.subset import choose_subset
from dgpipe.data.transforms import CIFAR_STATS, ImageTransform, normalize, random_crop, random_hflip, resize
from dgpipe.data.loading import batch_seed
from dgpipe.data.vision import make_loader

REAL_IMAGES = Path("/work/shared/data/cifar10-images")
NAMES10 = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _batch(images: np.ndarray, labels: list[int], key: bytes) -> bytes:
    """A batch in the official layout: rows of 3072 bytes = R, G, B planes, row-major."""
    rows = np.stack([np.concatenate([img[:, :, c].reshape(-1) for c in range(3)]) for img in images])
    # protocol 2, bytes keys and numpy's pre-2.0 module path, like the original Python 2 cPickle files
    data = pickle.dumps({b"batch_label": b"test batch", key: labels, b"data": rows}, protocol=2)
    return data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


@dataclasses.dataclass
class TinyCifar:
    files: dict  # member name -> bytes
    images: dict  # split -> uint8 (N, 32, 32, 3)
    labels: dict  # split -> int64 (N,)


@functools.lru_cache(maxsize=None)
def _tiny_cifar10() -> TinyCifar:
    rng = np.random.default_rng(0)
    files, images, labels = {}, {"train": [], "test": []}, {"train": [], "test": []}
    spec = cifar_mod.CIFAR["cifar10"]
    for split, names in spec.splits.items():
        for name in names:
            imgs = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
            labs = [int(x) for x in rng.integers(0, 10, 4)]
            files[name] = _batch(imgs, labs, b"labels")
            images[split].append(imgs)
            labels[split] += labs
    files["batches.meta"] = pickle.dumps({b"label_names": [n.encode() for n in NAMES10], b"num_vis": 3072}, protocol=2)
    return TinyCifar(
        files,
        {k: np.concatenate(v) for k, v in images.items()},
        {k: np.asarray(v, dtype=np.int64) for k, v in labels.items()},
    )


def _write_tarball(path: Path, folder: str, files: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


@pytest.fixture
def tarball(tmp_path):
    tiny = _tiny_cifar10()
    path = tmp_path / "cifar-10-python.tar.gz"
    data = _write_tarball(path, "cifar-10-batches-py", tiny.files)
    return path, _md5(data), tiny


def test_archive_reads_official_layout(tarball):
    path, md5, tiny = tarball
    for split, n in (("train", 20), ("test", 4)):
        images, labels, classes = read_cifar_archive(path, "cifar10", split, md5=md5)
        assert images.dtype == np.uint8 and images.shape == (n, 32, 32, 3)
        assert labels.dtype == np.int64 and np.array_equal(labels, tiny.labels[split])
        assert np.array_equal(images, tiny.images[split])
        assert classes == NAMES10
    # pixel (row 5, col 7, green) of image 2 is byte 1024 + 5 * 32 + 7 of its row in the batch
    row = pickle.loads(tiny.files["data_batch_1"], encoding="bytes")[b"data"][2]
    images, _, _ = read_cifar_archive(path, "cifar10", "train", md5=md5)
    assert images[2, 5, 7, 1] == row[1024 + 5 * 32 + 7]


def test_archive_md5_mismatch_names_path(tarball):
    path, _, _ = tarball
    with pytest.raises(ValueError, match=r"md5 mismatch for .*cifar-10-python\.tar\.gz"):
        read_cifar_archive(path, "cifar10", "train")  # official sum: the tiny tarball is not it
    with pytest.raises(ValueError, match="md5 mismatch"):
        load_cifar("cifar10", path.parent, "test", download=False)


def test_extracted_folder_and_per_file_md5(tmp_path):
    tiny = _tiny_cifar10()
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name, data in tiny.files.items():
        (folder / name).write_bytes(data)
    sums = {name: _md5(data) for name, data in tiny.files.items()}
    images, labels, classes = read_cifar_folder(folder, "cifar10", "train", md5=sums)
    assert np.array_equal(images, tiny.images["train"]) and np.array_equal(labels, tiny.labels["train"])
    corrupt = bytearray(tiny.files["data_batch_3"])
    corrupt[-5] ^= 1
    (folder / "data_batch_3").write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match=r"md5 mismatch for .*data_batch_3"):
        read_cifar_folder(folder, "cifar10", "train", md5=sums)
    assert find_cifar("cifar10", tmp_path) == ("folder", folder)


def test_unpickler_refuses_foreign_globals(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    tiny = _tiny_cifar10()
    files = dict(tiny.files, test_batch=pickle.dumps({b"data": Evil()}, protocol=2))
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    sums = {name: _md5(data) for name, data in files.items()}
    with pytest.raises(pickle.UnpicklingError, match=r"\.print, which"):
        read_cifar_folder(tmp_path, "cifar10", "test", md5=sums)


def test_cifar100_folder(tmp_path):
    rng = np.random.default_rng(1)
    imgs = rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    files = {
        "train": _batch(imgs, [5, 99, 0, 5, 7, 1], b"fine_labels"),
        "test": _batch(imgs[:2], [3, 4], b"fine_labels"),
        "meta": pickle.dumps({b"fine_label_names": [f"c{i}".encode() for i in range(100)]}, protocol=2),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    images, labels, classes = read_cifar_folder(tmp_path, "cifar-100", "train", {k: _md5(v) for k, v in files.items()})
    assert np.array_equal(images, imgs) and labels.tolist() == [5, 99, 0, 5, 7, 1] and len(classes) == 100


def _patch_spec(monkeypatch, **changes):
    spec = dataclasses.replace(cifar_mod.CIFAR["cifar10"], **changes)
    monkeypatch.setitem(cifar_mod.CIFAR, "cifar10", spec)
    return spec


def test_load_cifar_detects_tarball_and_subsets(tarball, monkeypatch):
    path, md5, tiny = tarball
    _patch_spec(monkeypatch, archive_md5=md5)
    assert find_cifar("cifar10", path.parent) == ("archive", path)
    images, labels, _ = load_cifar("cifar10", path.parent, "train", subset=8, seed=3)
    keep = choose_subset(tiny.labels["train"], 8, seed=3)
    assert np.array_equal(images, tiny.images["train"][keep]) and np.array_equal(labels, tiny.labels["train"][keep])
    assert load_cifar("cifar10", path, "train", subset=8, seed=3)[0].shape == (8, 32, 32, 3)  # the file itself


def test_choose_subset_stratified_and_fixed():
    labels = np.repeat(np.arange(4), [10, 20, 30, 40])
    a = choose_subset(labels, 10, seed=7)
    assert np.array_equal(a, choose_subset(labels, 10, seed=7))
    assert np.bincount(labels[a], minlength=4).tolist() == [1, 2, 3, 4]
    assert len(set(a.tolist())) == 10 and not np.array_equal(a, choose_subset(labels, 10, seed=8))
    assert np.bincount(labels[choose_subset(labels, 7, seed=0)], minlength=4).sum() == 7
    with pytest.raises(ValueError, match="1..100"):
        choose_subset(labels, 101)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_download_then_read(tarball, tmp_path, monkeypatch):
    path, md5, tiny = tarball
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(path.parent))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _patch_spec(monkeypatch, archive_md5=md5, url=f"http://127.0.0.1:{server.server_port}/{path.name}")
        target = tmp_path / "fresh"
        images, labels, _ = load_cifar("cifar10", target, "test", download=True)
    finally:
        server.shutdown()
        server.server_close()
    assert (target / path.name).read_bytes() == path.read_bytes()
    assert np.array_equal(images, tiny.images["test"]) and np.array_equal(labels, tiny.labels["test"])


def test_offline_message_lists_paths(tmp_path, monkeypatch):
    _patch_spec(monkeypatch, url="http://127.0.0.1:1/cifar-10-python.tar.gz")  # nothing listens on port 1
    with pytest.raises(FileNotFoundError) as err:
        load_cifar("cifar10", tmp_path, "train", download=True)
    msg = str(err.value)
    assert "download failed" in msg and str(tmp_path / "cifar-10-python.tar.gz") in msg
    assert str(tmp_path / "cifar-10-batches-py") in msg and "cifar10-images" in msg and "image folder" in msg
    with pytest.raises(FileNotFoundError, match="Tried"):
        find_cifar("cifar10", tmp_path)
    assert not list(tmp_path.iterdir())  # no partial download left behind


def _image_folder(root: Path, classes: list[str], per_class: dict, fmt: str = "png", size: int = 32) -> dict:
    """Write random images; return {path: pixels}."""
    rng = np.random.default_rng(2)
    written = {}
    for split, n in per_class.items():
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                path = root / split / c / f"{i:04d}.{fmt}"
                PIL.Image.fromarray(pixels).save(path)
                written[path] = pixels
    return written


def test_image_folder_decodes_only_subset(tmp_path, monkeypatch):
    written = _image_folder(tmp_path, ["cat", "ant", "bee"], {"train": 4, "test": 2})
    images, labels, classes = load_image_folder(tmp_path, "train")
    assert classes == ["ant", "bee", "cat"] and images.shape == (12, 32, 32, 3)
    assert np.array_equal(images[0], written[tmp_path / "train" / "ant" / "0000.png"])  # PNG is lossless
    assert labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4

    opened = []
    real_open = PIL.Image.open
    monkeypatch.setattr(PIL.Image, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    sub, sub_labels, _ = load_image_folder(tmp_path, "train", subset=6, seed=1)
    assert len(opened) == 6 and np.bincount(sub_labels).tolist() == [2, 2, 2]
    for img, path in zip(sub, opened):
        assert np.array_equal(img, written[Path(path)])


def test_image_folder_cache(tmp_path, monkeypatch):
    _image_folder(tmp_path / "data", ["a", "b"], {"train": 3, "test": 1}, fmt="jpg")
    first = load_image_folder(tmp_path / "data", "train", subset=4, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again despite the cache")

    monkeypatch.setattr(imagefolder, "decode_images", no_decode)
    second = load_image_folder(tmp_path / "data", "train", subset=4, cache_dir=tmp_path / "cache")
    assert np.array_equal(first[0], second[0]) and np.array_equal(first[1], second[1])
    with pytest.raises(AssertionError, match="decoded again"):  # another subset is another key
        load_image_folder(tmp_path / "data", "train", subset=2, cache_dir=tmp_path / "cache")


def test_image_folder_errors(tmp_path):
    _image_folder(tmp_path / "mixed", ["a"], {"train": 1, "test": 1})
    PIL.Image.new("RGB", (40, 20)).save(tmp_path / "mixed" / "train" / "a" / "big.png")
    with pytest.raises(ValueError, match="decode_size"):
        load_image_folder(tmp_path / "mixed", "train")
    assert load_image_folder(tmp_path / "mixed", "train", decode_size=16)[0].shape == (2, 16, 16, 3)
    (tmp_path / "mixed" / "test" / "z").mkdir()
    with pytest.raises(ValueError, match=r"only in test: \['z'\]"):
        load_image_folder(tmp_path / "mixed", "test")
    with pytest.raises(ValueError, match="10"):  # CIFAR-10 needs 10 class folders
        load_cifar("cifar10", tmp_path / "mixed", "train", download=False)


@pytest.mark.skipif(not REAL_IMAGES.is_dir(), reason=f"real CIFAR-10 images not present at {REAL_IMAGES}")
def test_real_cifar10_image_folder_subset():
    images, labels, classes = load_cifar("cifar10", REAL_IMAGES.parent, "train", subset=20, seed=0)
    assert images.shape == (20, 32, 32, 3) and images.dtype == np.uint8
    assert classes == NAMES10 and np.bincount(labels).tolist() == [2] * 10
    assert 20 < images.mean() < 235  # real photos, not blank
    test_images, _, _ = load_cifar("cifar10", REAL_IMAGES, "test", subset=10, seed=0)
    assert test_images.shape == (10, 32, 32, 3)


def test_transform_eval_is_exact_normalisation():
    x = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    mean, std = CIFAR_STATS["cifar10"]
    out = ImageTransform(train=False)(x)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 32, 32)
    for c in range(3):
        expected = (x[..., c].double() / 255 - mean[c]) / std[c]
        torch.testing.assert_close(out[:, c].double(), expected, atol=1e-5, rtol=0)
    single = ImageTransform(train=False, image_size=224)(x[0])
    assert single.shape == (3, 224, 224)
    lo = min((0 - m) / s for m, s in zip(mean, std))
    hi = max((1 - m) / s for m, s in zip(mean, std))
    assert lo - 1e-5 <= single.min() and single.max() <= hi + 1e-5


def test_train_transform_shapes_range_and_seed():
    x = torch.randint(0, 256, (5, 32, 32, 3), dtype=torch.uint8)
    t = ImageTransform(train=True, image_size=64, mean=(0.5,) * 3, std=(0.5,) * 3)
    a = t(x, torch.Generator().manual_seed(0))
    assert a.shape == (5, 3, 64, 64) and a.dtype == torch.float32
    assert a.min() >= -1 - 1e-6 and a.max() <= 1 + 1e-6  # (x/255 - .5)/.5 in [-1, 1], zero padding -> -1
    assert torch.equal(a, t(x, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="uint8"):
        t(x.float())


def test_random_crop_is_a_window_of_the_padded_image():
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).reshape(2, 3, 6, 6) + 1
    out = random_crop(x, padding=2, generator=torch.Generator().manual_seed(1))
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for b in range(2):
        windows = [
            (dy, dx) for dy in range(5) for dx in range(5) if torch.equal(out[b], padded[b, :, dy : dy + 6, dx : dx + 6])
        ]
        assert len(windows) == 1
    crops = {tuple(random_crop(x[:1], 2, torch.Generator().manual_seed(s)).flatten().tolist()) for s in range(30)}
    assert len(crops) > 3  # the offset varies


def test_flip_normalize_resize():
    x = torch.rand(4, 3, 5, 7)
    assert torch.equal(random_hflip(x, p=1.0), x.flip(-1)) and torch.equal(random_hflip(x, p=0.0), x)
    mixed = random_hflip(x, p=0.5, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(m, i) or torch.equal(m, i.flip(-1)) for m, i in zip(mixed, x))
    u = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    torch.testing.assert_close(normalize(u, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), torch.full((1, 3, 2, 2), 2.0))
    const = torch.full((2, 3, 32, 32), 0.3)
    torch.testing.assert_close(resize(const, 224), torch.full((2, 3, 224, 224), 0.3))
    assert resize(x, 5).shape == (4, 3, 5, 5)


def test_make_loader_on_image_folder(tmp_path):
    _image_folder(tmp_path, NAMES10, {"train": 2, "test": 1})
    train = make_loader("cifar10", tmp_path, "train", batch_size=8, image_size=40, num_workers=0, seed=1)
    batches = list(train)
    assert len(batches) == 2  # 20 images, last partial batch dropped
    images, labels = batches[0]
    assert images.shape == (8, 3, 40, 40) and images.dtype == torch.float32 and labels.dtype == torch.int64
    again = list(make_loader("cifar10", tmp_path, "train", batch_size=8, image_size=40, num_workers=0, seed=1))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    test = make_loader("cifar10", tmp_path, "test", batch_size=4, num_workers=1)
    got = [lab for _, lab in test]
    assert [len(g) for g in got] == [4, 4, 2] and torch.cat(got).tolist() == list(range(10))  # in order, kept
    shard = make_loader("cifar10", tmp_path, "train", batch_size=5, num_workers=0, rank=1, world_size=2)
    assert sum(len(lab) for _, lab in shard) == 10


def test_training_batches_depend_only_on_seed_and_epoch(tmp_path):
    """An epoch's order and augmentation are the same whether earlier epochs ran in this
    loader (its worker process kept alive) or not, with or without workers -- what a
    resumed run needs -- and are the documented function of (seed, epoch, batch index)."""
    _image_folder(tmp_path, NAMES10, {"train": 2, "test": 1})

    def epoch(loader, e):
        loader.batch_sampler.set_epoch(e)
        return list(loader)

    running = make_loader("cifar10", tmp_path, "train", batch_size=8, seed=3, num_workers=1)
    first, second = epoch(running, 0), epoch(running, 1)
    for workers in (0, 1):
        fresh = epoch(make_loader("cifar10", tmp_path, "train", batch_size=8, seed=3, num_workers=workers), 1)
        assert len(fresh) == len(second) == 2
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(fresh, second))
    assert not torch.equal(first[0][0], second[0][0])
    # Independently: DistributedSampler's permutation seeded with seed + epoch, cut into
    # batches; each batch transformed with a generator seeded with its batch seed.
    dataset = running.dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(3 + 1))
    transform = ImageTransform(True, 32, *CIFAR_STATS["cifar10"])
    for b, (images, labels) in enumerate(second):
        idx = order[8 * b : 8 * (b + 1)]
        assert torch.equal(labels, dataset.labels[idx])
        want = transform(dataset.images[idx], torch.Generator().manual_seed(batch_seed(3, 1, 0, b)))
        assert torch.equal(images, want)
    # a run resumed inside the epoch starts at batch 1: the batch (and its augmentation) is the same
    resumed = make_loader("cifar10", tmp_path, "train", batch_size=8, seed=3, num_workers=1)
    resumed.batch_sampler.set_epoch(1, start=1)
    tail = list(resumed)
    assert len(tail) == 1 and torch.equal(tail[0][0], second[1][0]) and torch.equal(tail[0][1], second[1][1])
