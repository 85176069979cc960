"""``dgc``: Deep Gradient Compression, a stateful sparsifier of one gradient stream.

Source:
    Y. Lin, S. Han, H. Mao, Y. Wang, W. J. Dally, "Deep Gradient Compression: Reducing the
    Communication Bandwidth for Distributed Training", ICLR 2018: top-k selection by a
    threshold estimated on a random sample, local gradient accumulation with momentum
    correction and momentum-factor masking, local gradient clipping, and an
    exponentially decreasing density during the first epochs (warm-up).
"""

from __future__ import annotations

import math

import torch

from ..base import Payload, register_codec
from .core import SeededCodec, check_gradient
from .sparsify import decode_sparse, sparse_payload

__all__ = ["DGC"]

MIN_SAMPLE_HITS = 32
"""The threshold sample is large enough to hold this many values above it on average."""


@register_codec("dgc", 11)
class DGC(SeededCodec):
    """Deep Gradient Compression of one stream (one parameter's gradient, step after step).

    Each :meth:`encode` of a gradient ``g`` (after optional clipping of its L2 norm to
    ``clip_norm / sqrt(world_size)``, the paper's local clipping) does::

        u = momentum * u + g          # momentum correction (u: local momentum)
        v = v + u                     # local accumulation  (v: what is not sent yet)
        sent = the k = ceil(density * n) entries of v largest in magnitude
        v[sent] = 0; u[sent] = 0      # momentum-factor masking

    and sends ``v[sent]`` with its indices (the ``topk`` wire format,
    :func:`~.sparsify.sparse_payload`). With ``momentum = 0`` it is plain
    sparsification with local accumulation. When ``momentum > 0`` the momentum is
    applied here, so the optimizer must run **without** momentum (as in the paper).

    The threshold is the ``ceil(density * S)``-th largest ``|v|`` in a random sample of
    ``S = max(sample_ratio * n, 32 / density)`` values (the whole tensor when ``S >= n``:
    exact top-k); if more than ``k`` values pass it, the ``k`` largest of them are kept.
    So at most ``k`` values are sent, about ``k`` on average.

    Density warm-up: in epoch ``e < warmup_epochs`` (0-based, :meth:`set_epoch`) the
    density is ``warmup_density * (density / warmup_density) ** (e / warmup_epochs)``;
    the defaults give the paper's 25%, 6.25%, 1.56%, 0.4%, then 0.1%.

    Args:
        density: fraction of values sent after warm-up, in (0, 1].
        warmup_epochs: epochs of warm-up (0: none).
        warmup_density: density of epoch 0, >= ``density``.
        momentum: momentum factor in [0, 1) of the correction.
        clip_norm: global L2 clipping threshold, or ``None`` (no clipping).
        world_size: number of workers N; the local threshold is ``clip_norm / sqrt(N)``.
        sample_ratio: fraction of values sampled for the threshold, in (0, 1].
        seed: seed of the threshold sampling (see :class:`~.gradbase.SeededCodec`).

    State (``stateful = True``, :meth:`state_dict`): ``u``, ``v`` (float32, one value per
    element of the stream), ``step`` and ``epoch``. All encodes of an instance must see
    tensors of one size. Decode is stateless.

    Input: floating tensor, any shape, CPU or CUDA; inf/NaN raise ``ValueError``.
    Output: same shape, dtype and device (zeros except at the sent indices).

    Wire: ``k`` values in the input dtype and ``k`` indices packed in
    ``b = max(1, ceil(log2(n)))`` bits::

        nbytes = k * itemsize + ceil(k * b / 8) + header bytes
    """

    stateful = True

    def __init__(
        self,
        density: float = 0.001,
        warmup_epochs: int = 4,
        warmup_density: float = 0.25,
        momentum: float = 0.9,
        clip_norm: float | None = None,
        world_size: int = 1,
        sample_ratio: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        def count(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not number(density) or not 0 < density <= 1:
            raise ValueError(f"dgc: density must be in (0, 1] (0.001 keeps 0.1%), got {density!r}")
        if not count(warmup_epochs) or warmup_epochs < 0:
            raise ValueError(f"dgc: warmup_epochs must be an int >= 0, got {warmup_epochs!r}")
        if not number(warmup_density) or not 0 < warmup_density <= 1 or (warmup_epochs and warmup_density < density):
            raise ValueError(
                f"dgc: warmup_density must be in [density, 1] = [{density}, 1] (any in (0, 1] without warm-up), "
                f"got {warmup_density!r}"
            )
        if not number(momentum) or not 0 <= momentum < 1:
            raise ValueError(f"dgc: momentum must be in [0, 1), got {momentum!r}")
        if clip_norm is not None and (not number(clip_norm) or not clip_norm > 0):
            raise ValueError(f"dgc: clip_norm must be a positive number or None, got {clip_norm!r}")
        if not count(world_size) or world_size < 1:
            raise ValueError(f"dgc: world_size must be an int >= 1, got {world_size!r}")
        if not number(sample_ratio) or not 0 < sample_ratio <= 1:
            raise ValueError(f"dgc: sample_ratio must be in (0, 1], got {sample_ratio!r}")
        self.density = density
        self.warmup_epochs = warmup_epochs
        self.warmup_density = warmup_density
        self.momentum = momentum
        self.clip_norm = clip_norm
        self.world_size = world_size
        self.sample_ratio = sample_ratio
        self._epoch = 0
        self._u: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the warm-up density of ``epoch`` (0-based) for the following encodes."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"dgc: epoch must be an int >= 0, got {epoch!r}")
        self._epoch = epoch

    @property
    def current_density(self) -> float:
        """Density used by the next encode (warm-up schedule at the current epoch)."""
        if self._epoch >= self.warmup_epochs:
            return self.density
        return self.warmup_density * (self.density / self.warmup_density) ** (self._epoch / self.warmup_epochs)

    def _select(self, mag: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
        """Indices (int64) of at most ``k`` large entries of ``mag`` (1-D, non-negative)."""
        n = mag.numel()
        density = k / n
        size = min(n, max(math.ceil(self.sample_ratio * n), math.ceil(MIN_SAMPLE_HITS / density)))
        if size >= n:
            return torch.topk(mag, k, sorted=False).indices
        sample = mag[torch.randint(0, n, (size,), generator=gen, device=mag.device)]
        threshold = torch.topk(sample, max(1, math.ceil(density * size)), sorted=False).values.min()
        idx = (mag >= threshold).nonzero().view(-1)
        if idx.numel() > k:
            idx = idx[torch.topk(mag[idx], k, sorted=False).indices]
        return idx

    def encode(self, x: torch.Tensor) -> Payload:
        check_gradient(x, self.name)
        g = x.detach().reshape(-1).float()
        n = g.numel()
        gen = self._next_generator(g.device)
        if self._v is None:
            self._v = torch.zeros_like(g)
            self._u = torch.zeros_like(g) if self.momentum else None
        elif self._v.numel() != n:
            raise ValueError(
                f"dgc: this instance accumulates a stream of {self._v.numel()} values but got {n}; "
                "use one DGC codec per gradient tensor"
            )
        elif self._v.device != g.device:
            self._v = self._v.to(g.device)
            self._u = None if self._u is None else self._u.to(g.device)
        if self.clip_norm is not None and n:
            bound = self.clip_norm / math.sqrt(self.world_size)
            g = g * torch.clamp(bound / (torch.linalg.vector_norm(g) + 1e-12), max=1.0)
        if self._u is not None:
            self._u.mul_(self.momentum).add_(g)
            self._v.add_(self._u)
        else:
            self._v.add_(g)
        if n == 0:
            idx = torch.zeros(0, dtype=torch.int64, device=g.device)
        else:
            idx = self._select(self._v.abs(), math.ceil(self.current_density * n), gen)
        values = self._v[idx].to(x.dtype)
        self._v[idx] = 0
        if self._u is not None:
            self._u[idx] = 0
        return sparse_payload(self.codec_id, x, idx, values)

    def decode(self, payload: Payload) -> torch.Tensor:
        return decode_sparse(self.parse(payload), payload)

    def state_dict(self) -> dict:
        """``{"step", "epoch", "u", "v"}``: counters and the float32 momentum/accumulator
        (``None`` before the first encode; ``u`` is ``None`` without momentum)."""
        def clone(t):
            return None if t is None else t.detach().clone()

        return {**super().state_dict(), "epoch": self._epoch, "u": clone(self._u), "v": clone(self._v)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; ``ValueError`` if it does not fit this codec."""
        super().load_state_dict(state)
        self.set_epoch(state.get("epoch"))
        u, v = state.get("u"), state.get("v")
        if v is not None and not (isinstance(v, torch.Tensor) and v.dim() == 1 and v.dtype == torch.float32):
            raise ValueError("dgc: state 'v' must be a 1-D float32 tensor or None")
        want_u = v is not None and self.momentum > 0
        if want_u != (u is not None) or (u is not None and (not isinstance(u, torch.Tensor) or u.shape != v.shape)):
            raise ValueError("dgc: state 'u' must match 'v' when momentum > 0 and be None otherwise")
        self._u = None if u is None else u.detach().clone()
        self._v = None if v is None else v.detach().clone()
