"""The vision main job: MobileNetV2 (transformers) on CIFAR-10/100.

Data from :mod:`dgpipe.data` (official python tarball, its folder, or an image folder
such as ``shared/data/cifar10-images``); model from :mod:`dgpipe.models.mobilenet`;
SGD with momentum and a cosine learning-rate schedule after a linear warm-up
(``transformers.get_cosine_schedule_with_warmup``). Flags: see ``test_vision_dgpipe.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from dgpipe.data import download_cifar, find_cifar, make_loader
from dgpipe.data.cifar import cifar_spec
from dgpipe.data.imagefolder import list_image_folder
from dgpipe.models import build_mobilenet, mobilenet_layers

from .config import RunConfig
from .job import Job, check_partition, decay_groups, metric_key
from .metrics import TASK_METRICS, compute_metrics

__all__ = ["VisionJob", "VisionOptions", "DEFAULT_DROPOUT", "OFFICIAL_SIZES"]

#: Classifier dropout of a randomly initialised model unless ``--dropout`` says otherwise.
DEFAULT_DROPOUT = 0.2
#: Images per split of the official CIFAR-10 and CIFAR-100 batches.
OFFICIAL_SIZES = {"train": 50_000, "test": 10_000}


@dataclass(frozen=True)
class VisionOptions:
    """The vision job's own flags (``RunConfig.job``); see ``test_vision_dgpipe.py --help``.

    Attributes:
        dataset: ``"cifar10"`` or ``"cifar100"``.
        download: fetch the official tarball when no data is found.
        image_size: input side, pixels.
        pretrained: a transformers checkpoint, or ``None`` (random initialisation).
        width_mult: MobileNetV2 width multiplier (random init).
        dropout: classifier dropout (random init), or ``None`` (:data:`DEFAULT_DROPOUT`).
        momentum, wd: SGD momentum and weight decay.
        warmup_epochs: linear warm-up before the cosine schedule, epochs.
        deferred_batchnorm: BatchNorm statistics per mini-batch.
        cache_dir: cache of decoded image-folder arrays, or ``None``.
    """

    dataset: str
    download: bool
    image_size: int
    pretrained: str | None
    width_mult: float
    dropout: float | None
    momentum: float
    wd: float
    warmup_epochs: float
    deferred_batchnorm: bool
    cache_dir: str | None


class VisionJob(Job):
    """MobileNetV2 on CIFAR; see :class:`~dgpipe.train.job.Job` for the interface."""

    options = VisionOptions
    pinned = (0, 0)

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.num_classes = cifar_spec(config.job.dataset).num_classes
        self.metric_names = tuple(metric_key(m) for m in TASK_METRICS[config.job.dataset])
        self.metric = self.metric_names[0]
        self.deferred_batchnorm = config.job.deferred_batchnorm

    @classmethod
    def check(cls, config: RunConfig) -> VisionOptions:
        """Check image size, data (with ``--download``: downloading the official tarball when it is
        missing) and the partition against the model's layers. Returns ``config.job`` unchanged.

        Raises:
            ValueError: bad ``--image-size``/``--width-mult``, ``--example-dropout``, ``--skip-padding``, no data
                (lists the paths tried), or a partition that does not fit the model.
        """
        opts, data = config.job, config.data
        if opts.image_size < 8:
            raise ValueError(f"--image-size {opts.image_size} is too small; use 32 (native) or more, e.g. 224")
        if opts.width_mult <= 0:
            raise ValueError(f"--width-mult must be positive, got {opts.width_mult}")
        if opts.pretrained is not None and (opts.width_mult != 1.0 or opts.dropout is not None):
            raise ValueError("--width-mult and --dropout change a randomly initialised model; drop them with "
                             "--pretrained")
        if opts.dropout is not None and not 0 <= opts.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {opts.dropout}")
        if config.delta.example_dropout:
            raise ValueError("--example-dropout is for the nlp job's encoders (MobileNetV2's one dropout sits "
                             "before its classifier, past every boundary)")
        if config.pipeline.skip_padding:
            raise ValueError("--skip-padding is for the nlp job's encoders (MobileNetV2's activations have no "
                             "padding rows)")
        if config.pipeline.token_reference:
            raise ValueError("--token-reference is for the nlp job's encoders (MobileNetV2's activations have no "
                             "tokens)")
        if opts.deferred_batchnorm and config.pipeline.engine == "torch":
            raise ValueError("--deferred-batchnorm is dgpipe's runtime (torchgpipe's DeferredBatchNorm); "
                             "drop it with --engine torch")
        if opts.momentum < 0 or opts.wd < 0 or opts.warmup_epochs < 0:
            raise ValueError("--momentum, --wd and --warmup-epochs must be >= 0")
        try:
            kind, path = find_cifar(opts.dataset, data.data_dir)
        except FileNotFoundError as missing:
            if not opts.download:
                raise ValueError(f"{missing} Or add --download to fetch the official tarball into "
                                 f"{data.data_dir}.") from None
            try:
                kind, path = "archive", download_cifar(opts.dataset, data.data_dir)
            except OSError as err:
                raise ValueError(f"{missing}\n(download failed: {err})") from None
        for flag, subset, split in (("--train-subset", data.train_subset, "train"),
                                    ("--eval-subset", data.eval_subset, "test")):
            size = len(list_image_folder(path, split)[0]) if kind == "images" else OFFICIAL_SIZES[split]
            if subset is not None and subset > size:
                raise ValueError(f"{flag} {subset} is more than the {size} {split} images in {path}")
        n_layers = len(mobilenet_layers(build_mobilenet(cifar_spec(opts.dataset).num_classes,
                                                        depth_multiplier=opts.width_mult)))
        check_partition(n_layers, config.pipeline, cls.pinned)
        return opts

    def build_layers(self) -> list[nn.Module]:
        a = self.config.job
        if a.pretrained is not None:
            model = build_mobilenet(self.num_classes, pretrained=a.pretrained)
        else:
            model = build_mobilenet(self.num_classes, depth_multiplier=a.width_mult, image_size=a.image_size,
                                    classifier_dropout_prob=DEFAULT_DROPOUT if a.dropout is None else a.dropout)
        return mobilenet_layers(model)

    def loaders(self, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
        a, d = self.config.job, self.config.data
        common = dict(image_size=a.image_size, seed=self.config.train.seed, num_workers=d.num_workers,
                      cache_dir=a.cache_dir, download=False)
        train = make_loader(a.dataset, d.data_dir, "train", d.batch_size // world_size, subset=d.train_subset,
                            rank=rank, world_size=world_size, sample_ids=self.config.delta.delta, **common)
        evaluation = make_loader(a.dataset, d.data_dir, "test", d.batch_size, subset=d.eval_subset, **common)
        return train, evaluation

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        values = compute_metrics(self.config.job.dataset, outputs, targets)
        return {metric_key(k): v for k, v in values.items()}

    def optimizer(self, params: Iterable[nn.Parameter], total_steps: int, steps_per_epoch: int,
                  momentum_in_codec: bool = False):
        from transformers import get_cosine_schedule_with_warmup

        a = self.config.job
        momentum = 0.0 if momentum_in_codec else a.momentum
        opt = torch.optim.SGD(decay_groups(params, a.wd), lr=self.config.train.lr, momentum=momentum)
        warmup = min(round(a.warmup_epochs * steps_per_epoch), total_steps)
        return opt, get_cosine_schedule_with_warmup(opt, warmup, total_steps)
