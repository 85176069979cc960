"""A dgpipe stage as torch's schedules call it: :class:`PositionalStage`."""

from __future__ import annotations

from torch import nn

__all__ = ["PositionalStage"]


class PositionalStage(nn.Module):
    """Wrap a stage whose forward takes one value -- a tensor, or the tuple a tuple boundary carries (e.g. hidden
    states ``(B, L, H)`` float and a padding mask ``(B, L)`` int64) -- so that torch's schedules, which pass a
    stage's inputs as positional arguments, can drive it: ``PositionalStage(stage)(*tensors)`` is
    ``stage(tensors[0])`` for one tensor, ``stage(tensors)`` for several. The output (tensor or tuple) is the
    stage's. Give it to :class:`~dgpipe.pipelining.CompressedPipelineStage` in place of the stage.
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args):
        return self.stage(args[0] if len(args) == 1 else args)
