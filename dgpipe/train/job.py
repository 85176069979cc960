"""What a main job hands the training loop: model, data, loss, metrics, optimizer.

:class:`Job` is the interface :func:`dgpipe.train.loop.run` drives; the vision job
(:class:`~dgpipe.train.vision.VisionJob`) and the GLUE job
(:class:`~dgpipe.train.nlp.GlueJob`) implement it. A job is built from the run config
(:class:`~dgpipe.train.config.RunConfig`) in every rank; :meth:`Job.check` runs once in the
launching process, before any rank starts, turns every problem it can see (data, model,
partition) into a ``ValueError`` that says what to change, and returns the job's options
with their defaults resolved.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader

from dgpipe.models import client_server_split
from dgpipe.pipeline import split_layers

from .compare import LINKS, Link
from .config import PipelineConfig, RunConfig

__all__ = ["Job", "metric_key", "decay_groups", "check_partition"]


def metric_key(name: str) -> str:
    """Log field of a validation metric: ``accuracy`` -> ``val_acc``, else ``val_<name>``."""
    return "val_acc" if name == "accuracy" else f"val_{name}"


def decay_groups(named: Iterable[tuple[str, nn.Parameter]] | Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Optimizer parameter groups: weight decay on matrices and kernels (``dim >= 2``),
    none on biases and normalisation scales (``dim < 2``), as usual for BERT and
    MobileNet training."""
    params = [p[1] if isinstance(p, tuple) else p for p in named]
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def check_partition(n_layers: int, pipeline: PipelineConfig, pinned: tuple[int, int]) -> None:
    """Check the partition flags against a model of ``n_layers`` layers (no model needed).

    Raises:
        ValueError: ``--client-layers`` too large, ``--stages`` more than the layers, or
            a ``--balance`` that does not add up, with the values that fit.
    """
    if pipeline.mode != "pipeline":
        return
    dummy = [nn.Identity() for _ in range(n_layers)]
    if pipeline.partition == "client-server":
        try:
            client_server_split(dummy, pipeline.client_layers, pinned)
        except ValueError as e:
            raise ValueError(f"--client-layers {pipeline.client_layers}: {e}") from None
        return
    if pipeline.stages > n_layers:
        raise ValueError(f"--stages {pipeline.stages} is more than the model's {n_layers} layers; "
                         f"use --stages <= {n_layers}")
    if pipeline.balance is not None:
        try:
            split_layers(dummy, list(pipeline.balance))
        except ValueError as e:
            raise ValueError(f"--balance {','.join(map(str, pipeline.balance))}: {e}") from None


class Job:
    """Interface of a main job (see the module docstring). Subclasses set the class
    attributes and implement the methods.

    Attributes:
        options: the frozen dataclass of the job's own flags (``RunConfig.job``).
        pinned: ``(front, back)`` layers the client always holds in a client/server
            partition besides ``--client-layers`` (an encoder's embeddings and head).
        deferred_batchnorm: BatchNorm statistics per mini-batch (torchgpipe's
            ``DeferredBatchNorm``) in a pipeline.
        row_mask: the tuple position of the padding mask in the values between the job's layers, for
            ``--skip-padding`` (``None``: its values have no padding rows).
        classifier: the outputs are class scores (the logs then record how many evaluation examples
            the most predicted class got, a sign of a model that has not learnt the task).
        step_records: write a ``step`` record (loss, learning rate) after every optimizer step.
        links: the links of ``--compare-to``'s projection columns (:mod:`dgpipe.train.compare`).
        metric: log field of the summary metric (e.g. ``"val_acc"``), set by ``__init__``.
        metric_names: every validation metric's log field, summary metric first.
    """

    options: type
    pinned: tuple[int, int] = (0, 0)
    deferred_batchnorm: bool = False
    row_mask: int | None = None
    classifier: bool = True
    step_records: bool = False
    links: tuple[Link, ...] = LINKS
    metric: str
    metric_names: tuple[str, ...]

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    @classmethod
    def check(cls, config: RunConfig) -> Any:
        """Validate the job's flags, data and model in the launching process.

        Returns:
            ``config.job`` with the defaults that depend on the rest resolved (an
            instance of :attr:`options`).
        Raises:
            ValueError: with the fix.
        """
        raise NotImplementedError

    def build_layers(self) -> list[nn.Module]:
        """The whole model as an ordered layer list (same initialisation on every rank:
        the loop seeds torch first)."""
        raise NotImplementedError

    def shape_stages(self, stages: list[nn.Module]) -> list[nn.Module]:
        """The partition's stages as the job trains them (same on every rank): unchanged by default; a job may
        add layers at the boundaries (the LM job's bottlenecks)."""
        return stages

    def raw_scale(self, boundary: str) -> float:
        """What the logs multiply ``boundary``'s raw bytes by (1 by default): the model's width over the channels
        that cross where the job narrowed a boundary (:meth:`shape_stages`), so that bits a value and wire/raw
        count against what the model without it would send."""
        return 1.0

    def loaders(self, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
        """``(train, eval)`` loaders yielding ``(inputs, targets)``.

        ``world_size > 1`` shards the training set for data parallelism (each rank gets
        ``batch_size / world_size`` per step); the eval loader always covers the whole
        evaluation set.
        """
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of a (micro-)batch: a scalar tensor."""
        raise NotImplementedError

    def eval_outputs(self, output: torch.Tensor, target) -> torch.Tensor:
        """What the evaluation keeps of one batch's outputs for :meth:`metrics` (on the last stage's
        rank): the outputs themselves by default; a job whose outputs are large (a language model's
        logits) reduces them here."""
        return output

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Validation metrics of the whole evaluation set, keyed by :attr:`metric_names`, from the
        concatenated :meth:`eval_outputs` and targets."""
        raise NotImplementedError

    def optimizer(self, params: Iterable[nn.Parameter], total_steps: int, steps_per_epoch: int,
                  momentum_in_codec: bool = False
                  ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The optimizer over ``params`` and its per-step learning-rate schedule.

        Args:
            total_steps: optimizer steps of the whole run (schedule length).
            steps_per_epoch: optimizer steps per epoch (for warm-up in epochs).
            momentum_in_codec: the gradient codec applies momentum itself (DGC): build the
                optimizer without it.
        """
        raise NotImplementedError
