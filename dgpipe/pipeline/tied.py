"""Parameters shared by stages on different ranks (tied input/output embeddings).

A decoder LM with tied embeddings uses one weight in its first layer (token embeddings) and its last
(the LM head). Every rank builds the whole model, so each holds its own copy of that weight; a
partition that places the two layers on two ranks must give both copies the same update. As in
Megatron-LM's embedding group (Shoeybi et al., "Megatron-LM", arXiv:1909.08053; Narayanan et al.,
SC'21), the ranks that hold a shared parameter sum its gradient after the backward pass: each copy
then holds the gradient of the unsplit model, and identical optimizers keep the copies equal.
Stages on one rank share the parameter object itself; autograd sums there, nothing to do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TiedParameters", "unique_parameters"]


def unique_parameters(modules: Sequence[nn.Module]):
    """The parameters of ``modules`` in order, each once (a parameter shared by two modules is
    yielded at its first appearance)."""
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p


class TiedParameters:
    """The parameters that stages on two or more ranks share, and the gradient sum that keeps them equal.

    Every rank builds one from the same full partition (the stages are identical on every rank, so
    the groups and their order are too); :meth:`sum_gradients` is then a collective of the ranks of
    each group. With no parameter shared across ranks nothing is created and the sum is a no-op.

    Args:
        stages: the full partition, identical on every rank.
        placement: ``placement[i]`` = rank of stage i.
        rank: this process's rank.
    """

    def __init__(self, stages: Sequence[nn.Module], placement: Sequence[int], rank: int) -> None:
        owners: dict[int, set[int]] = {}
        params: dict[int, nn.Parameter] = {}
        order: list[int] = []
        for i, stage in enumerate(stages):
            for p in stage.parameters():
                if id(p) not in params:
                    params[id(p)], owners[id(p)] = p, set()
                    order.append(id(p))
                owners[id(p)].add(placement[i])
        #: ``[(ranks, parameter)]`` of every trained parameter held by more than one rank, in model order (a
        #: frozen one, e.g. the embeddings under LoRA, has no gradient to sum).
        self.shared: list[tuple[tuple[int, ...], nn.Parameter]] = [
            (tuple(sorted(owners[k])), params[k]) for k in order if len(owners[k]) > 1 and params[k].requires_grad]
        self._groups: dict[tuple[int, ...], object] = {}
        for ranks, _ in self.shared:
            if ranks not in self._groups:  # every rank creates every group, in the same order
                self._groups[ranks] = dist.new_group(list(ranks)) if dist.is_initialized() else None
        self.rank = rank
        #: How many of the partition's stages this rank holds.
        self.stages_here = sum(1 for r in placement if r == rank)

    def __bool__(self) -> bool:
        return bool(self.shared)

    def sum_gradients(self) -> None:
        """Sum the gradient of every shared parameter this rank holds over the ranks that hold it (a
        missing gradient counts as zeros). Call it after the step's backward, before the optimizer."""
        for ranks, p in self.shared:
            if self.rank not in ranks:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self._groups[ranks])
