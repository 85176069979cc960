"""dgpipe codecs inside ``torch.distributed.pipelining``: :class:`CompressedPipelineStage`, a drop-in
for torch's ``PipelineStage`` that every torch schedule (GPipe, 1F1B, interleaved 1F1B,
zero-bubble) drives, with the boundary tensors crossing as codec payloads; :class:`PositionalStage`, a stage
that takes one value (a tensor or a tuple) as torch's schedules call it, with positional tensors.

Usage (2 ranks, one stage each; see ``docs/pipeline-api.md`` for the whole example)::

    stage = CompressedPipelineStage(part, rank, 2, device, act_codec=("quant", {"bits": 8}),
                                    grad_codec=("quant", {"bits": 8}))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
"""

from .positional import PositionalStage
from .stage import TESTED_TORCH, UNTESTED_TORCH_ENV, CompressedPipelineStage, check_torch_version

__all__ = ["CompressedPipelineStage", "PositionalStage", "TESTED_TORCH", "UNTESTED_TORCH_ENV", "check_torch_version"]
