"""Stages made of consecutive layers, and the client/server cut of a layer list.

Convention (as in torchgpipe): every layer takes ONE argument, a tensor or a tuple of
tensors, and returns a tensor or a tuple. A :class:`Stage` chains layers under that
convention; a tuple such as ``(hidden_states, attention_mask)`` passes from layer to layer
(and across a stage boundary) as it is.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Stage(nn.Sequential):
    """Consecutive layers run one after another, tuples passed through.

    ``stage(x)`` with a tensor or a tuple, or ``stage(a, b, ...)`` (packed into the tuple
    ``(a, b, ...)``), returns the last layer's output (a tensor or a tuple).

    Attributes:
        autocast: run the layers under ``torch.autocast`` of this dtype (``torch.bfloat16`` or
            ``torch.float16``) and return the floating outputs in it (what crosses a boundary is then 16-bit
            whichever op came last, e.g. a residual sum promoted to float32 by a float32 input), or None.
        checkpointing: in training, keep only each layer's input and recompute the layer in the
            backward pass (``torch.utils.checkpoint``, non-reentrant; Chen et al., "Training Deep Nets
            with Sublinear Memory Cost", arXiv:1604.06174), instead of storing its activations.
    """

    autocast: torch.dtype | None = None
    checkpointing: bool = False

    def forward(self, *inputs):
        if not inputs:
            raise TypeError("Stage needs an input (a tensor or a tuple of tensors)")
        x = inputs[0] if len(inputs) == 1 else inputs
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        with self._precision(x):
            for layer in self:
                x = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        return x if self.autocast is None else _cast_floating(x, self.autocast)

    def _precision(self, x):
        if self.autocast is None:
            return contextlib.nullcontext()
        first = x if isinstance(x, torch.Tensor) else x[0]
        return torch.autocast(first.device.type, dtype=self.autocast)


def _cast_floating(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    return tuple(_cast_floating(t, dtype) for t in x)


def as_stage(stage: nn.Module, autocast: torch.dtype | None = None, checkpointing: bool = False) -> Stage:
    """``stage`` (an ``nn.Sequential``) as a :class:`Stage` of the same named layers -- same parameters, same
    ``state_dict`` keys -- that runs under ``autocast`` and with ``checkpointing`` (see :class:`Stage`)."""
    out = stage if isinstance(stage, Stage) else Stage(OrderedDict(stage.named_children()))
    out.autocast, out.checkpointing = autocast, checkpointing
    return out


def client_server_split(
    layers: Sequence[nn.Module], client_layers: int, always_client: tuple[int, int] = (0, 0)
) -> list[Stage]:
    """Cut a layer list into ``[client front, server middle, client back]``.

    Args:
        layers: the model's layers in forward order (e.g. from
            :func:`~dgpipe.models.mobilenet.mobilenet_layers` or
            :func:`~dgpipe.models.encoder.encoder_layers`).
        client_layers: ``K``, how many leading and how many trailing layers the client
            holds, besides the pinned ones.
        always_client: ``(front, back)`` layers held by the client whatever ``K`` is. For
            an encoder use ``(1, 1)`` (embeddings, head): the client then holds embeddings
            + the first ``K`` encoder layers and the last ``K`` encoder layers + head. For
            MobileNetV2 ``(0, 0)``: ``K`` counts stem and classifier too.

    Returns:
        three :class:`Stage` s, to be placed on ranks ``[client, server, client]``; each
        names its layers by their index in ``layers`` (``"0"``, ``"1"``, ...), so
        ``stage.state_dict()`` keys match those of ``Stage(*layers)``.

    Raises:
        ValueError: a stage would be empty (names the largest ``K`` that fits).
    """
    front, back = front_back = tuple(always_client)
    if client_layers < 0 or front < 0 or back < 0:
        raise ValueError(f"client_layers and always_client must be >= 0, got {client_layers} and {front_back}")
    lead, trail = front + client_layers, back + client_layers
    n = len(layers)
    if lead < 1 or trail < 1 or lead + trail >= n:
        low = max(1 - front, 1 - back, 0)
        high = (n - 1 - front - back) // 2
        fix = f"use client_layers in [{low}, {high}]" if low <= high else "too few layers to cut in three"
        raise ValueError(
            f"client_layers={client_layers} with {front_back} pinned client layers does not cut {n} layers into "
            f"non-empty client/server/client stages; {fix}"
        )
    cuts = [(0, lead), (lead, n - trail), (n - trail, n)]
    # Children keep their index in the full list, so state_dict keys name the layer.
    return [Stage(OrderedDict((str(i), layers[i]) for i in range(a, b))) for a, b in cuts]
