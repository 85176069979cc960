"""Per-example dropout: every example's dropout masks drawn from its id, the same at every visit.

With standard dropout, an example's boundary activations change between two visits (epochs) even
when the weights do not. On all-MiniLM-L6-v2 that change is 0.16 of the activations' energy and
nearly full-rank, and delta coding (:mod:`dgpipe.compression.wrappers.delta`) pays for it at every
revisit. Drawing each example's masks from a generator seeded by ``(seed, site, example id)``
makes them the same at every visit, so the change then comes from weight drift alone. Each
example still sees independent masks at each dropout site and a different mask from every other
example. What is lost is the fresh noise at every visit; compare against the uncompressed run with
the same option.

- :func:`example_ids`: a context that names the examples of the batch being computed (int64
  ``(B,)``, one id per row of dim 0). The pipeline runtime sets it around each stage's training
  forward, from the sample ids that travel with the micro-batch.
- :class:`ExampleDropout`: the drop-in for ``nn.Dropout``. Its mask for row ``b`` is drawn on the
  CPU from ``torch.Generator().manual_seed(mix(seed, site, ids[b]))``, with shape ``x.shape[1:]``.
- :func:`use_example_dropout`: swaps every ``nn.Dropout`` of a model for an ``ExampleDropout``
  (sites numbered in module order). For transformers models it also routes attention
  probabilities through the attention module's own dropout, via a registered attention
  function (:data:`ATTENTION`: eager attention whose dropout is that module). HF's eager
  attention calls the functional dropout with a bare ``p``.

Masks are drawn on the CPU and moved to the input's device: a GPU and a CPU rank drop the same
values. The cost is one generator and one ``torch.rand`` per example and site.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

__all__ = ["ATTENTION", "ExampleDropout", "example_ids", "use_example_dropout"]

_IDS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("dgpipe_example_ids", default=None)

ATTENTION = "dgpipe_example_dropout"
"""Name of the transformers attention function registered by :func:`use_example_dropout`."""

_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64 constants


@contextlib.contextmanager
def example_ids(ids: torch.Tensor | None):
    """Within the context, :class:`ExampleDropout` layers draw row ``b``'s mask from ``ids[b]``.

    Args:
        ids: int64 ``(B,)`` example ids of the batch being computed, or ``None`` (nothing set).
    """
    token = _IDS.set(ids)
    try:
        yield
    finally:
        _IDS.reset(token)


def _mix(seed: int, site: int, example: int) -> int:
    """A 63-bit generator seed from ``(seed, site, example)`` (splitmix64's finalizer over their mix)."""
    z = (seed * _MIX[0] + site * _MIX[1] + example * _MIX[2] + _MIX[0]) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * _MIX[1]) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * _MIX[2]) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


class ExampleDropout(nn.Module):
    """Dropout whose mask for each row of dim 0 depends only on ``(seed, site, example id)``.

    Args:
        p: probability of dropping a value, in ``[0, 1)``.
        site: this layer's number within the model, so that layers draw different masks.
        seed: the run's seed.

    Forward: ``x`` of shape ``(B, ...)``, any floating dtype and device. In training mode it returns
    ``x * mask / (1 - p)``, with row ``b``'s mask drawn from ``ids[b]`` of the enclosing
    :func:`example_ids`. In eval mode, or with ``p == 0``, it returns ``x``.

    Raises:
        ValueError: ``p`` outside ``[0, 1)``.
        RuntimeError: training forward outside :func:`example_ids`, or ``len(ids) != B``.
    """

    def __init__(self, p: float, site: int, seed: int) -> None:
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"ExampleDropout: p must be in [0, 1), got {p}")
        self.p, self.site, self.seed = float(p), int(site), int(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        ids = _IDS.get()
        if ids is None:
            raise RuntimeError("ExampleDropout in training needs the batch's example ids: run the forward inside "
                               "dgpipe.models.example_dropout.example_ids(ids) (the pipeline does, from sample ids)")
        if ids.numel() != x.shape[0]:
            raise RuntimeError(f"ExampleDropout: {ids.numel()} example ids for a batch of {x.shape[0]} rows")
        keep = torch.stack([
            torch.rand(x.shape[1:], generator=torch.Generator().manual_seed(_mix(self.seed, self.site, int(i))))
            >= self.p for i in ids.tolist()])
        return x * keep.to(device=x.device, dtype=x.dtype) / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}, seed={self.seed}"


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention whose probabilities go through ``module.dropout`` (an
    :class:`ExampleDropout` after :func:`use_example_dropout`). Shapes: query/key/value ``(B, heads,
    L, head_dim)``, an additive ``attention_mask`` broadcastable to ``(B, heads, L, L)``; returns
    ``(output (B, L, heads, head_dim), probabilities (B, heads, L, L))``."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout > 0:
        probs = module.dropout(probs)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def use_example_dropout(model: nn.Module, seed: int) -> nn.Module:
    """Swap every ``nn.Dropout`` of ``model`` for an :class:`ExampleDropout` of the same ``p`` (in place).

    Sites are numbered in ``named_modules`` order, so two copies of a model draw the same masks.
    A transformers model (one with a ``config``) is switched to the attention function
    :data:`ATTENTION`, so its attention probabilities use their module's ``ExampleDropout`` too.
    Its masks are built as for eager attention (an additive float bias).

    Returns:
        ``model``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Dropout]
    for site, (name, m) in enumerate(targets):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, ExampleDropout(m.p, site, seed))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "_attn_implementation"):
        AttentionInterface.register(ATTENTION, _attention)
        AttentionMaskInterface.register(ATTENTION, eager_mask)
        config._attn_implementation = ATTENTION
    return model
