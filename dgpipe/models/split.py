"""Stages made of consecutive layers, and the client/server cut of a layer list.

Convention (as in torchgpipe): every layer takes ONE argument, a tensor or a tuple of
tensors, and returns a tensor or a tuple. A :class:`Stage` chains layers under that
convention; a tuple such as ``(hidden_states, attention_mask)`` passes from layer to layer
(and across a stage boundary) as it is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn


class Stage(nn.Sequential):
    """Consecutive layers run one after another, tuples passed through.

    ``stage(x)`` with a tensor or a tuple, or ``stage(a, b, ...)`` (packed into the tuple
    ``(a, b, ...)``), returns the last layer's output (a tensor or a tuple).
    """

    def forward(self, *inputs):
        if not inputs:
            raise TypeError("Stage needs an input (a tensor or a tuple of tensors)")
        x = inputs[0] if len(inputs) == 1 else inputs
        for layer in self:
            x = layer(x)
        return x


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
