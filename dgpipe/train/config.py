"""The run config: a main job's settings, typed and frozen, in parts.

The CLIs parse flags (:func:`dgpipe.train.flags.common_parser` plus the job's own),
:func:`dgpipe.train.args.run_config` checks them and derives what they mean (world
size, stages, codec specs), and from then on a :class:`RunConfig` is all that travels:
to every rank, into the engines and the job, into the logs. Nothing mutates it; a
variant (a compared setting, a sweep's run) is a new one made by :meth:`RunConfig.replace`.

Each part's fields are named as the flags' ``argparse`` destinations (``--delta-cache-dir``
is ``delta.delta_cache_dir``), so :meth:`RunConfig.to_json` gives the flat record the
logs have always carried under ``"args"``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Mapping

from dgpipe.baseline import GradCompression

from .codecs import BoundaryCompression

__all__ = ["PipelineConfig", "DataConfig", "TrainConfig", "CodecConfig", "DeltaConfig", "LogConfig", "RunConfig"]


@dataclass(frozen=True)
class PipelineConfig:
    """Processes, placement and the schedule's micro-batches.

    Attributes:
        mode: ``"pipeline"`` or ``"dataparallel"``.
        partition: ``"client-server"`` or ``"linear"``.
        client_layers: layers the client holds at each end (client-server).
        stages: stages of a linear partition (``None`` for client-server).
        balance: layers per stage of a linear partition, or ``None`` (by parameter counts).
        world_size: processes.
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"`` as given (see :func:`~.placement.placement_backend`).
        devices: ``--devices`` as given, or ``None`` (the default rule).
        chunk: micro-batches per mini-batch.
        timeout: seconds a peer may stay silent before every rank ends with an error.
        compress_eval: evaluation crosses the boundaries through the training codecs.
        skip_padding: boundaries send only the real tokens' rows of an encoder's hidden states
            and of their gradients (:mod:`dgpipe.pipeline.boundary`).
        token_reference: coded hidden states cross boundaries as their residual against a per-token
            table both sides build from training messages; the token ids travel with them
            (:mod:`dgpipe.compression.wrappers.reference`).
        token_reference_scale: with ``token_reference``, each channel of the residual is also weighed by its
            running variance to the power -1/4 before coding (``TokenReference.scale``).
        token_reference_backoff: with ``token_reference``, a sequence's first position and tokens never seen
            read shared rows of the table (``TokenReference.backoff``).
        engine: ``"dgpipe"`` (this package's GPipe runtime) or ``"torch"`` (torch's schedules).
        schedule: torch schedule of the torch engine (``"gpipe"``, ``"1f1b"``,
            ``"interleaved"``, ``"zbv"``), ``None`` with dgpipe's.
        link_delay_ms: milliseconds every boundary message is held back before it is sent (an emulated
            one-way latency for benchmarks; 0: none).
    """

    mode: str
    partition: str
    client_layers: int
    stages: int | None
    balance: tuple[int, ...] | None
    world_size: int
    backend: str
    devices: str | None
    chunk: int
    timeout: float
    compress_eval: bool
    skip_padding: bool
    token_reference: bool
    token_reference_scale: bool
    token_reference_backoff: bool
    engine: str
    schedule: str | None
    link_delay_ms: float


@dataclass(frozen=True)
class DataConfig:
    """Where the examples come from and how many per step.

    Attributes:
        data_dir: the dataset's folder (``None``: the job's default source).
        train_subset, eval_subset: fixed class-stratified subsets, or ``None`` (all).
        num_workers: DataLoader worker processes per rank.
        batch_size: examples per optimizer step, all ranks together.
    """

    data_dir: str | None
    train_subset: int | None
    eval_subset: int | None
    num_workers: int
    batch_size: int


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation's length, rate and seed.

    Attributes:
        epochs: passes over the training set.
        lr: peak learning rate.
        max_steps: stop after this many optimizer steps, or ``None``.
        eval_every: also evaluate every this many optimizer steps, or ``None`` (after each epoch only).
        seed: seed of the initialisation, the subsets, the batch order and dropout.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the stages' autocast dtype (:mod:`dgpipe.train.precision`).
        activation_checkpointing: recompute each layer's activations in the backward pass instead of storing them.
    """

    epochs: int
    lr: float
    max_steps: int | None
    eval_every: int | None
    seed: int
    precision: str = "fp32"
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class CodecConfig:
    """What crosses the boundaries (pipeline) or the gradient exchange (data parallel): the flags
    as given and the specs they mean.

    Attributes:
        sortquant, quant, split, codec, codec_opt: the forward direction's flags.
        grad_quant, grad_split, grad_codec, grad_codec_opt: the backward direction's flags.
        grad_compression, grad_compression_opt: the DDP exchange's flags.
        compare_to: labels of :data:`~dgpipe.train.codecs.SETTINGS` to train beside this one.
        compression: both directions' codec specs (pipeline mode), else ``None``.
        dp_compression: the DDP exchange's spec (data-parallel mode with a compressor), else ``None``.
    """

    sortquant: bool
    quant: int | None
    split: int | None
    codec: str | None
    codec_opt: tuple[str, ...]
    grad_quant: int | None
    grad_split: int | None
    grad_codec: str | None
    grad_codec_opt: tuple[str, ...]
    grad_compression: str | None
    grad_compression_opt: tuple[str, ...]
    compare_to: tuple[str, ...]
    compression: BoundaryCompression | None
    dp_compression: GradCompression | None


