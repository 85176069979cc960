"""Training data: CIFAR-10/100 (python tarball, extracted folder or image folder) and GLUE.

Modules: :mod:`.cifar` (official format, md5, download), :mod:`.imagefolder` (folders of
PNG/JPG), :mod:`.transforms` (augmentation in torch ops), :mod:`.vision` (image
DataLoader), :mod:`.glue` (GLUE TSVs / ``datasets``, tokenising), :mod:`.tokenizer`
(offline tokenizer), :mod:`.text` (text corpora packed into blocks for language models),
:mod:`.subset` (fixed subsets), :mod:`.loading` (DataLoader recipe:
batches and augmentation seeds that depend only on seed, epoch, rank and batch index).
"""

from .cifar import download_cifar, find_cifar, load_cifar, read_cifar_archive, read_cifar_folder
from .glue import GLUE_TASKS, TokenizedDataset, glue_task, load_glue, make_glue_loader, read_glue_tsv, tokenize_glue
from .imagefolder import load_image_folder
from .loading import EpochBatchSampler, batch_seed, make_dataloader
from .subset import choose_subset
from .tokenizer import offline_tokenizer
from .transforms import CIFAR_STATS, ImageTransform
from .vision import ImageArrayDataset, make_loader

__all__ = [
    "CIFAR_STATS",
    "EpochBatchSampler",
    "GLUE_TASKS",
    "ImageArrayDataset",
    "ImageTransform",
    "TokenizedDataset",
    "batch_seed",
    "choose_subset",
    "download_cifar",
    "find_cifar",
    "glue_task",
    "load_cifar",
    "load_glue",
    "load_image_folder",
    "make_dataloader",
    "make_glue_loader",
    "make_loader",
    "offline_tokenizer",
    "read_cifar_archive",
    "read_cifar_folder",
    "read_glue_tsv",
    "tokenize_glue",
]
