"""``BoundarySpec``: what every boundary of a pipeline carries and how, besides its codecs -- one frozen value,
checked once when it is made, the same on every rank (as :class:`~dgpipe.compression.CodecSpec` is for a codec).

Padding rows (``row_mask``: the tuple position of an integer ``(B, L)`` tensor -- an
encoder's attention mask -- next to floating ``(B, L, ...)`` tensors, its hidden states):
a boundary sends only the rows the mask keeps (its nonzero entries) of those floating tensors through
their lossless or coded lane, forward and evaluation, and only those rows of their gradients
backward; the receiver puts them back in place and zeros in the other rows. Exact for a
model in which padding rows influence nothing but themselves (attention masks them as
keys, the head reads real tokens): their activations never reach the loss and their
gradients are zero. The raw bytes the meter records stay those of the whole tensors, so
wire/raw falls by the padding's share. A delta-coded tensor sends the change of its kept rows
(its caches hold whole examples; padding rows keep their cached values, zeros from a warm-up).

Per-token reference (``token_reference``, :mod:`dgpipe.compression.wrappers.reference`): the last
tensor of a forward or evaluation value is the token ids, an integer ``(B, L)`` tensor that travels
losslessly (flag ``TOKEN_IDS``; decoded first on the receiver); each coded floating ``(B, L, d)``
tensor of the value is sent as its residual against the table of its tuple position (flag
``REFERENCE``). The table is one per position on each side, shared by the micro-batches and by
evaluation; training messages update it in the order they are sent and received, evaluation only
reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpipe.compression.wrappers.delta import DeltaSpec
from dgpipe.compression.wrappers.reference import TokenReference

__all__ = ["BoundarySpec"]


def _count(value, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{what} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class BoundarySpec:
    """The pipeline's boundary options (:class:`~dgpipe.pipeline.Pipeline`'s ``boundary``).

    Attributes:
        compress_eval: floating activations of evaluation steps go through the activation codec too (False: as
            they are, metered as ``eval``).
        delta: delta-code the activations of the boundaries it covers against per-example caches (AQ-SGD,
            :mod:`dgpipe.compression.wrappers.delta`; the activation codec codes the change): training steps then
            need ``sample_ids``, which travel with every forward message.
        example_ids: without ``delta``: the number of training examples whose sample ids travel with every forward
            message, for stages that need them (per-example dropout, :mod:`dgpipe.models.example_dropout`);
            training steps then need ``sample_ids``. With ``delta`` the ids travel anyway and this must be ``None``
            or ``delta.examples``.
        row_mask: the position, in every boundary value (a tuple), of an integer ``(B, L)`` mask -- an encoder's
            attention mask; only the rows it keeps (nonzero) of the value's floating ``(B, L, ...)`` tensors and
            of their gradients travel (padding rows arrive as zeros; exact where padding influences nothing but
            itself; :mod:`dgpipe.pipeline.boundary`). ``None``: whole tensors travel. A value without a mask of
            that shape there is a ``ValueError`` when it is sent.
        token_reference: every boundary value ends with the token ids, an integer ``(B, L)`` tensor, and each
            coded floating ``(B, L, d)`` tensor crosses as its residual against a per-token table both sides build
            from training messages (:class:`~dgpipe.compression.wrappers.reference.TokenReference`).
        link_delay: seconds every boundary message is held back before it is sent (an emulated one-way latency,
            :class:`~dgpipe.comm.delay.DelayLine`; benchmarks on kernels without ``netem``); 0: sent at once.

    Raises:
        ValueError: a field of the wrong type or out of range, ``example_ids`` other than the delta spec's
            examples, a negative ``row_mask``, or a token reference with ``delta`` or ``row_mask`` (it codes whole
            tensors).
    """

    compress_eval: bool = True
    delta: DeltaSpec | None = None
    example_ids: int | None = None
    row_mask: int | None = None
    token_reference: TokenReference | None = None
    link_delay: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.compress_eval, bool):
            raise ValueError(f"compress_eval must be a bool, got {self.compress_eval!r}")
        if self.delta is not None and not isinstance(self.delta, DeltaSpec):
            raise ValueError(f"delta must be a DeltaSpec, got {type(self.delta).__name__}")
        _count(self.example_ids, "example_ids (training examples)")
        if self.delta is not None and self.example_ids not in (None, self.delta.examples):
            raise ValueError(f"example_ids={self.example_ids} but the delta spec caches {self.delta.examples} "
                             "examples")
        if self.row_mask is not None and (isinstance(self.row_mask, bool) or not isinstance(self.row_mask, int)
                                          or self.row_mask < 0):
            raise ValueError(f"row_mask must be a tuple position (an int >= 0), got {self.row_mask!r}")
        if self.token_reference is not None:
            if not isinstance(self.token_reference, TokenReference):
                raise ValueError(f"token_reference must be a TokenReference, got "
                                 f"{type(self.token_reference).__name__}")
            if self.delta is not None or self.row_mask is not None:
                raise ValueError("token_reference codes whole tensors directly: not with delta or row_mask")
        if isinstance(self.link_delay, bool) or not isinstance(self.link_delay, (int, float)) \
                or not self.link_delay >= 0:
            raise ValueError(f"link_delay must be >= 0 seconds, got {self.link_delay!r}")

    @property
    def id_examples(self) -> int | None:
        """Sample ids travel with forward messages, each in ``[0, id_examples)``; ``None``: no ids."""
        return self.delta.examples if self.delta is not None else self.example_ids

    def check(self, n_boundaries: int) -> None:
        """Check the spec against a pipeline of ``n_boundaries`` boundaries.

        Raises:
            ValueError: a delta spec naming a boundary the pipeline does not have.
        """
        if self.delta is not None and self.delta.boundaries is not None \
                and any(b >= n_boundaries for b in self.delta.boundaries):
            raise ValueError(f"delta boundaries {self.delta.boundaries}: there are {n_boundaries} boundaries "
                             f"(indices 0..{n_boundaries - 1})")

    def check_row_mask(self, tensors: list[torch.Tensor], where: str) -> None:
        """Check that tuple position :attr:`row_mask` of a boundary value (``tensors``) holds an integer ``(B, L)``
        mask that a floating ``(B, L, ...)`` tensor of the value shares.

        Raises:
            ValueError: one line naming ``where`` and what the value holds instead (or no :attr:`row_mask`).
        """
        pos = self.row_mask
        if pos is None:
            raise ValueError(f"{where}: this pipeline names no row mask")
        if pos >= len(tensors):
            raise ValueError(f"{where}: row_mask is position {pos}, but the value holds {len(tensors)} tensor(s)")
        m = tensors[pos]
        if m.is_floating_point() or m.is_complex() or m.dim() != 2:
            raise ValueError(f"{where}: row_mask position {pos} holds a {m.dtype} {tuple(m.shape)} tensor, not an "
                             "integer (B, L) mask")
        if not any(t.is_floating_point() and t.dim() >= 3 and t.shape[:2] == m.shape for t in tensors):
            raise ValueError(f"{where}: no floating tensor of the value has the row mask's (B, L) = {tuple(m.shape)}")
