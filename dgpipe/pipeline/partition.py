"""Cutting a sequence of layers into stages, and placing stages on ranks.

A *partition* is an ordered list of stages (``nn.Module``); stage i's output is stage
i+1's input. A *placement* is a list ``placement[i] = rank`` of the same length.
Built-in placements: linear (stage i on rank i) and client/server (three stages,
``[first, middle, last]`` on ranks ``[0, 1, 0]``: a weak client keeps the input and
the loss, a strong server runs the middle).

Balancing by parameter count or by measured time uses torchgpipe's block partition
(Bárány and Grinberg, "Block partitions of sequences", 2015) and profiler.

Usage::

    layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    stages = split_layers(layers, balance_by_params(layers, 3))
    placement = validate_placement(client_server_placement(), len(stages), world_size=2)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

import torch
from torch import nn
from torchgpipe.balance import balance_by_time as _tg_balance_by_time
from torchgpipe.balance.blockpartition import solve as _block_partition

__all__ = [
    "split_layers",
    "balance_by_params",
    "balance_by_time",
    "linear_placement",
    "client_server_placement",
    "validate_placement",
]


def _named_layers(layers: nn.Sequential | Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    named = list(layers.named_children()) if isinstance(layers, nn.Sequential) else list(enumerate(layers))
    for name, layer in named:
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer {name} is a {type(layer).__name__}, not an nn.Module")
    if not named:
        raise ValueError("no layers to partition")
    return [(str(n), m) for n, m in named]


def split_layers(layers: nn.Sequential | Iterable[nn.Module], balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``layers`` into consecutive stages of ``balance[i]`` layers each.

    The stages share the layer objects (no copy); an ``nn.Sequential``'s child names
    are kept, so ``stage.state_dict()`` keys match the unsplit model's.

    Args:
        layers: an ``nn.Sequential`` or a list of modules, in order.
        balance: positive layer counts, summing to the number of layers.

    Returns:
        One ``nn.Sequential`` per stage.

    Raises:
        ValueError: a count is not positive, or the counts do not add up.
    """
    named = _named_layers(layers)
    balance = list(balance)
    if not balance or any(not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance must be a non-empty list of positive layer counts, got {balance}")
    if sum(balance) != len(named):
        raise ValueError(
            f"balance {balance} covers {sum(balance)} layers but there are {len(named)}; make it sum to {len(named)}"
        )
    stages, start = [], 0
    for count in balance:
        stages.append(nn.Sequential(OrderedDict(named[start : start + count])))
        start += count
    return stages


def _check_n(n_stages: int, n_layers: int) -> None:
    if not isinstance(n_stages, int) or not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {n_stages} stages; use 1..{n_layers} stages")


def balance_by_params(layers: nn.Sequential | Iterable[nn.Module], n_stages: int) -> list[int]:
    """Layer counts per stage that even out the number of parameters per stage.

    Returns:
        ``n_stages`` positive ints summing to the number of layers (for :func:`split_layers`).

    Raises:
        ValueError: ``n_stages`` is not in ``1..len(layers)``.
    """
    named = _named_layers(layers)
    _check_n(n_stages, len(named))
    costs = [sum(p.numel() for p in m.parameters()) for _, m in named]
    return [len(block) for block in _block_partition(costs, n_stages)]


def balance_by_time(
    layers: nn.Sequential | Iterable[nn.Module],
    n_stages: int,
    sample: torch.Tensor | tuple[torch.Tensor, ...],
    timeout: float = 1.0,
    device: torch.device | str = "cpu",
) -> list[int]:
    """Layer counts per stage that even out forward+backward time (torchgpipe's profiler).

    Args:
        layers: the layers; profiled on copies, so the originals are untouched.
        n_stages: number of stages.
        sample: an input batch of any batch size (tensor or tuple), on any device.
        timeout: seconds of repeated profiling.
        device: where to profile.

    Returns:
        ``n_stages`` positive ints summing to the number of layers.

    Raises:
        ValueError: ``n_stages`` out of range, or a parameter already has a gradient.
    """
    named = _named_layers(layers)
    _check_n(n_stages, len(named))
    return _tg_balance_by_time(n_stages, nn.Sequential(OrderedDict(named)), sample, timeout=timeout, device=device)


def linear_placement(n_stages: int) -> list[int]:
    """Stage i on rank i: ``[0, 1, ..., n_stages - 1]``."""
    if not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be a positive int, got {n_stages!r}")
    return list(range(n_stages))


def client_server_placement() -> list[int]:
    """Three stages ``[first, middle, last]`` on ranks ``[0, 1, 0]`` (client 0, server 1)."""
    return [0, 1, 0]


def validate_placement(placement: Sequence[int], n_stages: int, world_size: int) -> list[int]:
    """Check that ``placement`` maps ``n_stages`` stages onto all ``world_size`` ranks.

    Returns:
        The placement as a list of ints.

    Raises:
        ValueError: wrong length, a rank outside ``0..world_size-1``, or a rank that
        holds no stage; the message says how to fix it.
    """
    placement = list(placement)
    if n_stages < 1:
        raise ValueError(f"need at least one stage, got {n_stages}")
    if len(placement) != n_stages:
        raise ValueError(
            f"placement {placement} has {len(placement)} entries but there are {n_stages} stages; "
            f"give one rank per stage, e.g. linear_placement({n_stages})"
        )
    for i, r in enumerate(placement):
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
            raise ValueError(f"placement[{i}] = {r!r} is not a rank of this world (0..{world_size - 1})")
    unused = sorted(set(range(world_size)) - set(placement))
    if unused:
        raise ValueError(
            f"placement {placement} leaves rank(s) {unused} without a stage; every one of the "
            f"{world_size} ranks must hold a stage (launch {len(set(placement))} processes, or change the placement)"
        )
    return placement
