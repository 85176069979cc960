"""Compression flags -> codec specs for the stage boundaries and the DDP baseline.

The flag rules:

- ``--sortquant --quant Q --split S``: sort quantization, Q quant bits + S split bits,
  both directions. ``--quant Q`` alone: uniform Q-bit quantization. ``--codec NAME``
  with ``--codec-opt KEY=VALUE``: any registered codec. None of them: ``none``
  (uncompressed, still measured).
- ``--grad-codec NAME`` (+ ``--grad-codec-opt``) replaces the backward codec;
  ``--grad-quant``/``--grad-split`` change the bits of the backward direction (sort
  quantization when the forward one is, or when ``--grad-split`` is given; uniform
  quantization otherwise). ``--grad-codec-opt error_feedback=true`` wraps the backward
  codec in error feedback (:class:`~dgpipe.compression.ErrorFeedback`: the residual of
  micro-batch slot m is added to slot m's gradient of the next step). The forward codec
  refuses it: activations of different examples are not one stream whose sum matters.
- ``--grad-compression NAME`` (+ ``--grad-compression-opt``): the DDP gradient hook
  of ``--mode dataparallel``.

Every spec is a :class:`~dgpipe.compression.CodecSpec`, checked where it is made, so an
unknown codec or a bad option is an argument error naming the flag, raised before any
process starts; ``--grad-compression`` makes a :class:`~dgpipe.baseline.GradCompression`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dgpipe.compression import CodecSpec, available_codecs
from dgpipe.compression.spec import spell

if TYPE_CHECKING:
    from dgpipe.baseline import GradCompression

__all__ = [
    "MAX_BITS",
    "BoundaryCompression",
    "SETTINGS",
    "setting_label",
    "parse_options",
    "boundary_compression",
    "grad_compression",
]

#: Most bits per value a quantizing codec may use (Q + S for sort quantization).
MAX_BITS = 16


@dataclass(frozen=True)
class BoundaryCompression:
    """The codecs of a pipeline's boundaries: ``forward`` for activations, ``backward``
    for their gradients."""

    forward: CodecSpec
    backward: CodecSpec

    def to_json(self) -> dict[str, Any]:
        """``{"forward": spec, "backward": spec}`` for logs."""
        return {"forward": self.forward.to_json(), "backward": self.backward.to_json()}

    def __str__(self) -> str:
        if self.forward == self.backward:
            return str(self.forward)
        return f"forward {self.forward}, backward {self.backward}"


def _codebook(bits: int) -> CodecSpec:
    """The codebook codec at ``bits`` bits: normal-float levels, one bfloat16 RMS scale per token
    after a Hadamard rotation of the last dimension (the quality benchmark's low-bit codec)."""
    return CodecSpec("codebook", {"bits": bits, "levels": "normal", "group": "token", "rotate": "hadamard",
                                  "scale_dtype": "bfloat16"})


def _both(spec: CodecSpec) -> BoundaryCompression:
    return BoundaryCompression(spec, spec)


#: Named boundary settings (``--compare-to``, the bandwidth sweeps): uncompressed (still
#: measured); sort quantization at 16/12/8/4 bits per value with quant:split bits 3:1 (12+4,
#: 9+3, 6+2, 3+1); uniform min-max quantization at 8 and 4 bits; the codebook codec at 4 bits
#: both ways, and at 2 bits forward with 4-bit codebook gradients (``docs/quality.md`` ranks them).
SETTINGS: dict[str, BoundaryCompression] = {
    "none": _both(CodecSpec("none")),
    "sortquant16": _both(CodecSpec("sortquant", {"quant_bits": 12, "split_bits": 4})),
    "sortquant12": _both(CodecSpec("sortquant", {"quant_bits": 9, "split_bits": 3})),
    "sortquant8": _both(CodecSpec("sortquant", {"quant_bits": 6, "split_bits": 2})),
    "sortquant4": _both(CodecSpec("sortquant", {"quant_bits": 3, "split_bits": 1})),
    "quant8": _both(CodecSpec("quant", {"bits": 8})),
    "quant4": _both(CodecSpec("quant", {"bits": 4})),
    "codebook4": _both(_codebook(4)),
    "codebook2_g4": BoundaryCompression(_codebook(2), _codebook(4)),
}


def setting_label(compression: BoundaryCompression) -> str:
    """The name of ``compression`` in :data:`SETTINGS`, else its codecs written out
    (e.g. ``quant(bits=6)``)."""
    return next((label for label, c in SETTINGS.items() if c == compression), str(compression))


def _value(text: str) -> Any:
    """``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"true"``/``"false"`` -> bool, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: list[str], flag: str) -> dict[str, Any]:
    """Parse repeated ``KEY=VALUE`` flags into keyword options.

    Values become int, float or bool when they read as one, else stay strings.

    Raises:
        ValueError: a pair without ``=``, an empty key, or a key given twice.
    """
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"{flag} {pair!r}: write KEY=VALUE, e.g. {flag} ratio=0.01")
        if key in options:
            raise ValueError(f"{flag} gives {key!r} twice")
        options[key] = _value(text.strip())
    return options


def _check_bits(quant: int, split: int | None, flags: str) -> None:
    if quant < 1:
        raise ValueError(f"{flags}: quant bits must be >= 1, got {quant}")
    if split is not None and split < 0:
        raise ValueError(f"{flags}: split bits must be >= 0, got {split}")
    total = quant + (split or 0)
    if total > MAX_BITS:
        raise ValueError(f"{flags}: {total} bits per value is more than {MAX_BITS}; choose Q+S <= {MAX_BITS}, "
                         "e.g. --quant 12 --split 4 (16 bits) or --quant 6 --split 2 (8 bits)")


def _sortquant(quant: int, split: int, flag: str) -> CodecSpec:
    return _spec("sortquant", {"quant_bits": quant, "split_bits": split}, flag)


def _quant(bits: int, flag: str) -> CodecSpec:
    return _spec("quant", {"bits": bits}, flag)


def _spec(name: str, options: dict[str, Any], flag: str) -> CodecSpec:
    """``CodecSpec(name, options)``, its error prefixed with the flag to change."""
    try:
        return CodecSpec(name, options)
    except ValueError as e:
        if name not in available_codecs():
            raise ValueError(f"{flag}: {e}") from None
        raise ValueError(f"{flag} {spell(name, options)}: {e}") from None


def _forward(args: argparse.Namespace) -> CodecSpec:
    if args.codec is not None:
        if args.sortquant or args.quant is not None or args.split is not None:
            raise ValueError("--codec replaces --sortquant/--quant/--split; give one or the other")
        options = parse_options(args.codec_opt, "--codec-opt")
        if "error_feedback" in options:
            raise ValueError("--codec-opt error_feedback: error feedback carries a gradient's residual into the "
                             "next step's; activations of different examples are no such stream. Use "
                             "--grad-codec NAME --grad-codec-opt error_feedback=true for the backward direction")
        return _spec(args.codec, options, "--codec")
    if args.codec_opt:
        raise ValueError("--codec-opt needs --codec NAME")
    if args.sortquant:
        if args.quant is None or args.split is None:
            raise ValueError("--sortquant needs --quant Q and --split S (Q+S bits per value), "
                             "e.g. --sortquant --quant 6 --split 2")
        _check_bits(args.quant, args.split, f"--quant {args.quant} --split {args.split}")
        return _sortquant(args.quant, args.split, "--sortquant")
    if args.split is not None:
        raise ValueError("--split is the bucket bits of sort quantization: add --sortquant")
    if args.quant is not None:
        _check_bits(args.quant, None, f"--quant {args.quant}")
        return _quant(args.quant, "--quant")
    return CodecSpec("none")


def _backward(args: argparse.Namespace, forward: CodecSpec) -> CodecSpec:
    if args.grad_codec is not None:
        if args.grad_quant is not None or args.grad_split is not None:
            raise ValueError("--grad-codec replaces --grad-quant/--grad-split; give one or the other")
        return _spec(args.grad_codec, parse_options(args.grad_codec_opt, "--grad-codec-opt"), "--grad-codec")
    if args.grad_codec_opt:
        raise ValueError("--grad-codec-opt needs --grad-codec NAME")
    if args.grad_quant is None and args.grad_split is None:
        return forward
    if forward.name == "sortquant" or args.grad_split is not None:
        quant = args.grad_quant if args.grad_quant is not None else forward.options.get("quant_bits")
        split = args.grad_split if args.grad_split is not None else forward.options.get("split_bits")
        if quant is None or split is None:
            raise ValueError("sort-quantized gradients need both --grad-quant Q and --grad-split S "
                             "(the forward direction is not sort-quantized)")
        _check_bits(quant, split, f"--grad-quant {quant} --grad-split {split}")
        return _sortquant(quant, split, "--grad-quant/--grad-split")
    _check_bits(args.grad_quant, None, f"--grad-quant {args.grad_quant}")
    return _quant(args.grad_quant, "--grad-quant")


def boundary_compression(args: argparse.Namespace) -> BoundaryCompression:
    """The boundary codecs selected by the compression flags (rules in the module docstring).

    Raises:
        ValueError: contradictory flags, Q+S > 16, unknown codec or bad codec options,
            each with the flag to change.
    """
    forward = _forward(args)
    return BoundaryCompression(forward, _backward(args, forward))


def grad_compression(args: argparse.Namespace) -> GradCompression | None:
    """The DDP gradient compression of ``--grad-compression`` (None: plain all-reduce).

    Raises:
        ValueError: unknown name or bad options (checked by
            :class:`~dgpipe.baseline.GradCompression`), with the fix.
    """
    from dgpipe.baseline import GradCompression

    options = parse_options(args.grad_compression_opt, "--grad-compression-opt")
    if args.grad_compression is None:
        if options:
            raise ValueError("--grad-compression-opt needs --grad-compression NAME")
        return None
    try:
        return GradCompression(args.grad_compression, options)
    except ValueError as e:
        raise ValueError(f"--grad-compression {spell(args.grad_compression, options)}: {e}") from None
