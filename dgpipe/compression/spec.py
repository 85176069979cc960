"""A codec spec: a registered codec's name and options, checked once, built on each use.

The one description of a codec that the CLIs, the Pipeline API
(:class:`dgpipe.pipeline.Pipeline`'s ``act_codec``/``grad_codec``) and the data-parallel
hooks (:func:`dgpipe.baseline.build_ddp`) share. Constructing a spec builds its codec
once, so an unknown name or a bad option fails where the spec is written, before any
process starts; :meth:`CodecSpec.build` then makes one fresh instance per use (a stateful
wrapper gets its own state per instance).

Usage::

    spec = CodecSpec("quant", {"bits": 4, "error_feedback": True})
    codec = spec.build()             # ErrorFeedback(quant(bits=4))
    CodecSpec.of(("sortquant", {"quant_bits": 6, "split_bits": 2}))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .base import Codec, available_codecs, get_codec
from .wrappers.feedback import ErrorFeedback

__all__ = ["CodecSpec", "NamedOptions", "spell"]


def spell(name: str, options: Mapping[str, Any]) -> str:
    """``name(key=value, ...)`` with the keys sorted, or ``name`` without options (for messages and logs)."""
    opts = ", ".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{name}({opts})" if opts else name


class NamedOptions:
    """What a frozen ``name`` + ``options`` spec shares: pickling (re-checked on load), log JSON, a short text."""

    name: str
    options: Mapping[str, Any]

    def __reduce__(self):
        """Pickle as ``type(self)(name, options dict)`` (to spawned local processes; checked again there)."""
        return type(self), (self.name, dict(self.options))

    def to_json(self) -> dict[str, Any]:
        """``{"name": ..., "options": {...}}`` for logs."""
        return {"name": self.name, "options": dict(self.options)}

    def __str__(self) -> str:
        return spell(self.name, self.options)


@dataclass(frozen=True)
class CodecSpec(NamedOptions):
    """A codec name with its keyword options (immutable).

    Attributes:
        name: registry name (:func:`dgpipe.compression.available_codecs`).
        options: keyword arguments of :func:`dgpipe.compression.get_codec`, plus
            ``error_feedback`` (bool, default false): wrap the codec in
            :class:`~dgpipe.compression.ErrorFeedback` (one residual per built instance).

    Raises:
        ValueError: unknown codec name (the message lists the registered ones), bad
            options, or ``error_feedback`` not a bool.
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in available_codecs():
            raise ValueError(f"unknown codec {self.name!r}; available: {', '.join(available_codecs())}")
        if not isinstance(self.options, Mapping) or not all(isinstance(k, str) for k in self.options):
            raise ValueError(f"codec options must be a mapping of names to values, got {self.options!r}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        self.build()

    @classmethod
    def of(cls, value: CodecSpec | str | tuple) -> CodecSpec:
        """A spec from a name (``"sortquant"``), a ``(name, options dict)`` tuple, or a spec.

        Raises:
            ValueError: any other value, or an invalid name or options.
        """
        if isinstance(value, CodecSpec):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], dict):
            return cls(*value)
        raise ValueError(f"a codec spec is a name or a (name, options dict) tuple, got {value!r}")

    def build(self, **overrides: Any) -> Codec:
        """A fresh codec instance, with ``overrides`` replacing options (e.g. a per-rank ``seed``).

        Raises:
            ValueError: what :func:`~dgpipe.compression.get_codec` raises for the options,
                or ``error_feedback`` not a bool.
        """
        options = {**self.options, **overrides}
        feedback = options.pop("error_feedback", False)
        if not isinstance(feedback, bool):
            raise ValueError(f"error_feedback must be true or false, got {feedback!r}")
        codec = get_codec(self.name, **options)
        return ErrorFeedback(codec) if feedback else codec
