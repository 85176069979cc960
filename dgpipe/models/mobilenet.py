"""MobileNetV2 (transformers) as an ordered list of layers a partition can cut.

Reference: Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks",
CVPR 2018. The model is Hugging Face's ``MobileNetV2ForImageClassification``.

Resolution: the model keeps Hugging Face's ImageNet strides (output stride 32: the stem
and four blocks halve the resolution). At native CIFAR size (32 px) the last feature map
is therefore 1x1; ``image_size=224`` in :class:`dgpipe.data.transforms.ImageTransform` resizes CIFAR to
224 px instead. No CIFAR-specific stem is applied:
the config has no switch for the stem's stride (``output_stride`` only trades later
strides for dilation and can be passed through ``**config``).
"""

from __future__ import annotations

import torch
from torch import nn


def build_mobilenet(
    num_classes: int,
    pretrained: str | None = None,
    depth_multiplier: float = 1.0,
    image_size: int = 224,
    **config,
) -> nn.Module:
    """A ``MobileNetV2ForImageClassification`` with ``num_classes`` outputs.

    Args:
        num_classes: classifier outputs (10 for CIFAR-10, 100 for CIFAR-100).
        pretrained: hub name or local directory for ``from_pretrained`` (e.g.
            ``"google/mobilenet_v2_1.0_224"``); its classifier is replaced by a new,
            randomly initialised one for ``num_classes``. ``None``: random initialisation
            (:func:`reset_parameters`).
        depth_multiplier: channel width factor (random init only; 0.35 gives a tiny model).
        image_size: recorded in the config (random init only); the network itself accepts
            any input size.
        **config: further ``MobileNetV2Config`` fields (random init only), e.g.
            ``classifier_dropout_prob``.

    Returns:
        the model; ``model(pixel_values float32 (B, 3, H, W)).logits`` is ``(B, num_classes)``.

    Raises:
        ValueError: ``num_classes < 1``, or config fields given together with ``pretrained``.
    """
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if pretrained is not None:
        if config or depth_multiplier != 1.0:
            raise ValueError("config fields cannot be changed for a pretrained MobileNetV2; drop them or --pretrained")
        return MobileNetV2ForImageClassification.from_pretrained(
            pretrained, num_labels=num_classes, ignore_mismatched_sizes=True
        )
    cfg = MobileNetV2Config(num_labels=num_classes, depth_multiplier=depth_multiplier, image_size=image_size, **config)
    model = MobileNetV2ForImageClassification(cfg)
    reset_parameters(model)
    return model


@torch.no_grad()
def reset_parameters(model: nn.Module) -> None:
    """Re-initialise for training from scratch, as usual for MobileNetV2 (He et al. 2015):
    convolutions ``kaiming_normal_(mode="fan_out")``, linear ``normal_(0, 0.01)``, biases 0,
    batch-norm scale 1 and shift 0.

    Hugging Face's generic init draws every convolution from ``normal(0, 0.02)``, far below
    the usual fan-based scale (a depthwise 3x3 kernel gets std ~0.47 here); batch norm makes
    each layer scale-invariant, so such small weights act like a much larger learning rate.
    """
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out")
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.01)
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
        if isinstance(module, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)) and module.bias is not None:
            nn.init.zeros_(module.bias)


class PoolFlatten(nn.Module):
    """Global average pooling then flatten: float ``(B, C, H, W)`` -> ``(B, C)``."""

    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        self.pool = pool

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(features), start_dim=1)


class Classifier(nn.Module):
    """Dropout then the model's linear classifier: ``(B, C)`` -> logits ``(B, num_classes)``.

    Uses the model's own dropout module for its probability and train/eval mode, but
    applies it out of place (the model's is in-place), so it can run on a tensor received
    at a stage boundary (a leaf that requires grad); the random mask is the same.
    """

    def __init__(self, dropout: nn.Dropout, linear: nn.Module) -> None:
        super().__init__()
        self.dropout = dropout
        self.linear = linear

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear(nn.functional.dropout(pooled, self.dropout.p, self.dropout.training))


def mobilenet_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of a ``MobileNetV2ForImageClassification``, in forward order.

    ``[stem, block_1 .. block_16, conv_1x1, PoolFlatten, Classifier]`` (20 layers). Each
    takes one float tensor and returns one; their sequential composition computes exactly
    the model's ``logits`` (eval and train mode). The layers share their parameters with
    ``model`` (the model's own submodules), so training them trains the model and
    ``model.state_dict()`` saves them.

    Raises:
        ValueError: not a MobileNetV2 classification model.
    """
    base = getattr(model, "mobilenet_v2", None)
    if base is None or not hasattr(model, "classifier") or base.pooler is None:
        raise ValueError(f"expected a MobileNetV2ForImageClassification, got {type(model).__name__}")
    return [
        base.conv_stem,
        *base.layer,
        base.conv_1x1,
        PoolFlatten(base.pooler),
        Classifier(model.dropout, model.classifier),
    ]
