"""Stateful wrappers around any codec: each owns its state and says so.

- :mod:`.feedback`: :class:`.feedback.ErrorFeedback`, the compression error added back
  into the next tensor (gradients);
- :mod:`.delta`: :class:`.delta.DeltaCoder` and :class:`.delta.DeltaCache`, the change
  against a per-example reconstruction both sides hold (AQ-SGD);
- :mod:`.reference`: :class:`.reference.ReferenceCoder` and :class:`.reference.TokenTable`, the
  residual against a per-token reference both sides build from what crossed the link.
"""

from .delta import DeltaCache, DeltaCoder, DeltaSpec
from .reference import ReferenceCoder, TokenReference, TokenTable
from .feedback import ErrorFeedback

__all__ = ["DeltaCache", "DeltaCoder", "DeltaSpec", "ErrorFeedback", "ReferenceCoder", "TokenReference", "TokenTable"]
