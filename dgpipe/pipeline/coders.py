"""A stage boundary's coders on one rank: the codec arguments the pipeline takes, and the codec instances,
delta coders and token tables a boundary keeps per direction, micro-batch slot and tuple position, with the
state a checkpoint saves.

Codec instances are made per (direction, micro-batch slot, tuple position), so a stateful codec (error
feedback) keeps one state per boundary, direction and slot; evaluation uses its own instances and never touches
training state. A delta coder and a token table are one per tuple position on each side, shared by the
micro-batches (:mod:`dgpipe.pipeline.boundary` says how messages use them).
"""

from __future__ import annotations

from typing import Callable, Iterable, Union

import torch

from dgpipe.compression import Codec, CodecSpec
from dgpipe.compression.wrappers.delta import DeltaCache, DeltaCoder, DeltaSpec
from dgpipe.compression.wrappers.reference import ReferenceCoder, ScaledReferenceCoder, TokenReference, TokenTable

from .lanes import LOSSLESS_LANE, CodedLane, DeltaLane, DeltaWarmupLane, Lane, ReferenceLane
from .message import CODED, DELTA_CODED, LOSSLESS

__all__ = ["CodecArg", "codec_factory", "codec_factories", "Coders", "coder_states", "load_coder_states"]

#: What the Pipeline API takes for a boundary's codec (see :func:`codec_factory`).
CodecArg = Union[CodecSpec, str, tuple, Callable[[], Codec], Codec]


def codec_factory(spec: CodecArg) -> Callable[[], Codec]:
    """Turn a codec argument into a zero-argument factory of fresh codec instances.

    Args:
        spec: a :class:`~dgpipe.compression.CodecSpec`, a registered codec name
            (``"sortquant"``), a ``(name, options)`` tuple (``("sortquant", {"quant_bits":
            6, "split_bits": 2})``), a zero-argument callable returning a :class:`Codec`, or
            a stateless :class:`Codec` instance (shared; stateful codecs need a factory).

    Raises:
        ValueError: unknown name, bad options, a stateful instance, or anything else.
    """
    if isinstance(spec, (CodecSpec, str, tuple)):
        return CodecSpec.of(spec).build
    if isinstance(spec, Codec):
        if spec.stateful:
            raise ValueError(
                f"{spec!r} is stateful and would share its state across boundaries; pass a factory, "
                f"e.g. lambda: make_codec(), so that each boundary, direction and micro-batch gets its own"
            )
        return lambda: spec
    if callable(spec):
        made = spec()
        if not isinstance(made, Codec):
            raise ValueError(f"codec factory {spec!r} returned {type(made).__name__}, not a Codec")
        return spec
    raise ValueError(f"codec spec must be a CodecSpec, a name, (name, options), a factory or a Codec; got {spec!r}")


def codec_factories(spec: CodecArg | list, n_boundaries: int, what: str) -> list[Callable[[], Codec]]:
    """One factory per stage boundary: ``spec`` for all, or a list with one spec per boundary.

    Raises:
        ValueError: a list of the wrong length (``what`` names the argument), or a bad spec.
    """
    if isinstance(spec, list):
        if len(spec) != n_boundaries:
            raise ValueError(f"{what} lists {len(spec)} codecs but there are {n_boundaries} stage boundaries")
        return [codec_factory(s) for s in spec]
    factory = codec_factory(spec)
    return [factory] * n_boundaries


