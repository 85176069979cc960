"""Mixed precision and activation checkpointing of a run's stages (``--precision``, ``--activation-checkpointing``).

``--precision bf16`` (or ``fp16``) runs every stage's forward under ``torch.autocast`` of that dtype (Micikevicius
et al., "Mixed Precision Training", arXiv:1710.03740): matrix products in 16 bits, reductions and norms in float32,
the stage's outputs -- and so the activations and gradients crossing each boundary -- in 16 bits, which the
boundary codecs code as they are (the uncompressed link then carries 16 bits a value). Trainable weights, their
gradients and the optimizer's moments stay float32; weights that do not train (the base model under LoRA adapters,
a distillation's frozen model) are stored in the 16-bit dtype, halving their memory, as fine-tuning recipes load a
base model for adapters. ``fp16`` scales the loss against underflow (:class:`LossScale`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dgpipe.models import as_stage

__all__ = ["PRECISIONS", "check_precision", "prepare_stages", "LossScale"]

#: ``--precision`` -> the autocast dtype (None: float32 throughout).
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, devices: list[str]) -> None:
    """Refuse a precision a rank's device cannot compute in (before any process starts).

    Raises:
        ValueError: an unknown precision, or ``bf16`` on a CUDA device without bfloat16 support.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision}: use one of {', '.join(PRECISIONS)}")
    if precision == "bf16" and any(d.startswith("cuda") for d in devices) and not torch.cuda.is_bf16_supported():
        raise ValueError("--precision bf16: this GPU has no bfloat16 arithmetic; use --precision fp16")


def prepare_stages(stages: list[nn.Module], precision: str, checkpointing: bool) -> list[nn.Module]:
    """The stages as :class:`~dgpipe.models.Stage` s running under ``precision``'s autocast and with
    ``checkpointing``, their frozen floating weights cast to the 16-bit dtype (the same objects: the model's
    parameters change in place)."""
    dtype = PRECISIONS[precision]
    if dtype is not None:
        for stage in stages:
            for p in stage.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(dtype)
    return [as_stage(s, dtype, checkpointing) for s in stages]


class LossScale:
    """Dynamic loss scaling for ``fp16`` on the ranks of a pipeline (Micikevicius et al., 2017): the loss is
    multiplied by ``scale`` before the backward pass; before each optimizer step every rank divides its gradients
    by it and the ranks agree (one all-reduce) whether any gradient overflowed -- then every rank skips the step
    and halves the scale -- and the scale doubles after ``growth_interval`` steps without overflow, as
    ``torch.amp.GradScaler`` does on one process.

    Args:
        enabled: False (``fp32``/``bf16``): ``scale`` is 1 and :meth:`step` just steps.
        init_scale: the first scale (GradScaler's default, 2^16).
        growth_interval: steps without overflow before the scale doubles.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled, self.growth_interval = enabled, growth_interval
        self.scale = init_scale if enabled else 1.0
        self._good_steps = 0
        self.skipped = 0

    def scaled(self, loss_fn):
        """``loss_fn`` whose loss is multiplied by the current scale (the backward pass then starts from it)."""
        return lambda output, target: loss_fn(output, target) * self.scale

    def step(self, optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
        """Unscale this rank's gradients, agree on overflow (a collective on ``device``, the process group's), step
        ``optimizer`` or skip; returns whether it stepped (the same on every rank). Written here rather than with
        ``torch.amp.GradScaler``, which decides per process, or FSDP's ``ShardedGradScaler``, which all-reduces one
        flag per device holding gradients and so waits forever on a rank whose weights are all frozen."""
        if not self.enabled:
            optimizer.step()
            return True
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for grad in grads:
            grad.div_(self.scale)
        found = [(~torch.isfinite(grad)).any() for grad in grads]
        overflow = (torch.stack(found).any() if found else torch.zeros((), dtype=torch.bool)).float().reshape(1)
        overflow = overflow.to(device)
        if dist.is_initialized():
            dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
        if bool(overflow.item()):
            self.scale /= 2
            self._good_steps = 0
            self.skipped += 1
            return False
        optimizer.step()
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self.scale *= 2
            self._good_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._good_steps, self.skipped = state["scale"], state["good_steps"], state["skipped"]
