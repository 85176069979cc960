"""The vision main job: MobileNetV2 (transformers) on CIFAR-10/100.

Data from :mod:`dgpipe.data` (official python tarball, its folder, or an image folder
such as ``shared/data/cifar10-images``); model from :mod:`dgpipe.models.mobilenet`;
SGD with momentum and a cosine learning-rate schedule after a linear warm-up
(``transformers.get_cosine_schedule_with_warmup``). Flags: see ``test_vision_dgpipe.py``.
"""

from __future__ import annotations

import argparse
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from dgpipe.data import download_cifar, find_cifar, make_loader
from dgpipe.data.cifar import cifar_spec
from dgpipe.data.imagefolder import list_image_folder
from dgpipe.models import build_mobilenet, mobilenet_layers

from .job import Job, check_partition, decay_groups, metric_key
from .metrics import TASK_METRICS, compute_metrics

__all__ = ["VisionJob", "DEFAULT_DROPOUT", "OFFICIAL_SIZES"]

#: Classifier dropout of a randomly initialised model unless ``--dropout`` says otherwise.
DEFAULT_DROPOUT = 0.2
#: Images per split of the official CIFAR-10 and CIFAR-100 batches.
OFFICIAL_SIZES = {"train": 50_000, "test": 10_000}


class VisionJob(Job):
    """MobileNetV2 on CIFAR; see :class:`~dgpipe.train.job.Job` for the interface."""

    pinned = (0, 0)

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.num_classes = cifar_spec(args.dataset).num_classes
        self.metric_names = tuple(metric_key(m) for m in TASK_METRICS[args.dataset])
        self.metric = self.metric_names[0]

    @classmethod
    def check(cls, args: argparse.Namespace) -> None:
        """Check image size, data (with ``--download``: downloading the official tarball when it is
        missing) and the partition against the model's layers.

        Raises:
            ValueError: bad ``--image-size``/``--width-mult``, no data (lists the paths
                tried), or a partition that does not fit the model.
        """
        if args.image_size < 8:
            raise ValueError(f"--image-size {args.image_size} is too small; use 32 (native) or more, e.g. 224")
        if args.width_mult <= 0:
            raise ValueError(f"--width-mult must be positive, got {args.width_mult}")
        if args.pretrained is not None and (args.width_mult != 1.0 or args.dropout is not None):
            raise ValueError("--width-mult and --dropout change a randomly initialised model; drop them with --pretrained")
        if args.dropout is not None and not 0 <= args.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
        if args.momentum < 0 or args.wd < 0 or args.warmup_epochs < 0:
            raise ValueError("--momentum, --wd and --warmup-epochs must be >= 0")
        try:
            kind, path = find_cifar(args.dataset, args.data_dir)
        except FileNotFoundError as missing:
            if not args.download:
                raise ValueError(f"{missing} Or add --download to fetch the official tarball into "
                                 f"{args.data_dir}.") from None
            try:
                kind, path = "archive", download_cifar(args.dataset, args.data_dir)
            except OSError as err:
                raise ValueError(f"{missing}\n(download failed: {err})") from None
        for flag, subset, split in (("--train-subset", args.train_subset, "train"),
                                    ("--eval-subset", args.eval_subset, "test")):
            size = len(list_image_folder(path, split)[0]) if kind == "images" else OFFICIAL_SIZES[split]
            if subset is not None and subset > size:
                raise ValueError(f"{flag} {subset} is more than the {size} {split} images in {path}")
        n_layers = len(mobilenet_layers(build_mobilenet(cifar_spec(args.dataset).num_classes,
                                                        depth_multiplier=args.width_mult)))
        check_partition(n_layers, args, cls.pinned)

    def build_layers(self) -> list[nn.Module]:
        a = self.args
        if a.pretrained is not None:
            model = build_mobilenet(self.num_classes, pretrained=a.pretrained)
        else:
            model = build_mobilenet(self.num_classes, depth_multiplier=a.width_mult, image_size=a.image_size,
                                    classifier_dropout_prob=DEFAULT_DROPOUT if a.dropout is None else a.dropout)
        return mobilenet_layers(model)

    def loaders(self, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
        a = self.args
        common = dict(image_size=a.image_size, seed=a.seed, num_workers=a.num_workers, cache_dir=a.cache_dir,
                      download=False)
        train = make_loader(a.dataset, a.data_dir, "train", a.batch_size // world_size, subset=a.train_subset,
                            rank=rank, world_size=world_size, sample_ids=a.delta, **common)
        evaluation = make_loader(a.dataset, a.data_dir, "test", a.batch_size, subset=a.eval_subset, **common)
        return train, evaluation

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        values = compute_metrics(self.args.dataset, outputs, targets)
        return {metric_key(k): v for k, v in values.items()}

    def optimizer(self, params: Iterable[nn.Parameter], total_steps: int, steps_per_epoch: int,
                  momentum_in_codec: bool = False):
        from transformers import get_cosine_schedule_with_warmup

        a = self.args
        opt = torch.optim.SGD(decay_groups(params, a.wd), lr=a.lr, momentum=0.0 if momentum_in_codec else a.momentum)
        warmup = min(round(a.warmup_epochs * steps_per_epoch), total_steps)
        return opt, get_cosine_schedule_with_warmup(opt, warmup, total_steps)
