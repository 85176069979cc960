"""The validation of the main jobs' flags: parsed flags -> a frozen :class:`~dgpipe.train.config.RunConfig`.

The CLIs (``test_vision_dgpipe.py``, ``test_nlp_dgpipe.py``, ``test_lm_dgpipe.py``) start from
:func:`.flags.common_parser`, add their model-specific flags, then call :func:`run_config`, which checks
them and returns the frozen config. Validation raises :class:`ValueError` whose message says what is wrong
*and how to fix it*; the CLIs turn it into ``parser.error`` so that every argument error is reported before
any process starts.

Usage::

    parser = common_parser("my job", batch_size=128, lr=0.1, epochs=10, client_layers=1,
                           data_dir=None, data_dir_help="...", epilog="example: ...")
    parser.add_argument("--dataset", choices=["cifar10", "cifar100"], default="cifar10")
    config = run_config(parser.parse_args(), VisionOptions)   # ValueError with the fix
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from . import checkpoint
from .codecs import SETTINGS, BoundaryCompression, boundary_compression, grad_compression, setting_label
from .config import RunConfig
from .flags import LOOPED_SCHEDULES
from .placement import all_cuda, dist_env, parse_devices, placement_backend, shared_gpu
from .precision import check_precision

__all__ = ["run_config", "check_resume"]




def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be positive, got {value}")


def _balance(args: argparse.Namespace) -> tuple[int, ...] | None:
    if args.balance is None:
        return None
    try:
        balance = tuple(int(x) for x in args.balance.split(","))
    except ValueError:
        raise ValueError(f"--balance {args.balance!r}: give layers per stage as integers, e.g. --balance "
                         "3,10,5") from None
    if any(b < 1 for b in balance):
        raise ValueError(f"--balance {args.balance}: every stage needs at least one layer")
    return balance


def _check_delta(args: argparse.Namespace) -> None:
    """The --delta flags: a warm-up >= 0, a positive limit, a writable cache directory, and
    no delta flag without --delta."""
    if not args.delta:
        given = [f for f, v in (("--delta-warmup-epochs", args.delta_warmup_epochs),
                                ("--delta-cache-dir", args.delta_cache_dir)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} configure --delta; add --delta")
        return
    if args.delta_warmup_epochs < 0:
        raise ValueError(f"--delta-warmup-epochs must be >= 0, got {args.delta_warmup_epochs}")
    if not args.delta_cache_limit > 0:
        raise ValueError(f"--delta-cache-limit must be a positive number of GiB, got {args.delta_cache_limit}")
    if args.delta_cache_dir is not None:
        path = Path(args.delta_cache_dir).resolve()
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            raise ValueError(f"--delta-cache-dir {args.delta_cache_dir}: cannot create files under {existing}; "
                             "choose a writable directory")


def _check_token_reference(args: argparse.Namespace) -> None:
    """--token-reference codes whole tensors directly: not with --delta or --skip-padding."""
    if not args.token_reference:
        return
    clash = [f for f, v in (("--delta", args.delta), ("--skip-padding", args.skip_padding)) if v]
    if clash:
        raise ValueError(f"--token-reference does not combine with {', '.join(clash)} (it codes whole tensors "
                         "directly)")


def _torch_schedule(args: argparse.Namespace) -> str | None:
    """``--schedule`` resolved for ``--engine torch`` (None for dgpipe's runtime), after checking the
    flags torch's schedules cannot serve; :func:`_check_torch_stages` checks the stage count."""
    if args.engine != "torch":
        if args.schedule:
            raise ValueError(f"--schedule {args.schedule} chooses a torch schedule: add --engine torch")
        return None
    schedule = args.schedule or "1f1b"
    if schedule == "zbv":
        raise ValueError("--schedule zbv: the jobs evaluate every epoch, and the eval of torch's V schedules "
                         "(ScheduleZBVZeroBubble, ScheduleDualPipeV) fails: their V stages on one rank hand over "
                         "backward inputs even without a backward. Train with them through "
                         "dgpipe.pipelining.CompressedPipelineStage, or use --schedule interleaved-zb")
    if args.partition != "linear":
        raise ValueError("--engine torch runs a linear partition (torch's schedules place stage i on rank "
                         "i % world size): add --partition linear")
    if args.delta or args.example_dropout:
        raise ValueError(f"{'--delta' if args.delta else '--example-dropout'} needs the examples' ids at every "
                         "boundary, which torch's schedules do not pass: use --engine dgpipe")
    if args.link_delay_ms:
        raise ValueError("--link-delay holds back the messages of dgpipe's runtime: use --engine dgpipe")
    if args.skip_padding or args.token_reference:
        raise ValueError(f"{'--skip-padding' if args.skip_padding else '--token-reference'} is dgpipe's runtime "
                         "(its boundaries carry the attention mask and token ids): use --engine dgpipe")
    if not args.compress_eval:
        raise ValueError("--no-compress-eval: with --engine torch evaluation crosses the boundaries through the "
                         "training codecs; drop the flag or use --engine dgpipe")
    return schedule


def _check_torch_stages(schedule: str, stages: int, world_size: int, chunk: int) -> None:
    """One stage per rank for GPipe and 1F1B; a multiple of the world size, at least two per rank,
    for the looped schedules, whose micro-batches must also split evenly over the ranks."""
    looped = schedule in LOOPED_SCHEDULES
    if (stages % world_size or stages < 2 * world_size) if looped else stages != world_size:
        need = "a multiple of the world size, at least twice it" if looped else f"one per rank, {world_size}"
        raise ValueError(f"--schedule {schedule} with {world_size} processes needs {need} stages, not {stages}; "
                         "set --stages or --balance accordingly")
    if looped and chunk % world_size:
        raise ValueError(f"--schedule {schedule} needs --chunk a multiple of the world size {world_size}, "
                         f"not {chunk}")


def _compare_to(args: argparse.Namespace, compression: BoundaryCompression) -> tuple[str, ...]:
    """``--compare-to`` as a tuple of labels of :data:`~dgpipe.train.codecs.SETTINGS` (empty without it)."""
    if args.compare_to is None:
        return ()
    labels = tuple(x.strip() for x in args.compare_to.split(",") if x.strip())
    unknown = [x for x in labels if x not in SETTINGS]
    if not labels or unknown or len(set(labels)) != len(labels):
        raise ValueError(f"--compare-to {args.compare_to!r}: give distinct settings out of {', '.join(SETTINGS)}, "
                         "e.g. --compare-to none,codebook4")
    own = setting_label(compression)
    if own in labels:
        raise ValueError(f"--compare-to {own}: the command's own compression flags already select {own}")
    if args.save or args.resume:
        raise ValueError("--compare-to trains several settings in a row; --save/--resume checkpoint one run: "
                         "drop them or run the settings one at a time")
    return labels


def _check_checkpoint_flags(args: argparse.Namespace) -> None:
    """``--save-every``, ``--keep-checkpoints`` and ``--resume`` make sense together."""
    if args.save_every is not None and args.save is None:
        raise ValueError("--save-every needs --save DIR (where the checkpoints go)")
    if args.keep_checkpoints < 2:
        raise ValueError(f"--keep-checkpoints must be >= 2, got {args.keep_checkpoints}: a checkpoint cut short "
                         "by a crash must leave the one before it")
    if args.resume == "auto" and args.save is None:
        raise ValueError("--resume auto continues from --save's directory; add --save DIR")
    if args.resume not in (None, "auto") and not checkpoint.steps(args.resume):
        raise ValueError(f"--resume {args.resume}: no checkpoint there (no step-* folder); pass a directory "
                         "written by --save, or --resume auto to start fresh when there is none")


def check_resume(config: RunConfig) -> None:
    """The checkpoint a run resumes (rank 0's newest, where this machine has one) was saved by a run
    with the same settings (:func:`~dgpipe.train.checkpoint.config_difference`); call with the final
    config (job options resolved).

    Raises:
        ValueError: another world size or mode, or other settings (named, saved -> now).
    """
    resume = config.log.resume
    if resume is None:
        return
    directory = config.log.save if resume == "auto" else resume
    meta = checkpoint.latest_meta(directory)
    if meta is None:
        return
    if meta["world_size"] != config.pipeline.world_size or meta["mode"] != config.pipeline.mode:
        raise ValueError(f"--resume {resume}: the checkpoint was saved by {meta['world_size']} processes in "
                         f"{meta['mode']} mode; resume with --world-size {meta['world_size']} --mode {meta['mode']}")
    diff = checkpoint.config_difference(meta["args"], config.to_json())
    if diff is not None:
        raise ValueError(f"--resume {resume}: the checkpoint of step {meta['step']} in {directory} was saved "
                         f"with other settings: {diff}; resume with the saved settings")


def _pipeline_derived(args: argparse.Namespace, world_size: int) -> dict:
    """Check the flags of ``--mode pipeline``; returns what they mean: the balance, the torch schedule, the stages,
    the boundary compression and the compared settings.

    Raises:
        ValueError: the first problem found, with the flag to change.
    """
    derived: dict = {"balance": None, "stages": args.stages}
    if args.chunk > args.batch_size:
        raise ValueError(f"--chunk {args.chunk} micro-batches is more than --batch-size {args.batch_size} "
                         f"examples; use --chunk <= {args.batch_size}")
    if args.batch_size % args.chunk:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by --chunk {args.chunk}; "
                         f"use e.g. --batch-size {args.batch_size - args.batch_size % args.chunk or args.chunk}")
    if args.grad_compression or args.grad_compression_opt:
        raise ValueError("--grad-compression compresses the DDP gradient exchange: add --mode dataparallel, "
                         "or use --sortquant/--quant/--codec for pipeline boundaries")
    balance = derived["balance"] = _balance(args)
    schedule = derived["schedule"] = _torch_schedule(args)
    if args.partition == "client-server":
        if world_size != 2:
            raise ValueError(f"--partition client-server runs on exactly 2 processes, not {world_size}; "
                             "use --world-size 2 or --partition linear")
        if args.stages is not None or balance is not None:
            raise ValueError("--stages/--balance apply to --partition linear; "
                             "client-server is set by --client-layers")
    else:
        per_rank = 2 if schedule in LOOPED_SCHEDULES else 1
        stages = derived["stages"] = args.stages or (len(balance) if balance else per_rank * world_size)
        if stages < world_size:
            raise ValueError(f"--stages {stages} leaves processes idle with --world-size "
                             f"{world_size}; use --stages >= {world_size}")
        if balance is not None and len(balance) != stages:
            raise ValueError(f"--balance lists {len(balance)} stages but --stages is {stages}")
        if schedule:
            _check_torch_stages(schedule, stages, world_size, args.chunk)
    compression = derived["compression"] = boundary_compression(args)
    derived["dp_compression"] = None
    _check_delta(args)
    _check_token_reference(args)
    derived["compare_to"] = _compare_to(args, compression)
    return derived


