"""Image augmentation in plain torch ops, on whole batches (no torchvision).

All ops take image batches ``(B, C, H, W)``; :class:`ImageTransform` chains them from a
``uint8`` batch ``(B, H, W, 3)`` (or one image ``(H, W, 3)``) to normalised ``float32``
``(B, 3, S, S)``. Randomness comes from an optional ``torch.Generator`` (default: torch's
global generator, which a DataLoader seeds per worker). The ops run on any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# Per-channel mean and standard deviation of the training images (pixel values in [0, 1]),
# the values commonly used for CIFAR (computed over the 50,000 training images).
CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def random_crop(images: torch.Tensor, padding: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pad each image with ``padding`` zeros on every side and cut a random ``H x W`` window.

    Args:
        images: ``(B, C, H, W)``, any dtype.
    Returns:
        same shape and dtype; each image has its own offset in ``[0, 2 * padding]`` per axis.
    """
    if padding == 0:
        return images
    b, _, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(images.device)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(images.device)
    rows = (dy[:, None] + torch.arange(h, device=images.device))[:, :, None]  # (B, H, 1)
    cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, :]  # (B, 1, W)
    batch = torch.arange(b, device=images.device)[:, None, None]
    # Advanced indexing on dims 0, 2, 3 puts the broadcast (B, H, W) first: (B, H, W, C).
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2).contiguous()


def random_hflip(images: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None) -> torch.Tensor:
    """Mirror each image left-right with probability ``p``. ``(B, C, H, W)`` in and out."""
    flip = torch.rand(images.shape[0], generator=generator).to(images.device) < p
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(x / 255 - mean) / std`` per channel for uint8 input (``(x - mean) / std`` for float).

    Args:
        images: ``(B, C, H, W)`` uint8 (0..255) or floating (0..1).
    Returns:
        float32 ``(B, C, H, W)``.
    """
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=x.device)[None, :, None, None]
    std_t = torch.as_tensor(std, dtype=torch.float32, device=x.device)[None, :, None, None]
    return (x - mean_t) / std_t


def resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinear resize of float ``(B, C, H, W)`` to ``(B, C, size, size)`` (no-op when equal).

    Uses ``F.interpolate(mode="bilinear", align_corners=False)``, with antialiasing when
    shrinking.
    """
    if images.shape[-2:] == (size, size):
        return images
    shrink = size < images.shape[-2] or size < images.shape[-1]
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=shrink)


class ImageTransform:
    """Training or evaluation pipeline: [random crop, flip] -> normalise -> resize.

    Args:
        train: apply the random crop (``padding`` zeros) and horizontal flip.
        image_size: output side ``S`` (32 native CIFAR; 224 ImageNet's).
        mean, std: per-channel statistics (default CIFAR-10's, see :data:`CIFAR_STATS`).
        padding: crop padding in pixels.

    Call with uint8 ``(B, H, W, 3)`` or ``(H, W, 3)``; returns float32 ``(B, 3, S, S)`` or
    ``(3, S, S)``.
    """

    def __init__(
        self,
        train: bool,
        image_size: int = 32,
        mean: Sequence[float] = CIFAR_STATS["cifar10"][0],
        std: Sequence[float] = CIFAR_STATS["cifar10"][1],
        padding: int = 4,
    ) -> None:
        if image_size < 1 or padding < 0:
            raise ValueError(f"image_size must be >= 1 and padding >= 0, got {image_size} and {padding}")
        self.train, self.image_size, self.mean, self.std, self.padding = train, image_size, mean, std, padding

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        single = images.dim() == 3
        if images.dtype != torch.uint8 or images.shape[-1] != 3 or images.dim() not in (3, 4):
            raise ValueError(
                f"expected uint8 images (B, H, W, 3) or (H, W, 3), got {images.dtype} {tuple(images.shape)}"
            )
        x = (images[None] if single else images).permute(0, 3, 1, 2)
        if self.train:
            x = random_hflip(random_crop(x, self.padding, generator), generator=generator)
        x = resize(normalize(x, self.mean, self.std), self.image_size)
        return x[0] if single else x

    def __repr__(self) -> str:
        return f"ImageTransform(train={self.train}, image_size={self.image_size}, padding={self.padding})"
