"""Command-line flags shared by the main jobs, and their validation.

Both CLIs (``test_vision_dgpipe.py``, ``test_nlp_dgpipe.py``) start from
:func:`common_parser`, add their model-specific flags, then call
:func:`run_config`, which checks them and returns the frozen
:class:`~dgpipe.train.config.RunConfig`. Validation raises :class:`ValueError` whose message says
what is wrong *and how to fix it*; the CLIs turn it into ``parser.error`` so that
every argument error is reported before any process starts.

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


from dgpipe.compression.wrappers.delta import CACHE_DTYPES, DEFAULT_MAX_BYTES

from . import checkpoint
from .codecs import SETTINGS, BoundaryCompression, boundary_compression, grad_compression, setting_label
from .config import RunConfig
from .placement import all_cuda, dist_env, parse_devices, placement_backend, shared_gpu
from .precision import check_precision

__all__ = [
    "HelpFormatter",
    "JobParser",
    "common_parser",
    "run_config",
]

#: torch schedules of ``--engine torch`` whose stages loop over the ranks (stage i on rank i % W),
#: two or more per rank.
LOOPED_SCHEDULES = ("interleaved", "looped-bfs", "interleaved-zb")



class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default said once: ``(default: X)`` is appended unless the
    help text already says its default or the option has none to show (a switch that is off,
    ``None``, an empty list). Description and epilog keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        nothing = default is None or default is False or default is argparse.SUPPRESS or default == []
        if "%(default)" in text or "(default:" in text or nothing:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class JobParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose argument errors are one line plus a pointer to ``--help``
    (exit status 2), instead of the usage block and the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: see '{self.prog} --help' for the options\n")


def common_parser(
    description: str,
    *,
    batch_size: int,
    lr: float,
    epochs: int,
    client_layers: int,
    data_dir: str | None,
    data_dir_help: str,
    epilog: str | None = None,
    prog: str | None = None,
) -> JobParser:
    """A :class:`JobParser` holding every flag the main jobs share.

    Args:
        description: what the CLI does (a paragraph; its line breaks are kept).
        batch_size, lr, epochs, client_layers: the job's defaults for these flags.
        data_dir: default of ``--data-dir`` (``None``: no default).
        data_dir_help: help text of ``--data-dir`` (what layout the job reads).
        epilog: text after the options (examples).
        prog: the program's name in messages (default: the script's).

    Returns:
        a parser; the CLI adds its own flags (model, dataset, optimizer extras).
    """
    p = JobParser(prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter)

    c = p.add_argument_group("compression at stage boundaries (pipeline mode)")
    c.add_argument("--sortquant", action="store_true",
                   help="sort quantization of activations and gradients: --quant Q bits per level, "
                        "--split S bits per bucket index (Q+S bits per value)")
    c.add_argument("--quant", type=int, metavar="Q",
                   help="quant bits; without --sortquant: uniform Q-bit min-max quantization")
    c.add_argument("--split", type=int, metavar="S", help="split bits of --sortquant (2^S buckets)")
    c.add_argument("--codec", metavar="NAME", help="any registered codec for both directions")
    c.add_argument("--codec-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="option of --codec (repeatable), e.g. --codec-opt ratio=0.01")
    c.add_argument("--grad-quant", type=int, metavar="Q", help="backward direction: quant bits")
    c.add_argument("--grad-split", type=int, metavar="S", help="backward direction: split bits (sortquant)")
    c.add_argument("--grad-codec", metavar="NAME", help="backward direction: any registered codec")
    c.add_argument("--grad-codec-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="option of --grad-codec (repeatable)")
    c.add_argument("--compress-eval", action=argparse.BooleanOptionalAction, default=True,
                   help="evaluate through the training codecs, as split inference would run; "
                        "--no-compress-eval sends evaluation activations uncompressed")
    c.add_argument("--skip-padding", action="store_true",
                   help="nlp: send only the real tokens' rows of the hidden states and their gradients across "
                        "boundaries (padding rows arrive as zeros; exact, as attention masks them)")
    c.add_argument("--token-reference", action="store_true",
                   help="nlp: code the hidden states at each boundary as their residual against a per-token table "
                        "that both sides build from the training messages (the token ids travel too); cuts the "
                        "error of direct coding, in training and in evaluation through the link")
    c.add_argument("--token-reference-scale", action="store_true",
                   help="with --token-reference: also weigh each channel of the residual by its running variance "
                        "to the power -1/4 before coding (both sides keep the variances; no bytes more): the "
                        "codec's precision goes to the quiet channels, where a decoder's blocks are sensitive")
    c.add_argument("--token-reference-backoff", action="store_true",
                   help="with --token-reference: a sequence's first position (a decoder's attention sink) and tokens "
                        "never seen code against shared running means instead of the token's row and zero")
    c.add_argument("--compare-to", metavar="SETTING[,SETTING...]",
                   help="also train each named setting with the same seed, data and flags, one after another "
                        f"in the same processes, and print a side-by-side table; settings: {', '.join(SETTINGS)}")

    e = p.add_argument_group("delta coding of activations against per-example caches (AQ-SGD, pipeline mode)")
    e.add_argument("--delta", action="store_true",
                   help="send the change of each training example's boundary activation since its last visit, "
                        "coded by the forward codec (--codec/--quant/--sortquant); both sides cache every example")
    e.add_argument("--delta-warmup-epochs", type=int, default=0, metavar="N",
                   help="first N epochs: send delta-coded activations uncompressed and cache them (0: the first "
                        "visit codes the activation itself)")
    e.add_argument("--delta-cache-dtype", choices=sorted(CACHE_DTYPES), default="float16",
                   help="dtype of the cached reconstructions")
    e.add_argument("--delta-cache-dir", metavar="DIR",
                   help="keep the caches in memory-mapped files under DIR (for caches larger than memory)")
    e.add_argument("--delta-cache-limit", type=float, default=DEFAULT_MAX_BYTES / 2**30, metavar="GIB",
                   help="largest in-memory cache per boundary tensor and side, GiB")
    e.add_argument("--example-dropout", action="store_true",
                   help="draw each training example's dropout masks from its id: the same masks at every visit, "
                        "so revisits change only as the weights do (nlp job, pipeline mode, --engine dgpipe; "
                        "pair it with an uncompressed run with the same flag)")

    d = p.add_argument_group("data")
    d.add_argument("--data-dir", default=data_dir, help=data_dir_help)
    d.add_argument("--train-subset", type=int, metavar="N",
                   help="train on a fixed, class-stratified subset of N examples (default: all)")
    d.add_argument("--eval-subset", type=int, metavar="N",
                   help="evaluate on a fixed, class-stratified subset of N examples (default: all)")
    d.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes per rank")

    t = p.add_argument_group("training")
    t.add_argument("--batch-size", type=int, default=batch_size, help="examples per optimizer step (all ranks)")
    t.add_argument("--chunk", type=int, default=4, metavar="M", help="micro-batches per mini-batch (pipeline)")
    t.add_argument("--epochs", type=int, default=epochs, help="passes over the training set")
    t.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    t.add_argument("--max-steps", type=int, metavar="N",
                   help="stop after N optimizer steps (smoke runs; default: every step of --epochs)")
    t.add_argument("--eval-every", type=int, metavar="N",
                   help="also evaluate every N optimizer steps (an 'eval' record in the log), besides after every "
                        "epoch")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the initialisation, the subsets, the batch order and dropout")
    t.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="the stages' forward under torch.autocast in 16 bits (bf16, or fp16 with loss scaling): "
                        "16-bit activations and gradients cross the boundaries, weights that do not train are stored "
                        "in 16 bits; trainable weights and the optimizer stay float32")
    t.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each layer's activations in the backward pass instead of storing them "
                        "(torch.utils.checkpoint): less memory for a second forward")

    s = p.add_argument_group("partition and processes")
    s.add_argument("--mode", choices=["pipeline", "dataparallel"], default="pipeline",
                   help="pipeline: the model split into stages; dataparallel: DDP baseline")
    s.add_argument("--partition", choices=["client-server", "linear"], default="client-server",
                   help="client-server: the client (rank 0) holds the first and last --client-layers layers, "
                        "the server (rank 1) the middle; linear: --stages consecutive stages")
    s.add_argument("--client-layers", type=int, default=client_layers, metavar="K",
                   help="layers the client holds at each end (client-server)")
    s.add_argument("--stages", type=int, metavar="N", help="stages of a linear partition (default: the world size)")
    s.add_argument("--balance", metavar="N1,N2,...",
                   help="layers per stage of a linear partition (default: about equal parameter counts)")
    s.add_argument("--engine", choices=["dgpipe", "torch"], default="dgpipe",
                   help="pipeline runtime: dgpipe's GPipe, or torch.distributed.pipelining's schedules (--schedule) "
                        "with the dgpipe codecs on their boundaries (a linear partition, fixed shapes)")
    s.add_argument("--schedule", choices=["gpipe", "1f1b", *LOOPED_SCHEDULES, "zbv"],
                   help="torch schedule of --engine torch: GPipe, 1F1B, or a looped one with 2 or more stages per "
                        "rank (interleaved 1F1B, looped BFS, interleaved zero-bubble); zbv is refused (torch's V "
                        "schedules cannot evaluate) (default: 1f1b)")
    s.add_argument("--link-delay", dest="link_delay_ms", type=float, default=0.0, metavar="MS",
                   help="benchmarks: hold every boundary message back by MS milliseconds before sending it, an "
                        "emulated one-way link latency where the kernel has no netem (dgpipe's runtime only)")
    s.add_argument("--world-size", type=int, metavar="W",
                   help="processes (default: 2; under torchrun: its WORLD_SIZE)")
    s.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="torch.distributed backend (auto: nccl on CUDA devices, else gloo)")
    s.add_argument("--devices", metavar="DEV[,DEV...]",
                   help="device of each rank, e.g. cpu or cuda:0,cuda:1 (default: cuda:<local rank> "
                        "when CUDA is available, else cpu)")
    s.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a peer silent this long ends every rank with an error")
    s.add_argument("--grad-compression", metavar="NAME",
                   help="dataparallel mode: compress the DDP gradient exchange with this hook/codec "
                        "(default: plain all-reduce)")
    s.add_argument("--grad-compression-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="option of --grad-compression (repeatable), e.g. rank=4")

    o = p.add_argument_group("output")
    o.add_argument("--log-file", "--log", dest="log", metavar="PATH",
                   help="JSON-lines log (one record per epoch, then a summary); with --compare-to, each compared "
                        "setting's log is PATH with .<setting> before the suffix. Under torchrun spell it "
                        "--log-file (torchrun takes --log for its own --log-dir)")
    o.add_argument("--bandwidth", action="store_true", help="print the per-boundary meter table each epoch")
    o.add_argument("--save", metavar="DIR",
                   help="checkpoint directory: every rank's state after every epoch (and every --save-every steps)")
    o.add_argument("--save-every", type=int, metavar="STEPS",
                   help="also checkpoint every STEPS optimizer steps (written in the background)")
    o.add_argument("--keep-checkpoints", type=int, default=2, metavar="K",
                   help="step checkpoints kept in --save DIR, newest first (>= 2, so that one survives a "
                        "checkpoint cut short)")
    o.add_argument("--resume", metavar="DIR|auto",
                   help="continue from the newest complete checkpoint in DIR (written by --save); auto: in --save's "
                        "DIR if there is one, else start fresh -- the same command relaunched (e.g. by torchrun "
                        "--max-restarts) continues where it stopped")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="tqdm progress bars on rank 0")
    return p


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

    if args.mode == "pipeline":
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
    else:
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
        derived.update(compare_to=(), compression=None, dp_compression=grad_compression(args))

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
    for flag, path in (("--log", args.log), ("--save", args.save)):
        if path is not None:
            parent = Path(path).resolve().parent
            existing = next(p for p in (parent, *parent.parents) if p.exists())
            if not existing.is_dir() or not os.access(existing, os.W_OK):
                raise ValueError(f"{flag} {path}: cannot create it under {existing}; choose a writable path")
    return config