class Coders:
    """One rank's coders of one boundary (module docstring).

    Args:
        name: the boundary's name (``stage<i>->stage<i+1>``), for messages and cache files.
        rank: this rank; ``side``: ``"sender"`` (it holds stage i) or ``"receiver"``.
        act_factory, grad_factory: codec factories (:func:`codec_factory`) of the activations (and evaluation)
            and of the gradients.
        delta: the pipeline's delta spec if this boundary delta-codes its activations, else None.
        token_reference: the pipeline's token reference, or None.
        report: where cache allocations are reported (one line each).
    """

    def __init__(self, name: str, rank: int, side: str, act_factory: Callable[[], Codec],
                 grad_factory: Callable[[], Codec], delta: DeltaSpec | None,
                 token_reference: TokenReference | None, report: Callable[[str], None] | None) -> None:
        self.name, self.rank, self.side = name, rank, side
        self.factories = {"forward": act_factory, "eval": act_factory, "backward": grad_factory}
        self.delta_spec, self.token_reference, self._report = delta, token_reference, report
        self.codecs: dict[tuple[str, int, int], Codec] = {}
        self.deltas: dict[int, DeltaCoder] = {}
        self.references: dict[int, ReferenceCoder] = {}

    def codec(self, direction: str, slot: int, pos: int) -> Codec:
        """The codec instance of ``direction`` for tuple position ``pos`` of micro-batch ``slot`` (made on first
        use; ``eval`` has instances of its own)."""
        key = (direction, slot, pos)
        if key not in self.codecs:
            self.codecs[key] = self.factories[direction]()
        return self.codecs[key]

    def delta(self, pos: int) -> DeltaCoder:
        """The delta coder of tuple position ``pos`` on this rank's side (made on first use).

        Raises:
            ValueError: this boundary is not delta-coded on this rank.
        """
        if self.delta_spec is None:
            raise ValueError("a delta-coded tensor on a boundary this rank does not delta-code "
                             "(configure delta alike on every rank)")
        if pos not in self.deltas:
            spec = self.delta_spec
            path = None
            if spec.cache_dir is not None:
                stem = self.name.replace("->", "-")
                path = f"{spec.cache_dir}/{stem}.tensor{pos}.{self.side}.rank{self.rank}.bin"
            cache = DeltaCache(spec.examples, spec.cache_dtype, path, spec.max_bytes,
                               f"rank {self.rank}: delta cache {self.name} tensor {pos} ({self.side})", self._report)
            self.deltas[pos] = DeltaCoder(self.factories["forward"](), cache)
        return self.deltas[pos]

    def reference(self, pos: int) -> ReferenceCoder:
        """The reference coder of tuple position ``pos`` on this rank's side (made on first use).

        Raises:
            ValueError: this rank has no token reference.
        """
        if self.token_reference is None:
            raise ValueError("a reference-coded tensor, but this rank has no token reference "
                             "(configure it alike on every rank)")
        if pos not in self.references:
            spec = self.token_reference
            codec, table = self.factories["forward"](), TokenTable(spec.vocab + 2 * spec.backoff, spec.alpha)
            self.references[pos] = (
                ScaledReferenceCoder(codec, table, TokenTable(1, spec.alpha), shared=True, backoff=spec.backoff)
                if spec.scale else ReferenceCoder(codec, table, spec.backoff))
        return self.references[pos]

    def lane(self, direction: str, slot: int, pos: int, kind: int, referenced: bool = False) -> Lane:
        """The lane of kind ``kind`` for tuple position ``pos`` of micro-batch ``slot``."""
        if referenced:
            return ReferenceLane(self.reference(pos))
        if kind == LOSSLESS:
            return LOSSLESS_LANE
        if kind == CODED:
            return CodedLane(self.codec(direction, slot, pos))
        return (DeltaLane if kind == DELTA_CODED else DeltaWarmupLane)(self.delta(pos))

    def codec_state(self) -> dict[str, object]:
        """``state_dict()`` of every codec instance that has one, keyed ``direction/slot/position``."""
        return {
            f"{d}/{s}/{p}": c.state_dict() for (d, s, p), c in self.codecs.items() if hasattr(c, "state_dict")
        }

    def load_codec_state(self, state: dict[str, object]) -> None:
        """Restore :meth:`codec_state` output, creating the codec instances it names."""
        for key, value in state.items():
            d, s, p = key.split("/")
            if d not in self.factories:
                raise ValueError(f"{self.name}: codec state key {key!r} has unknown direction {d!r}")
            codec = self.codec(d, int(s), int(p))
            if not hasattr(codec, "load_state_dict"):
                raise ValueError(f"{self.name}: codec {codec!r} has no load_state_dict for state {key!r}")
            codec.load_state_dict(value)

    def delta_state(self) -> dict[str, dict]:
        """``state_dict()`` of this side's delta cache per tuple position (``{}`` if none)."""
        return {str(pos): coder.cache.state_dict() for pos, coder in sorted(self.deltas.items())}

    def load_delta_state(self, state: dict[str, dict]) -> None:
        """Restore :meth:`delta_state` output.

        Raises:
            ValueError: the boundary is not delta-coded on this rank, or a cache does not fit.
        """
        if state and self.delta_spec is None:
            raise ValueError(f"{self.name}: saved delta caches, but this boundary is not delta-coded; resume with "
                             f"the same --delta options")
        for pos, cache_state in state.items():
            self.delta(int(pos)).cache.load_state_dict(cache_state)

    def take_delta_stats(self) -> torch.Tensor:
        """float64 ``(3,)``: this side's :attr:`DeltaCoder.stats <dgpipe.compression.wrappers.delta.DeltaCoder>`
        summed over tuple positions (zeros on the receiving side), then reset."""
        total = torch.zeros(3, dtype=torch.float64)
        for coder in self.deltas.values():
            total += coder.take_stats()
        return total

    def reference_state(self) -> dict[str, dict]:
        """``state_dict()`` of this side's reference coder (its token table, and the squares of a scaled
        one) per tuple position (``{}`` if none)."""
        return {str(pos): coder.state_dict() for pos, coder in sorted(self.references.items())}

    def load_reference_state(self, state: dict[str, dict]) -> None:
        """Restore :meth:`reference_state` output.

        Raises:
            ValueError: this rank has no token reference, or a table does not fit.
        """
        for pos, table_state in state.items():
            self.reference(int(pos)).load_state_dict(table_state)

    def reference_digests(self) -> dict[int, str]:
        """SHA-256 of this side's reference tables per tuple position (equal on the two sides of the boundary)."""
        return {pos: coder.digest() for pos, coder in sorted(self.references.items())}

    def delta_digests(self) -> dict[int, str]:
        """SHA-256 of this side's cache per tuple position (equal on the two sides of the boundary)."""
        return {pos: coder.cache.digest() for pos, coder in sorted(self.deltas.items())}


