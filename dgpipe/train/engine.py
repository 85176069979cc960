"""Engines: one rank's way of running a training step -- the compressed pipeline or DDP.

Both give the training loop (:mod:`dgpipe.train.loop`) the same small interface, so
``--mode pipeline`` and ``--mode dataparallel`` share every line of the loop:

- ``train_step(inputs, targets, sample_ids=None) -> float`` (gradients accumulated, the
  caller steps the optimizer), ``eval_step(inputs, targets=None) -> outputs or None`` (the
  targets only where a schedule computes its loss in evaluation too);
- ``reads_data`` (whether this rank iterates the data loaders), ``output_rank`` (the
  rank whose evaluation outputs are scored);
- ``parameters()``, ``meter`` (a :class:`~dgpipe.comm.BandwidthMeter` of the traffic:
  stage boundaries, or the DDP gradient exchange), ``state_dict()``/``load_state_dict()``,
  ``delta_boundaries`` (names of the delta-coded boundaries, for the logs) and
  ``delta_stats()`` (a collective: their coded-change and error energies) and
  ``step_profile(records)`` (a collective: the tasks and messages of a step, which the link
  projection of :mod:`dgpipe.train.compare` plays out; dgpipe's pipeline only).

:func:`reads_data` says, from the pipeline config alone, which ranks iterate the data loaders, so
that the loaders (and the training set's size, which delta caches need) exist before
the engine.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dgpipe.comm import BandwidthMeter, wire_device
from dgpipe.compression import CodecSpec, raise_deferred
from dgpipe.compression.wrappers.delta import CACHE_DTYPES, DeltaSpec
from dgpipe.compression.wrappers.reference import TokenReference
from dgpipe.models import Stage, client_server_split
from dgpipe.pipeline import BoundarySpec, Pipeline, balance_by_params, client_server_placement, split_layers
from dgpipe.pipeline.boundary import boundary_name
from dgpipe.pipeline.schedule import segments
from dgpipe.pipeline.timeline import StepProfile
from dgpipe.pipeline.tied import TiedParameters, unique_parameters

from .config import PipelineConfig, RunConfig
from .job import Job
from .precision import LossScale, prepare_stages

__all__ = ["partition", "placement", "reads_data", "warm_up_codecs", "PipelineEngine", "TorchScheduleEngine",
           "DataParallelEngine", "make_engine"]


def placement(pipeline: PipelineConfig) -> list[int]:
    """Rank of every stage: ``[0, 1, 0]`` client/server; stage i on rank ``i % world_size`` linear
    (also what torch's GPipe, 1F1B and looped schedules expect)."""
    if pipeline.partition == "client-server":
        return client_server_placement()
    return [i % pipeline.world_size for i in range(pipeline.stages)]


def reads_data(pipeline: PipelineConfig, rank: int) -> bool:
    """Whether ``rank`` iterates the loaders: every DDP rank; the pipeline ranks holding the
    first stage (inputs) or the last (targets). Rank 0 always does."""
    if pipeline.mode != "pipeline":
        return True
    stages = placement(pipeline)
    return rank in (stages[0], stages[-1])


def partition(layers: list[nn.Module], pipeline: PipelineConfig,
              pinned: tuple[int, int]) -> tuple[list[nn.Module], list[int]]:
    """Stages and placement from the partition flags.

    client-server: ``[client front, server middle, client back]`` on ranks ``[0, 1, 0]``
    (``--client-layers`` at each end plus the job's ``pinned`` layers). linear:
    ``--stages`` consecutive stages, ``--balance`` layers each (default: even parameter
    counts), stage i on rank ``i % world_size``.
    """
    if pipeline.partition == "client-server":
        return client_server_split(layers, pipeline.client_layers, pinned), placement(pipeline)
    balance = list(pipeline.balance) if pipeline.balance else balance_by_params(layers, pipeline.stages)
    return split_layers(layers, balance), placement(pipeline)


#: Shapes :func:`warm_up_codecs` codes: a message of whole kernel chunks and two small ones
#: (a micro-batch of short sequences), which take the kernels' other paths.
WARM_UP_SHAPES = ((4, 4096), (4, 20, 384), (20, 384))


def warm_up_codecs(specs: Sequence[CodecSpec], device: torch.device) -> None:
    """Encode and decode random float32 tensors of :data:`WARM_UP_SHAPES` on ``device`` once
    with each codec of ``specs``, on this rank alone, so that the kernels' one-time
    compilation (Triton on CUDA: seconds) happens before training is timed."""
    generator = torch.Generator().manual_seed(0)
    distinct = [spec for i, spec in enumerate(specs) if spec not in specs[:i]]
    for spec in distinct:
        codec = spec.build()
        for shape in WARM_UP_SHAPES:
            codec.decode(codec.encode(torch.randn(shape, generator=generator).to(device)))


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    return tuple(t.to(device, non_blocking=True) for t in value)


class PipelineEngine:
    """This rank's part of the compressed GPipe pipeline (:class:`dgpipe.pipeline.Pipeline`).

    Every rank calls every step (a collective). Stage 0's rank reads inputs, the last
    stage's rank reads targets and ends with the evaluation outputs. With ``--delta``
    every boundary's activations are delta-coded against caches of ``train_examples``
    examples (:class:`~dgpipe.compression.wrappers.delta.DeltaSpec`), the first
    ``--delta-warmup-epochs`` epochs uncompressed.
    """

    def __init__(self, job: Job, layers: list[nn.Module], config: RunConfig, rank: int,
                 device: torch.device, train_examples: int | None = None) -> None:
        p, d = config.pipeline, config.delta
        stages, self.placement = partition(layers, p, job.pinned)
        stages = prepare_stages(job.shape_stages(stages), config.train.precision, config.train.activation_checkpointing)
        self.layers_per_stage = [len(list(s.children())) for s in stages]
        self.loss_scale = LossScale(config.train.precision == "fp16")
        self._warmup_epochs = d.delta_warmup_epochs if d.delta else 0
        delta = None
        if d.delta:
            delta = DeltaSpec(train_examples, cache_dtype=CACHE_DTYPES[d.delta_cache_dtype],
                              cache_dir=d.delta_cache_dir, max_bytes=int(d.delta_cache_limit * 2**30))
        comp = config.codec.compression
        warm_up_codecs((comp.forward, comp.backward), device)
        self.pipe = Pipeline(
            stages, self.placement, rank, chunks=p.chunk, loss_fn=self.loss_scale.scaled(job.loss),
            act_codec=comp.forward, grad_codec=comp.backward,
            device=device, timeout=p.timeout,
            deferred_batchnorm=job.deferred_batchnorm, delta_report=lambda line: print(line, flush=True),
            boundary=BoundarySpec(
                compress_eval=p.compress_eval, delta=delta,
                example_ids=train_examples if d.example_dropout else None,
                row_mask=job.row_mask if p.skip_padding else None,
                token_reference=TokenReference(job.vocab, scale=p.token_reference_scale,
                                               backoff=p.token_reference_backoff) if p.token_reference else None,
                link_delay=p.link_delay_ms / 1000),
        )
        self.meter = self.pipe.meter
        self.reads_data = self.pipe.holds_first_stage or self.pipe.holds_last_stage
        self.output_rank = self.placement[-1]
        self.delta_boundaries = self.pipe.delta_boundaries
        self.momentum_in_codec = False

    def describe(self) -> str:
        """One line: stages, layers per stage, placement."""
        return f"{len(self.placement)} stages with {self.layers_per_stage} layers on ranks {self.placement}"

    def parameters(self):
        return self.pipe.parameters()

    def train_step(self, inputs, targets, sample_ids=None) -> float:
        """GPipe step; returns the mini-batch's mean loss (the same on every rank)."""
        return self.pipe.train_step(inputs, targets, sample_ids=sample_ids) / self.loss_scale.scale

    def eval_step(self, inputs, targets=None):
        """Outputs on the last stage's rank, None elsewhere (``targets`` unused)."""
        return self.pipe.eval_step(inputs)

    def mean_loss(self, loss_sum: float, steps: int) -> float:
        """The epoch's mean training loss (the pipeline's losses are already global)."""
        return loss_sum / max(steps, 1)

    def delta_stats(self) -> dict[str, dict[str, float]]:
        """Per delta-coded boundary, since the last call, relative to the activations' energy
        ``sum a^2``: ``delta_change_rel`` = ``sum (a - m)^2`` (what was coded: 1 for a first
        visit, small when activations drift little between visits) and ``delta_error_rel`` =
        ``sum (a - r)^2`` (the reconstruction error). A collective (one all-reduce)."""
        names = self.delta_boundaries
        if not names:
            return {}
        sums = self.pipe.take_delta_stats().to(wire_device())
        dist.all_reduce(sums)
        sums = sums.cpu()
        return {n: {"delta_change_rel": float(s[1] / s[0]) if s[0] > 0 else None,
                    "delta_error_rel": float(s[2] / s[0]) if s[0] > 0 else None} for n, s in zip(names, sums)}

    def step_profile(self, records: list[dict] | None) -> StepProfile | None:
        """The mean task seconds of every segment since the last call (all ranks', one all-reduce) and the mean
        bytes of a message over each boundary and direction, from the gathered meter ``records`` (payloads and
        framing). A collective; returns the profile where ``records`` is given (the rank that gathered the
        meter), None elsewhere or when a segment ran no task."""
        sums = self.pipe.take_task_seconds().to(wire_device())
        dist.all_reduce(sums)
        seconds, count = sums.cpu().unbind(0)
        if records is None or not bool((count > 0).all()):
            return None
        segs = segments(self.placement)
        per = {(r["name"], r["direction"]): (r["wire_bytes"] + r["frame_bytes"]) / max(r["count"], 1)
               for r in records}
        names = [boundary_name(seg.last) for seg in segs[:-1]]
        mean = (seconds / count).tolist()
        return StepProfile(tuple(seg.rank for seg in segs), self.pipe.chunks, tuple(mean[0]), tuple(mean[1]),
                           tuple(per.get((n, "forward"), 0.0) for n in names),
                           tuple(per.get((n, "backward"), 0.0) for n in names))

    def set_epoch(self, epoch: int) -> None:
        """Delta warm-up (lossless, cached) during the first ``--delta-warmup-epochs`` epochs."""
        self.pipe.delta_warmup = epoch < self._warmup_epochs

    def state_dict(self) -> dict:
        return self.pipe.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.pipe.load_state_dict(state)


def _padded(value, size: int):
    """A batch (tensor or tuple of tensors) grown to ``size`` rows by repeating its last row."""
    if value is None or not isinstance(value, torch.Tensor):
        return value if value is None else tuple(_padded(t, size) for t in value)
    return torch.cat([value, value[-1:].expand(size - len(value), *value.shape[1:])])


class TorchScheduleEngine:
    """This rank's stages under a torch schedule (``--engine torch --schedule ...``), each a
    :class:`~dgpipe.pipelining.CompressedPipelineStage` with the run's codecs.

    torch's stages keep the shapes of their first step: training batches are whole (the
    loaders drop a last partial batch) and a partial evaluation batch is padded to
    ``batch_size`` by repeating its last example, the extra outputs dropped. The step's
    loss is the mean of the last stage's micro-batch losses, broadcast to every rank.
    """

    def __init__(self, job: Job, layers: list[nn.Module], config: RunConfig, rank: int,
                 device: torch.device) -> None:
        from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                  ScheduleInterleavedZeroBubble, ScheduleLoopedBFS)

        from dgpipe.pipelining import CompressedPipelineStage, PositionalStage

        p = config.pipeline
        stages, self.placement = partition(layers, p, job.pinned)
        stages = prepare_stages(job.shape_stages(stages), config.train.precision, config.train.activation_checkpointing)
        self.layers_per_stage = [len(list(s.children())) for s in stages]
        self.loss_scale = LossScale(config.train.precision == "fp16")
        mine = [i for i, r in enumerate(self.placement) if r == rank]
        comp = config.codec.compression
        warm_up_codecs((comp.forward, comp.backward), device)
        self.meter = BandwidthMeter()
        self.modules = {i: stages[i].to(device) for i in mine}
        tied = TiedParameters(stages, self.placement, rank)
        # one stage here: the stage sums the tied gradients at the step's end; several: this engine, after the step
        self._tied_after_step = tied if len(mine) > 1 else None
        self.stages = [CompressedPipelineStage(PositionalStage(self.modules[i]), i, len(stages), device,
                                               act_codec=comp.forward, grad_codec=comp.backward, meter=self.meter,
                                               tied=None if len(mine) > 1 else tied)
                       for i in mine]
        kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                 "looped-bfs": ScheduleLoopedBFS, "interleaved-zb": ScheduleInterleavedZeroBubble}
        self.schedule = kinds[p.schedule](self.stages if len(self.stages) > 1 else self.stages[0], p.chunk,
                                          loss_fn=self.loss_scale.scaled(job.loss))
        self.first, self.last = 0 in mine, len(stages) - 1 in mine
        self.device, self.batch_size = device, config.data.batch_size
        self.reads_data = self.first or self.last
        self.output_rank = self.placement[-1]
        self.delta_boundaries: list[str] = []
        self.momentum_in_codec = False

    def describe(self) -> str:
        return (f"torch {self.schedule.__class__.__name__}, {len(self.placement)} stages with "
                f"{self.layers_per_stage} layers on ranks {self.placement}")

    def parameters(self):
        """This rank's parameters, each once (tied embeddings on one rank are one parameter)."""
        return list(unique_parameters(list(self.modules.values())))

    def _run(self, run, inputs, targets, **extra):
        args = ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)) if self.first else ()
        args = tuple(_to(a, self.device) for a in args)
        kwargs = {"target": _to(targets, self.device), **extra} if self.last and targets is not None else {}
        return run(*args, **kwargs)

    def train_step(self, inputs, targets, sample_ids=None) -> float:
        """One step of the schedule; returns the mini-batch's mean loss (the same on every rank)."""
        for m in self.modules.values():
            m.train()
        losses: list[torch.Tensor] = []
        self._run(self.schedule.step, inputs, targets, **({"losses": losses} if self.last else {}))
        raise_deferred()  # a grid received on a device that was not finite (the decoders read nothing back)
        if self._tied_after_step:
            self._tied_after_step.sum_gradients()
        loss = torch.tensor([float(torch.stack(losses).detach().mean()) if self.last else 0.0], dtype=torch.float64,
                            device=wire_device())
        dist.broadcast(loss, self.output_rank)
        return float(loss) / self.loss_scale.scale

    def eval_step(self, inputs, targets=None):
        """Outputs on the last stage's rank, None elsewhere (a partial batch padded, then trimmed).
        torch's schedules compute the loss in evaluation too: the last stage's rank needs ``targets``."""
        for m in self.modules.values():
            m.eval()
        n = None if inputs is None else len(inputs if isinstance(inputs, torch.Tensor) else inputs[0])
        if n is not None and n < self.batch_size:
            inputs, targets = _padded(inputs, self.batch_size), _padded(targets, self.batch_size)
        for s in self.stages:
            s.evaluating = True
        try:
            with torch.no_grad():
                out = self._run(self.schedule.eval, inputs, targets)
            raise_deferred()
        finally:
            for s in self.stages:
                s.evaluating = False
        return out[:n] if self.last else None

    def mean_loss(self, loss_sum: float, steps: int) -> float:
        """The epoch's mean training loss (the step losses are already global)."""
        return loss_sum / max(steps, 1)

    def delta_stats(self) -> dict:
        """No delta coding under torch's schedules."""
        return {}

    def step_profile(self, records: list[dict] | None) -> None:
        """No task profile under torch's schedules (the projection counts latencies instead)."""
        return None

    def set_epoch(self, epoch: int) -> None:
        """Nothing changes between epochs."""

    def state_dict(self) -> dict:
        return {i: m.state_dict() for i, m in self.modules.items()}

    def load_state_dict(self, state: dict) -> None:
        for i, m in self.modules.items():
            m.load_state_dict(state[i])