@dataclass(frozen=True)
class DeltaConfig:
    """Delta coding of activations against per-example caches (:mod:`dgpipe.compression.wrappers.delta`).

    Attributes:
        delta: on or off.
        delta_warmup_epochs: first epochs sent uncompressed (and cached).
        delta_cache_dtype: name of the caches' dtype (a key of ``CACHE_DTYPES``).
        delta_cache_dir: memory-mapped caches under this folder, or ``None`` (in memory).
        delta_cache_limit: largest in-memory cache per boundary tensor and side, GiB.
        example_dropout: per-example dropout masks, the same at every visit
            (:mod:`dgpipe.models.example_dropout`); sample ids then travel with the micro-batches.
    """

    delta: bool
    delta_warmup_epochs: int
    delta_cache_dtype: str
    delta_cache_dir: str | None
    delta_cache_limit: float
    example_dropout: bool


@dataclass(frozen=True)
class LogConfig:
    """What the run writes and prints.

    Attributes:
        log: JSON-lines log path, or ``None``.
        bandwidth: print the per-boundary meter table each epoch.
        save: checkpoint directory, or ``None``; ``save_every``: also checkpoint every so many
            steps (``None``: per epoch only); ``keep_checkpoints``: how many are kept.
        resume: checkpoint directory to continue from, ``"auto"`` (``save``'s, if it holds one), or ``None``.
        progress: tqdm bars on rank 0.
    """

    log: str | None
    bandwidth: bool
    save: str | None
    save_every: int | None
    keep_checkpoints: int
    resume: str | None
    progress: bool


_PARTS = {"pipeline": PipelineConfig, "data": DataConfig, "train": TrainConfig, "codec": CodecConfig,
          "delta": DeltaConfig, "log": LogConfig}


@dataclass(frozen=True)
class RunConfig:
    """A main job's whole configuration (module docstring).

    Attributes:
        pipeline, data, train, codec, delta, log: the shared parts.
        job: the job's own flags, a frozen dataclass of the job's ``options`` type
            (e.g. :class:`~dgpipe.train.vision.VisionOptions`).
    """

    pipeline: PipelineConfig
    data: DataConfig
    train: TrainConfig
    codec: CodecConfig
    delta: DeltaConfig
    log: LogConfig
    job: Any

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], job_options: type) -> RunConfig:
        """Sort a flat mapping of flag destinations into the parts and ``job_options``.

        Lists become tuples. Raises:
            TypeError: a flag that no part has, or a part's field that ``flags`` lacks
                (a parser and the config out of step: a bug, not bad input).
        """
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in flags.items()}
        kinds = {**_PARTS, "job": job_options}
        parts, used = {}, set()
        for part, kind in kinds.items():
            names = [f.name for f in fields(kind)]
            missing = [n for n in names if n not in values]
            if missing:
                raise TypeError(f"run config part {part!r} lacks {', '.join(missing)}")
            parts[part] = kind(**{n: values[n] for n in names})
            used.update(names)
        unknown = sorted(set(values) - used)
        if unknown:
            raise TypeError(f"flags without a place in the run config: {', '.join(unknown)}")
        return cls(**parts)

    def replace(self, **changes: Mapping[str, Any]) -> RunConfig:
        """A copy with some fields of some parts changed, e.g.
        ``cfg.replace(log={"log": "b.jsonl"}, codec={"compression": spec})``."""
        return dataclasses.replace(self, **{part: dataclasses.replace(getattr(self, part), **values)
                                            for part, values in changes.items()})

    def to_json(self) -> dict[str, Any]:
        """Every field of every part as one flat dict of JSON values, keys sorted (codec specs as
        ``{"name", "options"}``, tuples as lists): the ``"args"`` of the logs."""
        out = {}
        for part in (*_PARTS, "job"):
            obj = getattr(self, part)
            for f in fields(obj):
                out[f.name] = _json(getattr(obj, f.name))
        return dict(sorted(out.items()))


def _json(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, tuple):
        return list(value)
    if value is not None and not isinstance(value, (str, int, float, bool, list, dict)):
        return str(value)
    return value