def coder_states(boundaries: Iterable) -> dict:
    """``{"codecs": {boundary name: codec states}, "delta": {name: cache states}, "reference": {name: token
    tables}}`` of the :class:`~dgpipe.pipeline.boundary.Boundary` objects ``boundaries`` (this rank's side of each)."""
    boundaries = list(boundaries)
    return {
        "codecs": {b.name: b.coders.codec_state() for b in boundaries},
        "delta": {b.name: b.coders.delta_state() for b in boundaries if b.delta_coded},
        "reference": {b.name: b.coders.reference_state() for b in boundaries if b.token_reference is not None},
    }


def load_coder_states(boundaries: Iterable, state: dict) -> None:
    """Restore :func:`coder_states` output (the keys of ``state`` it made; others are ignored) into ``boundaries``.

    Raises:
        ValueError: a state for a boundary that is not among ``boundaries``, or one its coders refuse.
    """
    bounds = {b.name: b for b in boundaries}
    kinds = {"codecs": ("codec state", "load_codec_state"), "delta": ("delta caches", "load_delta_state"),
             "reference": ("token tables", "load_reference_state")}
    for key, (what, load) in kinds.items():
        for name, saved in state.get(key, {}).items():
            if name not in bounds:
                raise ValueError(f"{what} for boundary {name!r}, which this rank does not touch")
            getattr(bounds[name].coders, load)(saved)