class DataParallelEngine:
    """The DDP baseline (:func:`dgpipe.baseline.build_ddp`): the whole model on every rank,
    each rank on its shard of every batch, gradients averaged by the (optionally
    compressed) exchange hook. Every rank evaluates its (identical) replica on the whole
    evaluation set -- no rank waits for another in a collective meanwhile -- and rank 0's
    outputs are scored.
    """

    def __init__(self, job: Job, layers: list[nn.Module], config: RunConfig, rank: int,
                 device: torch.device) -> None:
        from dgpipe.baseline import build_ddp

        spec = config.codec.dp_compression
        self.job, self.device = job, device
        self.model = prepare_stages([Stage(*layers)], config.train.precision, config.train.activation_checkpointing)[0]
        self.loss_scale = LossScale(config.train.precision == "fp16")
        self.dp = build_ddp(self.model, device, spec, seed=config.train.seed)
        self.model = self.dp.module.module
        self.meter = self.dp.meter
        self.reads_data = True
        self.output_rank = 0
        self.momentum_in_codec = self.dp.codec_applies_momentum
        self._compression = spec
        self.delta_boundaries: list[str] = []

    def describe(self) -> str:
        return f"DDP on {dist.get_world_size()} processes, gradient exchange {self._compression or 'all-reduce'}"

    def parameters(self):
        return self.dp.module.parameters()

    def train_step(self, inputs, targets, sample_ids=None) -> float:
        """Forward and backward of this rank's shard; returns its loss (``sample_ids`` unused)."""
        self.dp.module.train()
        loss = self.job.loss(self.dp.module(_to(inputs, self.device)), _to(targets, self.device))
        (loss * self.loss_scale.scale).backward()
        raise_deferred()  # a gradient payload decoded on a device with a grid that was not finite
        return float(loss.detach())

    def eval_step(self, inputs, targets=None):
        """Outputs of the replica (no gradient exchange; ``targets`` unused)."""
        self.model.eval()
        with torch.no_grad():
            return self.model(_to(inputs, self.device))

    def mean_loss(self, loss_sum: float, steps: int) -> float:
        """Mean over ranks of the epoch's mean loss (one all-reduce)."""
        buf = torch.tensor([loss_sum / max(steps, 1)], dtype=torch.float64, device=wire_device())
        dist.all_reduce(buf)
        return float(buf) / dist.get_world_size()

    def set_epoch(self, epoch: int) -> None:
        self.dp.set_epoch(epoch)

    def delta_stats(self) -> dict:
        """No delta coding in DDP."""
        return {}

    def step_profile(self, records: list[dict] | None) -> None:
        """No pipeline tasks in DDP."""
        return None

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "hook": self.dp.hook_state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.dp.load_hook_state_dict(state["hook"])


def make_engine(job: Job, layers: list[nn.Module], config: RunConfig, rank: int, device: torch.device,
                train_examples: int | None = None) -> PipelineEngine | TorchScheduleEngine | DataParallelEngine:
    """The engine of ``config.pipeline.mode`` and ``engine`` (``train_examples``: the training set's size,
    for delta caches)."""
    if config.pipeline.mode == "pipeline" and config.pipeline.engine == "torch":
        return TorchScheduleEngine(job, layers, config, rank, device)
    if config.pipeline.mode == "pipeline":
        return PipelineEngine(job, layers, config, rank, device, train_examples)
    return DataParallelEngine(job, layers, config, rank, device)