def _dataparallel_derived(args: argparse.Namespace, world_size: int) -> dict:
    """Check the flags of ``--mode dataparallel`` (no pipeline flag applies); returns the DDP gradient compression.

    Raises:
        ValueError: the first problem found, with the flag to change.
    """
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by --world-size {world_size} "
                         "(dataparallel splits each batch over the processes); "
                         f"use e.g. --batch-size {args.batch_size - args.batch_size % world_size or world_size}")
    pipeline_flags = [f for f, v in (("--sortquant", args.sortquant), ("--quant", args.quant),
                                     ("--split", args.split), ("--codec", args.codec),
                                     ("--grad-quant", args.grad_quant), ("--grad-split", args.grad_split),
                                     ("--grad-codec", args.grad_codec)) if v]
    if pipeline_flags:
        raise ValueError(f"{', '.join(pipeline_flags)} compress pipeline boundaries; in --mode dataparallel "
                         "use --grad-compression NAME (e.g. --grad-compression sortquant "
                         "--grad-compression-opt quant_bits=6 --grad-compression-opt split_bits=2)")
    if args.delta:
        raise ValueError("--delta codes pipeline boundaries; it has no meaning in --mode dataparallel")
    if args.example_dropout:
        raise ValueError("--example-dropout sends sample ids along the pipeline; use --mode pipeline")
    if args.skip_padding or args.token_reference:
        raise ValueError(f"{'--skip-padding' if args.skip_padding else '--token-reference'} works on pipeline "
                         "boundaries; use --mode pipeline")
    if args.compare_to:
        raise ValueError("--compare-to compares pipeline boundary settings; drop it in --mode dataparallel")
    if args.link_delay_ms:
        raise ValueError("--link-delay holds back pipeline boundary messages; drop it in --mode dataparallel")
    if args.engine != "dgpipe" or args.schedule:
        raise ValueError("--engine/--schedule choose a pipeline runtime; drop them in --mode dataparallel")
    return {"compare_to": (), "compression": None, "dp_compression": grad_compression(args)}


