"""Vision main job: MobileNetV2 on CIFAR-10/100 through a compressed GPipe pipeline.

By default a client (rank 0: the first and last --client-layers layers) and a server
(rank 1: the middle) train one model, with the activations and gradients crossing the
link compressed; --mode dataparallel runs the DDP baseline instead. Example:

    python test_vision_dgpipe.py --data-dir ../shared/data/cifar10-images \\
        --sortquant --quant 6 --split 2 --chunk 4 --log runs/sq8.jsonl

Under torchrun (one process per rank, any number of machines) the same flags apply.
"""

from __future__ import annotations

import argparse

from dgpipe.pipeline import exit_without_teardown
from dgpipe.train import loop
from dgpipe.train.args import common_parser
from dgpipe.train.vision import VisionJob


def build_parser() -> argparse.ArgumentParser:
    """The common flags plus the vision job's own."""
    p = common_parser(__doc__.split("\n\n")[0], batch_size=128, lr=0.05, epochs=10, client_layers=1,
                      data_dir="./data",
                      data_dir_help="CIFAR: the official python tarball, its extracted folder, or an image folder "
                                    "train/<class>/*.jpg + test/<class>/*.jpg (downloaded when missing and online)")
    v = p.add_argument_group("MobileNetV2 on CIFAR")
    v.add_argument("--dataset", choices=["cifar10", "cifar100"], default="cifar10")
    v.add_argument("--image-size", type=int, default=32, help="input side in pixels (32 native; 224 as in the "
                                                                 "original runs, by interpolation)")
    v.add_argument("--pretrained", metavar="NAME_OR_DIR",
                   help="transformers checkpoint (e.g. google/mobilenet_v2_1.0_224); classifier replaced")
    v.add_argument("--width-mult", type=float, default=1.0, help="MobileNetV2 width multiplier (random init)")
    v.add_argument("--dropout", type=float, help="classifier dropout of a randomly initialised model (default 0.2; "
                                                 "transformers' config default, 0.8, stalls training from scratch)")
    v.add_argument("--momentum", type=float, default=0.9)
    v.add_argument("--wd", type=float, default=4e-5, help="weight decay (not on biases and BatchNorm)")
    v.add_argument("--warmup-epochs", type=float, default=0.0, help="linear warm-up before the cosine schedule")
    v.add_argument("--deferred-batchnorm", action="store_true",
                   help="BatchNorm running statistics per mini-batch instead of per micro-batch (torchgpipe)")
    v.add_argument("--cache-dir", help="cache decoded image-folder arrays here (.npy)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse, validate (errors exit with status 2 before any process starts), train."""
    return loop.main(VisionJob, build_parser(), argv)


if __name__ == "__main__":
    exit_without_teardown(main())  # a rank under torchrun: see dgpipe.pipeline.exit_without_teardown
