"""The command-line flags the main jobs share: one parser, its flags in groups, and how it reports errors.

:func:`common_parser` is where each CLI starts; :func:`.args.run_config` checks what it parsed.
"""

from __future__ import annotations

import argparse

from dgpipe.compression.wrappers.delta import CACHE_DTYPES, DEFAULT_MAX_BYTES

from .codecs import SETTINGS

__all__ = ["LOOPED_SCHEDULES", "HelpFormatter", "JobParser", "common_parser"]

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
    _compression_flags(p)
    _delta_flags(p)
    _data_flags(p, data_dir, data_dir_help)
    _training_flags(p, batch_size, lr, epochs)
    _partition_flags(p, client_layers)
    _output_flags(p)
    return p


def _compression_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the codecs at the stage boundaries (both directions), the token reference and ``--compare-to``."""
    c = parser.add_argument_group("compression at stage boundaries (pipeline mode)")
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


def _delta_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of delta coding against per-example caches (AQ-SGD) and of per-example dropout."""
    e = parser.add_argument_group("delta coding of activations against per-example caches (AQ-SGD, pipeline mode)")
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


def _data_flags(parser: argparse.ArgumentParser, data_dir: str | None, data_dir_help: str) -> None:
    """The flags of the data: its folder and the subsets."""
    d = parser.add_argument_group("data")
    d.add_argument("--data-dir", default=data_dir, help=data_dir_help)
    d.add_argument("--train-subset", type=int, metavar="N",
                   help="train on a fixed, class-stratified subset of N examples (default: all)")
    d.add_argument("--eval-subset", type=int, metavar="N",
                   help="evaluate on a fixed, class-stratified subset of N examples (default: all)")
    d.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes per rank")


def _training_flags(parser: argparse.ArgumentParser, batch_size: int, lr: float, epochs: int) -> None:
    """The flags of the optimisation: batch, micro-batches, epochs, learning rate, steps, seed, precision."""
    t = parser.add_argument_group("training")
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


def _partition_flags(parser: argparse.ArgumentParser, client_layers: int) -> None:
    """The flags of the partition, the engine and schedule, the processes and devices, and DDP's hook."""
    s = parser.add_argument_group("partition and processes")
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


def _output_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the log, the meter table, checkpoints and resuming, and the progress bars."""
    o = parser.add_argument_group("output")
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