def run_config(args: argparse.Namespace, job_options: type, environ: dict | None = None) -> RunConfig:
    """Check the parsed flags, derive what they mean, and freeze them into a :class:`RunConfig`,
    before any process starts. ``args`` is read, not changed.

    Derived: ``pipeline.world_size`` (resolved with torchrun's), ``pipeline.stages`` (linear
    default), ``pipeline.balance`` (a tuple or None), ``codec.compression`` (a
    :class:`~dgpipe.train.codecs.BoundaryCompression`, pipeline mode), ``codec.dp_compression``
    (a :class:`~dgpipe.baseline.GradCompression` or None) and ``codec.compare_to`` (a tuple of
    setting labels, empty without ``--compare-to``). ``job_options``: the job's own flags' type.

    Raises:
        ValueError: the first problem found, with the flag to change.
    """
    _positive(args, "batch_size", "chunk", "epochs", "lr", "max_steps", "eval_every", "train_subset", "eval_subset",
              "client_layers", "stages", "world_size", "timeout", "save_every")
    if args.num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {args.num_workers}")
    if not args.link_delay_ms >= 0:
        raise ValueError(f"--link-delay must be >= 0 milliseconds, got {args.link_delay_ms}")
    _check_checkpoint_flags(args)
    for flag, on in (("--token-reference-scale", args.token_reference_scale),
                     ("--token-reference-backoff", args.token_reference_backoff)):
        if on and not args.token_reference:
            raise ValueError(f"{flag} is an option of --token-reference: add --token-reference")
    world_size = dist_env(args.world_size, environ).world_size
    derived: dict = {"world_size": world_size, "balance": None, "stages": args.stages}
    derived.update(_pipeline_derived(args, world_size) if args.mode == "pipeline"
                   else _dataparallel_derived(args, world_size))

    if args.train_subset is not None and args.train_subset < args.batch_size:
        raise ValueError(f"--train-subset {args.train_subset} is smaller than one batch (--batch-size "
                         f"{args.batch_size}); use --train-subset >= {args.batch_size} or a smaller batch")
    config = RunConfig.from_flags({**vars(args), **derived}, job_options)
    pipeline = config.pipeline
    check_precision(config.train.precision, parse_devices(pipeline.devices, world_size))
    if placement_backend(pipeline, environ) == "nccl":
        if not all_cuda(pipeline):
            raise ValueError("--backend nccl needs a CUDA device on every rank; use --backend gloo with CPU ranks")
        if shared_gpu(pipeline, environ):
            raise ValueError("NCCL cannot run two ranks on one GPU; use --backend gloo, or give each rank its own "
                             "device, e.g. --devices cpu,cuda:0 (CPU client, GPU server)")
    _check_writable(args)
    return config


def _check_writable(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` where ``--log`` or ``--save`` could not be created (its nearest existing folder is not
    a writable directory)."""
    for flag, path in (("--log", args.log), ("--save", args.save)):
        if path is not None:
            parent = Path(path).resolve().parent
            existing = next(p for p in (parent, *parent.parents) if p.exists())
            if not existing.is_dir() or not os.access(existing, os.W_OK):
                raise ValueError(f"{flag} {path}: cannot create it under {existing}; choose a writable path")
