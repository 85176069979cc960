"""``dgpipe-vision`` (``test_vision_dgpipe.py``): MobileNetV2 on CIFAR-10/100 through a
compressed GPipe pipeline. Parser and entry point; the job is :class:`dgpipe.train.vision.VisionJob`."""

from __future__ import annotations

import argparse

from dgpipe.cli import entry_point
from dgpipe.train import loop
from dgpipe.train.flags import common_parser
from dgpipe.train.vision import VisionJob

DESCRIPTION = """\
Train MobileNetV2 on CIFAR-10/100, split between a client (rank 0: the first and last
--client-layers layers) and a server (rank 1: the middle), with the activations and
gradients crossing the link compressed. --mode dataparallel runs the DDP baseline
instead. Under torchrun (one process per rank, any number of machines) the same flags
apply.

Defaults: 10 epochs on all 50,000 training images from random initialisation -- about
an hour on 2 CPU cores (~150 examples/s); use --train-subset and --epochs for shorter
runs. Missing data is an error; --download fetches the official tarball."""

EPILOG = """\
example (8-bit sort quantization against the uncompressed pipeline, same seed):
  %(prog)s --data-dir ../shared/data/cifar10-images --train-subset 5000 --eval-subset 2000 \\
      --epochs 2 --batch-size 64 --sortquant --quant 6 --split 2 --compare-to none"""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The common flags (:func:`dgpipe.train.flags.common_parser`) plus the vision job's own."""
    p = common_parser(DESCRIPTION, batch_size=128, lr=0.05, epochs=10, client_layers=1, data_dir="./data",
                      data_dir_help="CIFAR: the official python tarball, its extracted folder, or an image folder "
                                    "train/<class>/*.jpg + test/<class>/*.jpg",
                      epilog=EPILOG, prog=prog)
    v = p.add_argument_group("MobileNetV2 on CIFAR")
    v.add_argument("--dataset", choices=["cifar10", "cifar100"], default="cifar10", help="which CIFAR")
    v.add_argument("--download", action="store_true",
                   help="download the official tarball into --data-dir when no CIFAR data is found there")
    v.add_argument("--image-size", type=int, default=32, help="input side in pixels (32 native; 224 as in the "
                                                                 "original runs, by interpolation)")
    v.add_argument("--pretrained", metavar="NAME_OR_DIR",
                   help="transformers checkpoint (e.g. google/mobilenet_v2_1.0_224); classifier replaced "
                        "(default: random initialisation)")
    v.add_argument("--width-mult", type=float, default=1.0, help="MobileNetV2 width multiplier (random init)")
    v.add_argument("--dropout", type=float, help="classifier dropout of a randomly initialised model (default: 0.2; "
                                                 "transformers' config value, 0.8, stalls training from scratch)")
    v.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    v.add_argument("--wd", type=float, default=4e-5, help="weight decay (not on biases and BatchNorm)")
    v.add_argument("--warmup-epochs", type=float, default=0.0, help="linear warm-up before the cosine schedule")
    v.add_argument("--deferred-batchnorm", action="store_true",
                   help="BatchNorm running statistics per mini-batch instead of per micro-batch (torchgpipe)")
    v.add_argument("--cache-dir", help="cache decoded image-folder arrays here (.npy) (default: no cache)")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse, validate (errors exit with status 2 before any process starts), train; 0, or 1 when a rank failed."""
    return loop.main(VisionJob, build_parser(prog), argv)


#: The ``dgpipe-vision`` console script.
console = entry_point(main)
