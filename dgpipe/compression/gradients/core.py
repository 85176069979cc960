"""Shared base of the gradient codecs (onebit, qsgd, terngrad, dgc, atomo).

Two things every one of them needs:

- :func:`check_gradient`: the input policy. A gradient codec takes a floating tensor
  (float32, float16, bfloat16 or float64; any shape, CPU or CUDA) and rejects inf and
  NaN with a ``ValueError``: a scale (mean magnitude, norm, max) computed over a
  non-finite tensor would turn every decoded value into garbage.
- :class:`SeededCodec`: deterministic randomness. Each ``encode`` draws its random
  numbers from a fresh ``torch.Generator`` seeded with ``mix_seed(seed, step)``, where
  ``step`` counts the encodes of this instance. The same seed and the same sequence of
  inputs give the same payloads, on any device, and the only state to checkpoint is
  the integer ``step`` (:meth:`SeededCodec.state_dict`). Decoding never needs the
  randomness of these codecs, so the seed does not travel in the header.
"""

from __future__ import annotations

import torch

from ..base import Codec

__all__ = ["check_gradient", "mix_seed", "SeededCodec"]

_MASK64 = (1 << 64) - 1


def check_gradient(x: torch.Tensor, codec_name: str) -> None:
    """Raise ``ValueError`` unless ``x`` is a floating tensor with only finite values.

    Args:
        x: the tensor to encode (any shape; float32, float16, bfloat16 or float64).
        codec_name: named in the message.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{codec_name} codec needs a floating tensor (float32/float16/bfloat16/float64), got {got}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(
            f"{codec_name} codec got inf/NaN values: its scale would make every decoded value garbage; "
            "skip such steps (torch.amp.GradScaler does) or clip the gradients before encoding"
        )


def mix_seed(*values: int) -> int:
    """Combine integers into one seed in ``[0, 2**62)`` (SplitMix64 finaliser, Steele et
    al. 2014); 62 bits, so that a seed fits a header parameter.

    Nearby inputs (seed, step), (seed, step + 1) give unrelated seeds.
    """
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 2


class SeededCodec(Codec):
    """Base of codecs whose encode is random: a seed plus a counter of encodes.

    Args:
        seed: any integer; encodes of instances with equal seeds draw equal numbers.
    """

    def __init__(self, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{self.name}: seed must be an int, got {seed!r}")
        self.seed = seed
        self._step = 0

    def _next_generator(self, device: torch.device) -> torch.Generator:
        """A generator on ``device`` seeded with ``mix_seed(seed, step)``; advances ``step``."""
        gen = torch.Generator(device=device)
        gen.manual_seed(mix_seed(self.seed, self._step))
        self._step += 1
        return gen

    def state_dict(self) -> dict:
        """``{"step": int}``: the number of encodes so far (all the state there is)."""
        return {"step": self._step}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; raises ``ValueError`` on a bad step."""
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{self.name}: state 'step' must be a non-negative int, got {step!r}")
        self._step = step
