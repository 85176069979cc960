"""Groups and rotation for CNN feature maps: bits per value and error of the codebook codec on real MobileNetV2 activations.

A feature map ``(N, C, H, W)`` has a short last axis (``W`` = 7..56), so the codebook's usual
transformer setting -- one scale per token (the last axis) after a Hadamard rotation of it --
spends a large share of the bits on scales, and a rotation of a width that is not a power of two
pads it (28 -> 32, 56 -> 64: +14% of the codes). This prints, for the 2- and 4-bit codebook
(Lloyd-Max levels, bfloat16 scales), each grouping with and without the rotation: bits per value
all-in (codes, scales, header) and the relative error ``||x - x^||^2 / ||x||^2``.

Tensors: MobileNetV2 (width 1.0, random init, train mode: batch statistics normalize each map as in a trained network) on 16 real CIFAR-10 test images,
upsampled to ``--image-size`` (default 112, so that the maps are 56, 28 and 14 wide as at 224 px
one block later). The outputs of the first ``--layers`` layers (the stem and the first inverted
residual blocks) are the candidate client/server boundaries.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/cnn_grouping.py [--image-size 112] [--layers 6]

Needs ``../shared/data/cifar10-images``.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F

from dgpipe.compression import get_codec

GROUPINGS = {
    "token (last axis)": {"group": "token"},
    "channel (axis 1)": {"group": "channel", "axis": 1},
    "tile 4096": {"group": "tile", "group_size": 4096},
}


def feature_maps(image_size: int, layers: int) -> list[torch.Tensor]:
    """The outputs of MobileNetV2's first ``layers`` layers on 16 CIFAR-10 test images at ``image_size`` px."""
    import boundary_tensors

    from dgpipe.data.imagefolder import load_image_folder
    from dgpipe.models.mobilenet import build_mobilenet, mobilenet_layers

    torch.manual_seed(0)
    images, _, _ = load_image_folder(boundary_tensors.DATA / "cifar10-images", "test", subset=16)
    x = torch.from_numpy(images).float().div(255).permute(0, 3, 1, 2).contiguous()
    x = F.interpolate(x, size=image_size, mode="bilinear", align_corners=False)
    out = []
    with torch.no_grad():
        for layer in mobilenet_layers(build_mobilenet(10, image_size=image_size).train())[:layers]:
            x = layer(x)
            out.append(x)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image-size", type=int, default=112)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()
    maps = feature_maps(args.image_size, args.layers)
    print(f"# {datetime.date.today()}, command: OMP_NUM_THREADS={torch.get_num_threads()} python {' '.join(sys.argv)}")
    print("# bits per value all-in / relative error; codebook with Lloyd-Max levels, bfloat16 scales\n")
    head = [f"{label}, {rot}" for label in GROUPINGS for rot in ("hadamard", "none")]
    print("| layer output | bits | " + " | ".join(head) + " |")
    print("|---|---|" + "---|" * len(head))
    for i, a in enumerate(maps):
        for bits in (2, 4):
            cells = []
            for opts in GROUPINGS.values():
                for rot in ("hadamard", "none"):
                    codec = get_codec("codebook", bits=bits, rotate=rot, scale_dtype="bfloat16", **opts)
                    payload = codec.encode(a)
                    err = float((codec.decode(payload) - a).square().sum() / a.square().sum())
                    cells.append(f"{8 * payload.nbytes / a.numel():.2f} / {err:.4f}")
            print(f"| {i}: {tuple(a.shape)} | {bits} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
